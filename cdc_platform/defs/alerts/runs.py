"""The run-failure alert sensor: a failed run of this code location alerts once, naming its
table, partition and failed steps; a run that failed only on a blocking check is left to the
check alert (``defs.alerts.checks``). Delivery is ``defs.alerts.webhook.deliver``'s."""

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from cdc_platform.defs.alerts.webhook import (
    ALERT_INTERVAL_SECONDS,
    AlertWebhookResource,
    deliver,
    partition_for_run,
    queued,
    root_error,
    root_message,
)
from cdc_platform.defs.tags import TABLE_TAG
from cdc_platform.lib.fleet.alerts import (
    MAX_DETAIL_CHARS,
    build_alert,
)

RUN_FAILURE_SENSOR_NAME = "cdc_run_failure_alerts"
CHECK_FAILED_ERROR = "DagsterAssetCheckFailedError"  # a blocking check failed
# Run failures read per tick (the rest on the next tick).
RUN_FAILURE_PAGE = 100


def table_for_run(
    run: dg.DagsterRun, planned: Iterable[dg.AssetKey] | Callable[[], Iterable[dg.AssetKey]] = ()
) -> str:
    """The table a run was for: our tag, else its asset selection, else the assets it planned
    to materialize (a run of a whole asset job has no selection; ``planned`` may be a function,
    called only then), else the job name."""
    tagged = run.tags.get(TABLE_TAG)
    if tagged:
        return tagged
    keys_of = run.asset_selection or (planned() if callable(planned) else planned)
    keys = sorted({key.to_user_string() for key in keys_of})
    return ", ".join(keys) if keys else run.job_name


# A table's checks are one multi-asset check named ``<table>_invariants`` (defs.tables.checks).
CHECKS_STEP_SUFFIX = "_invariants"


def failed_tables(run: dg.DagsterRun, steps: Sequence[dg.DagsterEvent]) -> str | None:
    """For a run of several tables (``landing_sensor: fleet``), the tables whose steps failed
    (a table's step is named after it, its checks' step ``<table>_invariants``): the others in
    the run committed. None for any other run."""
    selected = {k.to_user_string() for k in run.asset_selection or ()}
    if len(selected) < 2:
        return None
    names = {(e.step_key or "").removesuffix(CHECKS_STEP_SUFFIX) for e in steps}
    failed = sorted(names & selected)
    return ", ".join(failed) if failed else None


def planned_asset_keys(instance: dg.DagsterInstance, run_id: str) -> list[dg.AssetKey]:
    records = instance.get_records_for_run(
        run_id=run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
    ).records
    events = (r.event_log_entry.dagster_event for r in records)
    return [e.asset_key for e in events if e is not None and e.asset_key is not None]


def step_failure_events(instance: dg.DagsterInstance, run_id: str) -> list[dg.DagsterEvent]:
    records = instance.get_records_for_run(
        run_id=run_id, of_type=dg.DagsterEventType.STEP_FAILURE
    ).records
    events = (r.event_log_entry.dagster_event for r in records)
    return [e for e in events if e is not None]


def failure_detail(steps: Sequence[dg.DagsterEvent], run_message: str | None) -> tuple[str, int]:
    """(one-line reason, number of failed steps) for a failed run, from its step failures
    (``run_message``, the run failure's own message, when no step failed)."""
    parts = []
    for event in steps:
        error = getattr(event.event_specific_data, "error", None)
        if error is not None:
            parts.append(f"{event.step_key}: {root_message(error)}")
    detail = "; ".join(parts) or (run_message or "run failed")
    return detail[:MAX_DETAIL_CHARS], len(steps)


def failed_only_on_checks(steps: Sequence[dg.DagsterEvent]) -> bool:
    """True when every failed step failed because blocking checks failed.

    The check alert sensor posts a ``check_failed`` alert for each check that starts failing,
    with the failing keys; a ``run_failed`` alert for the same cause would only be noise.
    """
    errors = [getattr(e.event_specific_data, "error", None) for e in steps]
    return bool(errors) and all(
        e is not None and getattr(root_error(e), "cls_name", None) == CHECK_FAILED_ERROR
        for e in errors
    )


def run_failed_payload(
    instance: dg.DagsterInstance, run: dg.DagsterRun, run_message: str | None, ui_base_url: str
) -> dict[str, Any] | None:
    """The ``run_failed`` alert for a failed run; None for a run failed only by blocking checks."""
    steps = step_failure_events(instance, run.run_id)
    if failed_only_on_checks(steps):
        return None
    detail, failed_steps = failure_detail(steps, run_message)
    return build_alert(
        "run_failed",
        table=failed_tables(run, steps)
        or table_for_run(run, lambda: planned_asset_keys(instance, run.run_id)),
        partition=partition_for_run(run.tags),
        check=None,
        counts={"failed_steps": failed_steps},
        run_id=run.run_id,
        ui_base_url=ui_base_url,
        detail=detail,
    )


def _in_this_code_location(context: dg.SensorEvaluationContext, run: dg.DagsterRun) -> bool:
    """The run's job is in the sensor's code location and repository (as Dagster's own run
    status sensors decide it; both None for a run and a sensor outside any: tests)."""
    origin = run.remote_job_origin
    location = context.code_location_origin.location_name if context.code_location_origin else None
    run_location = origin.repository_origin.code_location_origin.location_name if origin else None
    run_repository = origin.repository_origin.repository_name if origin else None
    return location == run_location and context.repository_name == run_repository


@dataclass
class RunAlertCursor:
    """The run failure sensor's cursor: ``after``, the storage id of the last run failure event
    read (None before the first tick), and the alerts not delivered yet, with their attempts."""

    after: int | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {"v": 1, "after": self.after, "pending": self.pending},
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | None) -> "RunAlertCursor":
        """An empty cursor starts from now. So does a foreign one; the cursor of the
        ``@run_failure_sensor`` this sensor replaced goes on from the event it last read."""
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
        except ValueError:
            return cls()
        if not isinstance(data, dict):
            return cls()
        if data.get("__class__") == "RunStatusSensorCursor":
            record_id = data.get("record_id")
            return cls(after=record_id if isinstance(record_id, int) else None)
        if data.get("v") != 1:
            raise ValueError("unsupported run failure alert cursor; reset the sensor cursor")
        after = data.get("after")
        return cls(
            after=after if isinstance(after, int) else None,
            pending=list(data.get("pending") or []),
        )


def build_run_failure_alert_sensor(
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    monitor_all_code_locations: bool = False,
    minimum_interval_seconds: int = ALERT_INTERVAL_SECONDS,
) -> dg.SensorDefinition:
    """A sensor posting a ``run_failed`` alert naming the table and partition(s) of every run
    that failed (not one failed only by blocking checks: the check alert covers it).

    It reads the run failure events after its cursor (one event-log query a tick, and one run
    query), so an alert that cannot be delivered stays in the cursor and is retried on later
    ticks, never lost. The first tick (or a reset cursor) starts from the latest failure then.
    It needs the :class:`AlertWebhookResource` bound as ``alert_webhook``.
    """

    @dg.sensor(
        name=RUN_FAILURE_SENSOR_NAME,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Posts a run_failed alert to the configured webhook for every failed run; "
        "undeliverable alerts are retried on later ticks.",
    )
    def cdc_run_failure_alerts(
        context: dg.SensorEvaluationContext, alert_webhook: AlertWebhookResource
    ) -> dg.SensorResult:
        state = RunAlertCursor.from_json(context.cursor)
        instance = context.instance
        found = 0
        if state.after is None:
            latest = instance.fetch_run_status_changes(
                dg.DagsterEventType.RUN_FAILURE, limit=1
            ).records
            state.after = latest[0].storage_id if latest else 0
        else:
            records = instance.fetch_run_status_changes(
                dg.RunStatusChangeRecordsFilter(
                    event_type=dg.DagsterEventType.RUN_FAILURE, after_storage_id=state.after
                ),
                limit=RUN_FAILURE_PAGE,
                ascending=True,
            ).records
            run_ids = sorted({r.event_log_entry.run_id for r in records})
            runs = (
                {
                    r.dagster_run.run_id: r.dagster_run
                    for r in instance.get_run_records(filters=dg.RunsFilter(run_ids=run_ids))
                }
                if run_ids
                else {}
            )
            for record in records:
                state.after = max(state.after, record.storage_id)
                run = runs.get(record.event_log_entry.run_id)
                if run is None:  # deleted since
                    continue
                if not monitor_all_code_locations and not _in_this_code_location(context, run):
                    continue
                event = record.event_log_entry.dagster_event
                payload = run_failed_payload(
                    instance,
                    run,
                    event.message if event is not None else None,
                    alert_webhook.ui_base_url,
                )
                if payload is None:
                    context.log.info(
                        f"run {run.run_id} failed on blocking checks, alerted per check"
                    )
                    continue
                found += 1
                state.pending.append(queued(payload))
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        summary = (
            f"{found} new failed run(s), {delivered} alert(s) sent, {len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_run_failure_alerts
