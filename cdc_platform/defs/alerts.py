"""Alerting in Dagster: a webhook resource and two sensors, one for failed checks, one for
failed runs.

The payloads come from :mod:`cdc_platform.lib.alerts`. With no webhook configured, alerts are
logged and dropped, so a laptop or CI setup needs no secret. Bind the resource under the key
``alert_webhook`` (see :func:`alert_webhook_from_env`).

Checks never send anything themselves: a check's result is recorded whatever happens to a
notification. The check alert sensor reads the failed check evaluations the instance recorded
and posts them; a delivery failure is logged (URL redacted) and retried on later ticks, a
bounded number of times.
"""

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from cdc_platform.defs.sensors import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG, TABLE_TAG
from cdc_platform.lib import invariants
from cdc_platform.lib.alerts import (
    MAX_DETAIL_CHARS,
    AlertDeliveryError,
    build_alert,
    post_alert,
    redact_url,
)

ALERT_WEBHOOK_ENV_VAR = "CDC_ALERT_WEBHOOK_URL"
ALERT_RESOURCE_KEY = "alert_webhook"
RUN_FAILURE_SENSOR_NAME = "cdc_run_failure_alerts"
CHECK_ALERT_SENSOR_NAME = "cdc_check_failure_alerts"
CHECK_FAILED_ERROR = "DagsterAssetCheckFailedError"  # a blocking check failed
# An undeliverable alert is tried on this many ticks in all, then dropped with an error log.
MAX_DELIVERY_ATTEMPTS = 5
# At most this many undelivered alerts wait in the cursor (the oldest are dropped first).
MAX_PENDING_ALERTS = 100
# Executions read per check and tick; a check failing more often than this between two ticks
# (one execution per run of its table) would lose alerts.
CHECK_HISTORY_WINDOW = 20


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

    The check alert sensor posts a ``check_failed`` alert for each failed check, with the failing
    keys; a second ``run_failed`` alert for the same cause would only be noise.
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
) -> dg.SensorDefinition:
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


# --- failed checks ----------------------------------------------------------------------------


@dataclass
class CheckAlertCursor:
    """What the check alert sensor remembers between ticks (serialised as the sensor cursor).

    Per check: ``low``, the execution id at or below which everything is handled, and ``seen``,
    the handled execution ids above it (an execution's id is fixed when the check is *planned*,
    so a later id can be evaluated first: a single high-water mark would skip the earlier one).
    ``pending``: alerts not delivered yet, with the number of attempts so far.
    """

    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {"v": 1, "checks": self.checks, "pending": self.pending},
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | None) -> "CheckAlertCursor | None":
        """None for an empty cursor (first tick, or reset from the UI)."""
        if not raw:
            return None
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != 1:
            raise ValueError("unsupported check alert cursor; reset the sensor cursor")
        return cls(checks=dict(data.get("checks") or {}), pending=list(data.get("pending") or []))


def _failed_evaluations(
    instance: dg.DagsterInstance, key: dg.AssetCheckKey
) -> tuple[list[int], list[tuple[int, str, dg.AssetCheckEvaluation]]]:
    """(ids of the latest executions, [(id, run_id, evaluation)] of those that failed)."""
    records = instance.event_log_storage.get_asset_check_execution_history(
        key, limit=CHECK_HISTORY_WINDOW
    )
    failed = []
    for r in records:
        evaluation = r.event.asset_check_evaluation if r.event is not None else None
        if evaluation is not None and not evaluation.passed:
            failed.append((r.id, r.run_id, evaluation))
    return [r.id for r in records], sorted(failed, key=lambda f: f[0])


def metadata_int(value: object) -> int:
    """``int()`` of a number a check or materialization recorded as metadata (a TypeError else)."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"metadata value is not a number: {type(value).__name__}")


def check_failed_payload(
    instance: dg.DagsterInstance,
    run_id: str,
    evaluation: dg.AssetCheckEvaluation,
    ui_base_url: str,
) -> dict[str, Any]:
    """The ``check_failed`` alert for one recorded evaluation (its metadata holds the figures)."""
    meta = {k: v.value for k, v in evaluation.metadata.items()}
    counts = {"failing_keys": metadata_int(meta.get("failing_keys") or 0)}
    if meta.get("checked_keys") is not None:
        counts["checked_keys"] = metadata_int(meta["checked_keys"])
    run = instance.get_run_by_id(run_id)
    sample = meta.get("sample")
    return build_alert(
        "check_failed",
        table=evaluation.asset_key.to_user_string(),
        partition=partition_for_run(run.tags) if run is not None else None,
        check=evaluation.check_name,
        counts=counts,
        run_id=run_id,
        ui_base_url=ui_base_url,
        detail=str(meta.get("detail") or invariants.DESCRIPTIONS.get(evaluation.check_name, "")),
        sample_keys=list(sample) if isinstance(sample, list) else None,
    )


def deliver(
    context: dg.SensorEvaluationContext,
    alert_webhook: AlertWebhookResource,
    pending: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], int]:
    """Try every pending alert once; return (still pending, number delivered).

    ``pending`` holds ``{"payload": ..., "attempts": n}`` items, as a sensor cursor keeps them.
    A delivery error never raises: the alert stays pending (logged, URL redacted) until it has
    been tried ``MAX_DELIVERY_ATTEMPTS`` times; at most ``MAX_PENDING_ALERTS`` are kept.
    """
    left: list[dict[str, Any]] = []
    delivered = 0
    for item in pending:
        payload, attempts = item["payload"], int(item["attempts"]) + 1
        try:
            sent = alert_webhook.send(payload)
        except AlertDeliveryError as exc:  # its message is redacted already
            if attempts >= MAX_DELIVERY_ATTEMPTS:
                context.log.error(
                    f"giving up on alert after {attempts} attempts: {exc}; "
                    f"alert was: {payload.get('text')}"
                )
            else:
                context.log.warning(f"alert not delivered (attempt {attempts}, will retry): {exc}")
                left.append({"payload": payload, "attempts": attempts})
            continue
        delivered += int(sent)
    if len(left) > MAX_PENDING_ALERTS:
        dropped = left[: len(left) - MAX_PENDING_ALERTS]
        context.log.error(f"dropping {len(dropped)} undelivered alert(s): too many pending")
        left = left[-MAX_PENDING_ALERTS:]
    return left, delivered


def build_check_failure_alert_sensor(
    check_keys: Sequence[dg.AssetCheckKey],
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds: int = 30,
) -> dg.SensorDefinition:
    """A sensor posting one ``check_failed`` alert per failed evaluation of ``check_keys``.

    It reads the evaluations the instance recorded (whatever run or job made them), so a check
    never waits on, or fails because of, a webhook. The first tick (or a reset cursor) starts
    from what is recorded then, like Dagster's run status sensors: no alerts for old failures.
    """
    keys = list(check_keys)

    @dg.sensor(
        name=CHECK_ALERT_SENSOR_NAME,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Posts a check_failed alert to the configured webhook for every failed "
        "invariant check; undeliverable alerts are retried on later ticks.",
    )
    def cdc_check_failure_alerts(
        context: dg.SensorEvaluationContext, alert_webhook: AlertWebhookResource
    ) -> dg.SensorResult:
        previous = CheckAlertCursor.from_json(context.cursor)
        state = CheckAlertCursor(pending=list(previous.pending) if previous else [])
        found = 0
        for key in keys:
            name = key.to_user_string()
            ids, failed = _failed_evaluations(context.instance, key)
            if previous is None or name not in previous.checks:
                # Baseline: the failures recorded now are history, not news. (An execution still
                # planned now is not in `seen`: it alerts if it fails.)
                low = min(ids) - 1 if len(ids) >= CHECK_HISTORY_WINDOW else 0
                state.checks[name] = {"low": low, "seen": [i for i, _, _ in failed if i > low]}
                continue
            low = int(previous.checks[name]["low"])
            seen = {int(i) for i in previous.checks[name]["seen"]}
            for execution_id, run_id, evaluation in failed:
                if execution_id > low and execution_id not in seen:
                    seen.add(execution_id)
                    found += 1
                    payload = check_failed_payload(
                        context.instance, run_id, evaluation, alert_webhook.ui_base_url
                    )
                    state.pending.append({"payload": payload, "attempts": 0})
            # Ids older than the window can no longer show up: fold them into `low`.
            if len(ids) >= CHECK_HISTORY_WINDOW:
                low = max(low, min(ids) - 1)
            state.checks[name] = {"low": low, "seen": sorted(i for i in seen if i > low)}
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        summary = (
            f"{found} new failed check(s), {delivered} alert(s) sent, {len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_check_failure_alerts
