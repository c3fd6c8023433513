"""The sensors role: the landing sensors (one per table, ``per_table``, or one for all tables,
``all_tables``), the discovery sensor reporting unlisted landing folders (``discovery``), and
the sensor re-requesting downstream partitions that late data restated (``restatements``).
The alert sensors are the alerts role's (``defs.alerts``), the current tables' sensor the
tables role's (``defs.tables.current``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import dagster as dg

from cdc_platform.defs.sensors.all_tables import build_fleet_landing_sensor
from cdc_platform.defs.sensors.discovery import build_new_tables_sensor
from cdc_platform.defs.sensors.restatements import build_restatements_sensor
from cdc_platform.lib.config import PlatformConfig

if TYPE_CHECKING:  # the tables role builds on the per-table sensor module: no import cycle
    from cdc_platform.defs.tables import TableDefinitions


def definitions(
    platform: PlatformConfig,
    listed: PlatformConfig,
    tables: Sequence[TableDefinitions],
) -> dg.Definitions:
    """The landing sensors for ``tables`` and the discovery sensor. ``platform`` is the config
    with its discovered tables, ``listed`` the config as written (discovery reports the tables
    added from its ``discover:`` template as such)."""
    discovered = [t.name for t in platform.tables[len(listed.tables) :]]
    return dg.Definitions(
        sensors=[
            *_landing_sensors(platform, tables),
            build_new_tables_sensor(listed, discovered),
            build_restatements_sensor([t.asset.key for t in tables]),
        ]
    )


def _landing_sensors(
    platform: PlatformConfig, tables: Sequence[TableDefinitions]
) -> list[dg.SensorDefinition]:
    """A sensor per table, or (``landing_sensor: fleet``) one sensor for all of them."""
    if platform.landing_sensor == "per_table":
        return [t.sensor for t in tables if t.sensor is not None]
    if not tables:
        return []
    assets = {t.asset.key.to_user_string(): t.asset for t in tables}
    return [
        build_fleet_landing_sensor(
            platform.tables,
            platform.landing_root,
            platform.warehouse_root,
            assets,
            platform.tables_per_run,
        )
    ]
