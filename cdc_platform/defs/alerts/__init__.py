"""The alerts role: the webhook resource (``webhook``) and the sensors that post through it, on
check state changes (``checks``), failed runs (``runs``) and what no run reports: stale
sources, unapplied hours, failing sensors (``sources``). The new-table report is the discovery
sensor's (``defs.sensors.discovery``).
"""

from collections.abc import Sequence

import dagster as dg

from cdc_platform.defs.alerts.checks import build_check_failure_alert_sensor
from cdc_platform.defs.alerts.runs import build_run_failure_alert_sensor
from cdc_platform.defs.alerts.sources import build_source_alert_sensor
from cdc_platform.defs.alerts.webhook import ALERT_RESOURCE_KEY, alert_webhook_from_env
from cdc_platform.lib.config import PlatformConfig


def definitions(
    platform: PlatformConfig,
    check_keys: Sequence[dg.AssetCheckKey],
    watched: Sequence[str],
) -> dg.Definitions:
    """The alert sensors and their webhook. ``check_keys``: every table's checks; ``watched``:
    the other sensors, whose failing ticks the source alert sensor reports (the check and run
    alert sensors are watched too; it cannot alert on itself)."""
    alert_sensors = [build_check_failure_alert_sensor(check_keys), build_run_failure_alert_sensor()]
    watched = [*watched, *(s.name for s in alert_sensors)]
    return dg.Definitions(
        sensors=[*alert_sensors, build_source_alert_sensor(platform.tables, watched)],
        resources={ALERT_RESOURCE_KEY: alert_webhook_from_env()},
    )
