"""Alerting in Dagster: a webhook resource and a sensor that reports failed runs.

The payloads come from :mod:`cdc_platform.lib.alerts`. With no webhook configured, alerts are
logged and dropped, so a laptop or CI setup needs no secret. Bind the resource under the key
``alert_webhook`` (see :func:`alert_webhook_from_env`).
"""

import os
from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from cdc_platform.defs.sensors import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG, TABLE_TAG
from cdc_platform.lib.alerts import MAX_DETAIL_CHARS, build_alert, post_alert, redact_url

ALERT_WEBHOOK_ENV_VAR = "CDC_ALERT_WEBHOOK_URL"
ALERT_RESOURCE_KEY = "alert_webhook"
RUN_FAILURE_SENSOR_NAME = "cdc_run_failure_alerts"
CHECK_FAILED_ERROR = "DagsterAssetCheckFailedError"  # a blocking check failed


class AlertWebhookResource(dg.ConfigurableResource):
    """Posts alert payloads to a Slack-compatible incoming webhook (no-op without a URL)."""

    webhook_url: str | None = None
    ui_base_url: str = "http://localhost:3000"
    timeout_seconds: float = 10.0

    def send(self, payload: dict[str, Any]) -> bool:
        """True when posted; False when no webhook is configured. Raises AlertDeliveryError."""
        log = dg.get_dagster_logger()
        if not self.webhook_url:
            log.warning(
                f"no alert webhook configured ({ALERT_WEBHOOK_ENV_VAR}); alert not sent: {payload.get('text')}"
            )
            return False
        post_alert(self.webhook_url, payload, timeout=self.timeout_seconds)
        log.info(f"alert sent to {redact_url(self.webhook_url)}: {payload.get('text')}")
        return True


def alert_webhook_from_env(ui_base_url: str = "http://localhost:3000") -> AlertWebhookResource:
    """The resource wired to ``CDC_ALERT_WEBHOOK_URL`` via ``dg.EnvVar``.

    Dagster fails any run or sensor tick that uses an ``EnvVar`` naming an unset variable, so the
    EnvVar is only used when the variable is set; otherwise alerts are a logged no-op.
    """
    if os.environ.get(ALERT_WEBHOOK_ENV_VAR):
        return AlertWebhookResource(
            webhook_url=dg.EnvVar(ALERT_WEBHOOK_ENV_VAR), ui_base_url=ui_base_url
        )
    return AlertWebhookResource(ui_base_url=ui_base_url)


def table_for_run(run: dg.DagsterRun, planned: Iterable[dg.AssetKey] = ()) -> str:
    """The table a run was for: our tag, else its asset selection, else the assets it planned
    to materialize (a run of a whole asset job has no selection), else the job name."""
    tagged = run.tags.get(TABLE_TAG)
    if tagged:
        return tagged
    keys = sorted({key.to_user_string() for key in (run.asset_selection or planned)})
    return ", ".join(keys) if keys else run.job_name


def planned_asset_keys(context: dg.RunFailureSensorContext) -> list[dg.AssetKey]:
    records = context.instance.get_records_for_run(
        run_id=context.dagster_run.run_id,
        of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED,
    ).records
    events = (r.event_log_entry.dagster_event for r in records)
    return [e.asset_key for e in events if e is not None and e.asset_key is not None]


def partition_for_run(tags: Mapping[str, str]) -> str | None:
    """``dagster/partition``, or ``start..end`` for a single-run partition range."""
    if tags.get(PARTITION_TAG):
        return tags[PARTITION_TAG]
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    if start and end:
        return start if start == end else f"{start}..{end}"
    return None


def _root_error(error: Any) -> Any:
    """The innermost cause of a serialised error: the user's exception, not Dagster's wrapper."""
    while getattr(error, "cause", None) is not None:
        error = error.cause
    return error


def _root_message(error: Any) -> str:
    error = _root_error(error)
    cls_name = getattr(error, "cls_name", None)
    message = (getattr(error, "message", "") or "").strip()
    return f"{cls_name}: {message}" if cls_name and not message.startswith(cls_name) else message


def failure_detail(context: dg.RunFailureSensorContext) -> tuple[str, int]:
    """(one-line reason, number of failed steps) for a failed run."""
    steps = context.get_step_failure_events()
    parts = []
    for event in steps:
        error = getattr(event.event_specific_data, "error", None)
        if error is not None:
            parts.append(f"{event.step_key}: {_root_message(error)}")
    detail = "; ".join(parts) or (context.failure_event.message or "run failed")
    return detail[:MAX_DETAIL_CHARS], len(steps)


def failed_only_on_checks(context: dg.RunFailureSensorContext) -> bool:
    """True when every failed step failed because blocking checks failed.

    Each failed check has already posted its own ``check_failed`` alert, with the failing keys;
    a second ``run_failed`` alert for the same cause would only be noise.
    """
    errors = [
        getattr(e.event_specific_data, "error", None) for e in context.get_step_failure_events()
    ]
    return bool(errors) and all(
        e is not None and getattr(_root_error(e), "cls_name", None) == CHECK_FAILED_ERROR
        for e in errors
    )


def build_run_failure_alert_sensor(
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    monitor_all_code_locations: bool = False,
    minimum_interval_seconds: int | None = None,
) -> dg.RunStatusSensorDefinition:
    """A run failure sensor posting a ``run_failed`` alert naming the table and partition(s).

    It needs the :class:`AlertWebhookResource` bound as ``alert_webhook``. A delivery error
    fails the tick (with a redacted message) so the failure shows in the sensor's history.
    """

    @dg.run_failure_sensor(
        name=RUN_FAILURE_SENSOR_NAME,
        default_status=default_status,
        monitor_all_code_locations=monitor_all_code_locations,
        minimum_interval_seconds=minimum_interval_seconds,
        description="Posts a run_failed alert to the configured webhook for every failed run.",
    )
    def cdc_run_failure_alerts(
        context: dg.RunFailureSensorContext, alert_webhook: AlertWebhookResource
    ) -> None:
        run = context.dagster_run
        if failed_only_on_checks(context):
            context.log.info(
                f"run {run.run_id} failed on blocking checks, already alerted per check"
            )
            return
        detail, failed_steps = failure_detail(context)
        payload = build_alert(
            "run_failed",
            table=table_for_run(run, planned_asset_keys(context)),
            partition=partition_for_run(run.tags),
            check=None,
            counts={"failed_steps": failed_steps},
            run_id=run.run_id,
            ui_base_url=alert_webhook.ui_base_url,
            detail=detail,
        )
        alert_webhook.send(payload)

    return cdc_run_failure_alerts
