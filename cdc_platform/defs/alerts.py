"""Alerting in Dagster: a webhook resource and two sensors, one for check state changes, one
for failed runs.

The payloads come from :mod:`cdc_platform.lib.fleet.alerts`. With no webhook configured, alerts are
logged and dropped, so a laptop or CI setup needs no secret. Bind the resource under the key
``alert_webhook`` (see :func:`alert_webhook_from_env`).

Checks and runs never send anything themselves: a check's result or a run's failure is
recorded whatever happens to a notification. Each sensor reads what the instance recorded since
its cursor (a storage id in the event log: one query a tick, whatever the number of tables),
queues the alerts in its cursor and posts them; a delivery failure is logged (URL redacted) and
retried on later ticks, a bounded number of times.

The check sensor alerts on state changes: ``check_failed`` when a check goes from passed (or
unknown) to failed, ``check_recovered`` when it passes again; a check that fails run after run
alerts once. A check whose result lists files (``no_quarantined_files``) also alerts when a new
file joins the set, naming the new files only.
"""

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from cdc_platform.defs.sensors import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG, TABLE_TAG
from cdc_platform.lib.fleet.alerts import (
    MAX_DETAIL_CHARS,
    AlertDeliveryError,
    build_alert,
    post_alert,
    redact_url,
)
from cdc_platform.lib.history import invariants

ALERT_WEBHOOK_ENV_VAR = "CDC_ALERT_WEBHOOK_URL"
UI_BASE_URL_ENV_VAR = "CDC_UI_BASE_URL"
DEFAULT_UI_BASE_URL = "http://localhost:3000"
ALERT_RESOURCE_KEY = "alert_webhook"
RUN_FAILURE_SENSOR_NAME = "cdc_run_failure_alerts"
CHECK_ALERT_SENSOR_NAME = "cdc_check_failure_alerts"
CHECK_FAILED_ERROR = "DagsterAssetCheckFailedError"  # a blocking check failed
# An undeliverable alert is tried on this many ticks in all, then dropped with an error log.
MAX_DELIVERY_ATTEMPTS = 5
# At most this many undelivered alerts wait in a cursor (the oldest are dropped first).
MAX_PENDING_ALERTS = 100
# Seconds a tick spends delivering: the rest wait for the next tick, their attempts not counted
# (a webhook that hangs would otherwise hold the tick past Dagster's sensor timeout).
DELIVERY_BUDGET_SECONDS = 20.0
# Check evaluations read per event-log query; a tick reads at most CHECK_EVENT_PAGES pages (the
# rest on the next tick). 500 tables x 10 checks, all run in one hour, is 5,000 a hour.
CHECK_EVENT_PAGE = 1000
CHECK_EVENT_PAGES = 10
# Run failures read per tick (the rest on the next tick).
RUN_FAILURE_PAGE = 100

# How often the alert sensors read what the instance recorded. Each evaluation costs the code
# server a fresh instance and the daemon a tick record, whatever the fleet's size (the idle
# figures in benchmarks/fleet.py); for hourly data an alert up to a minute later loses nothing.
ALERT_INTERVAL_SECONDS = 60


class AlertWebhookResource(dg.ConfigurableResource):
    """Posts alert payloads to a Slack-compatible incoming webhook (no-op without a URL)."""

    webhook_url: str | None = None
    ui_base_url: str = DEFAULT_UI_BASE_URL
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


def alert_webhook_from_env(ui_base_url: str = DEFAULT_UI_BASE_URL) -> AlertWebhookResource:
    """The resource wired to ``CDC_ALERT_WEBHOOK_URL`` and ``CDC_UI_BASE_URL`` via ``dg.EnvVar``.

    Dagster fails any run or sensor tick that uses an ``EnvVar`` naming an unset variable, so an
    EnvVar is only used when its variable is set: otherwise alerts are a logged no-op (no
    webhook), and their links point at ``ui_base_url`` (no UI address).
    """
    settings: dict[str, Any] = {"ui_base_url": ui_base_url}
    if os.environ.get(ALERT_WEBHOOK_ENV_VAR):
        settings["webhook_url"] = dg.EnvVar(ALERT_WEBHOOK_ENV_VAR)
    if os.environ.get(UI_BASE_URL_ENV_VAR):
        settings["ui_base_url"] = dg.EnvVar(UI_BASE_URL_ENV_VAR)
    return AlertWebhookResource(**settings)


# --- delivery ---------------------------------------------------------------------------------


def deliver(
    context: dg.SensorEvaluationContext,
    alert_webhook: AlertWebhookResource,
    pending: list[dict[str, Any]],
    budget_seconds: float | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Try the pending alerts once each, oldest first; return (still pending, number delivered).

    ``pending`` holds ``{"payload": ..., "attempts": n}`` items, as a sensor cursor keeps them.
    A delivery error never raises: the alert stays pending (logged, URL redacted) until it has
    been tried ``MAX_DELIVERY_ATTEMPTS`` times. Once ``budget_seconds`` are spent, the rest wait
    for the next tick untried (default ``DELIVERY_BUDGET_SECONDS``). At most
    ``MAX_PENDING_ALERTS`` are kept.
    """
    left: list[dict[str, Any]] = []
    delivered = 0
    if budget_seconds is None:
        budget_seconds = DELIVERY_BUDGET_SECONDS
    deadline = time.monotonic() + budget_seconds
    for index, item in enumerate(pending):
        if time.monotonic() >= deadline:
            context.log.warning(
                f"{len(pending) - index} alert(s) left for the next tick (delivery took "
                f"{budget_seconds:g}s this tick)"
            )
            left.extend(pending[index:])
            break
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


def _queued(payload: dict[str, Any]) -> dict[str, Any]:
    return {"payload": payload, "attempts": 0}


# --- runs -------------------------------------------------------------------------------------


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


# A table's checks are one multi-asset check named ``<table>_invariants`` (defs.factory).
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


def failure_detail(steps: Sequence[dg.DagsterEvent], run_message: str | None) -> tuple[str, int]:
    """(one-line reason, number of failed steps) for a failed run, from its step failures
    (``run_message``, the run failure's own message, when no step failed)."""
    parts = []
    for event in steps:
        error = getattr(event.event_specific_data, "error", None)
        if error is not None:
            parts.append(f"{event.step_key}: {_root_message(error)}")
    detail = "; ".join(parts) or (run_message or "run failed")
    return detail[:MAX_DETAIL_CHARS], len(steps)


def failed_only_on_checks(steps: Sequence[dg.DagsterEvent]) -> bool:
    """True when every failed step failed because blocking checks failed.

    The check alert sensor posts a ``check_failed`` alert for each check that starts failing,
    with the failing keys; a ``run_failed`` alert for the same cause would only be noise.
    """
    errors = [getattr(e.event_specific_data, "error", None) for e in steps]
    return bool(errors) and all(
        e is not None and getattr(_root_error(e), "cls_name", None) == CHECK_FAILED_ERROR
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
                state.pending.append(_queued(payload))
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        summary = (
            f"{found} new failed run(s), {delivered} alert(s) sent, {len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_run_failure_alerts


# --- checks -----------------------------------------------------------------------------------


def _digest(name: str) -> str:
    """A file name as the cursor remembers it (12 hex digits: a cursor stays small)."""
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=6).hexdigest()


@dataclass
class CheckAlertCursor:
    """What the check alert sensor remembers between ticks (serialised as the sensor cursor).

    ``after``: the storage id of the last check evaluation read (None before the first tick).
    ``failing``: the checks (``asset:check``) whose latest evaluation failed, each with
    ``n``, its failing count, and for a check listing files (``no_quarantined_files``)
    ``files``, digests of the files it listed; a passing or unknown check is not in it, so the
    cursor grows with what fails, not with the number of tables.
    ``pending``: alerts not delivered yet, with the number of attempts so far.
    """

    after: int | None = None
    failing: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {"v": 2, "after": self.after, "failing": self.failing, "pending": self.pending},
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | None) -> "CheckAlertCursor":
        """An empty cursor (first tick, or reset from the UI) starts from now. A version 1
        cursor (one read per check) keeps its pending alerts and starts from now."""
        if not raw:
            return cls()
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") not in (1, 2):
            raise ValueError("unsupported check alert cursor; reset the sensor cursor")
        pending = list(data.get("pending") or [])
        if data["v"] == 1:
            return cls(pending=pending)
        after = data.get("after")
        return cls(
            after=after if isinstance(after, int) else None,
            failing=dict(data.get("failing") or {}),
            pending=pending,
        )


def metadata_int(value: object) -> int:
    """``int()`` of a number a check or materialization recorded as metadata (a TypeError else)."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"metadata value is not a number: {type(value).__name__}")


def _severity(evaluation: dg.AssetCheckEvaluation) -> str:
    return "WARN" if evaluation.severity == dg.AssetCheckSeverity.WARN else "ERROR"


def check_alert_payload(
    kind: str,
    run: dg.DagsterRun | None,
    run_id: str,
    evaluation: dg.AssetCheckEvaluation,
    ui_base_url: str,
    files: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``check_failed`` or ``check_recovered`` alert for one recorded evaluation (its
    metadata holds the figures); ``files``: the files to name (new in the check's list)."""
    meta = {k: v.value for k, v in evaluation.metadata.items()}
    counts = {"failing_keys": metadata_int(meta.get("failing_keys") or 0)}
    if meta.get("checked_keys") is not None:
        counts["checked_keys"] = metadata_int(meta["checked_keys"])
    sample = meta.get("sample")
    samples = list(sample) if isinstance(sample, list) else None
    if files is not None and samples is not None:  # the reasons of the files named, if sampled
        named = set(files)
        samples = [s for s in samples if isinstance(s, dict) and s.get("file") in named]
    failed = kind == "check_failed"
    return build_alert(
        "check_failed" if failed else "check_recovered",
        table=evaluation.asset_key.to_user_string(),
        partition=partition_for_run(run.tags) if run is not None else None,
        check=evaluation.check_name,
        counts=counts,
        run_id=run_id,
        ui_base_url=ui_base_url,
        detail=str(meta.get("detail") or invariants.DESCRIPTIONS.get(evaluation.check_name, ""))
        if failed
        else "",
        sample_keys=samples if failed else None,
        severity=_severity(evaluation),
        files=files,
    )


def _listed_files(evaluation: dg.AssetCheckEvaluation) -> list[str] | None:
    """The files a failing evaluation lists (``files`` metadata), None for a check listing none."""
    value = evaluation.metadata.get("files")
    listed = value.value if value is not None else None
    return [str(f) for f in listed] if isinstance(listed, list) else None


@dataclass
class _Change:
    """A state change to alert: kind, the evaluation, its run, the files to name."""

    kind: str
    run_id: str
    evaluation: dg.AssetCheckEvaluation
    files: list[str] | None = None


def _transition(
    failing: dict[str, dict[str, Any]], name: str, run_id: str, evaluation: dg.AssetCheckEvaluation
) -> _Change | None:
    """Apply one evaluation to the remembered state; the alert it calls for, if any."""
    if evaluation.passed:
        if failing.pop(name, None) is None:
            return None  # passed before (or unknown): nothing to say
        return _Change("check_recovered", run_id, evaluation)
    meta = evaluation.metadata.get("failing_keys")
    count = metadata_int(meta.value) if meta is not None and meta.value is not None else 0
    listed = _listed_files(evaluation)
    before = failing.get(name)
    state: dict[str, Any] = {"n": count}
    if listed is not None:
        state["files"] = sorted({_digest(f) for f in listed})
    failing[name] = state
    if before is None:
        return _Change("check_failed", run_id, evaluation, listed)
    if listed is None:
        return None  # still failing: alerted when it started
    known = set(before.get("files") or [])
    new = [f for f in listed if _digest(f) not in known]
    # A check lists only its first files: more of them, none new in the list, is news too.
    grew = count > len(listed) and count > int(before.get("n") or 0)
    if new or grew:
        return _Change("check_failed", run_id, evaluation, new)
    return None


def _check_evaluations(
    storage: Any, after: int
) -> Iterable[tuple[int, str, dg.AssetCheckEvaluation | None]]:
    """(storage id, run id, evaluation) of the check evaluations recorded after ``after``, in
    order (evaluation None for an entry that holds none): one event-log query per
    ``CHECK_EVENT_PAGE`` evaluations, at most ``CHECK_EVENT_PAGES`` queries a tick (the rest
    are read on the next tick)."""
    for _ in range(CHECK_EVENT_PAGES):
        page = storage.get_logs_for_all_runs_by_log_id(
            after_cursor=after,
            dagster_event_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION,
            limit=CHECK_EVENT_PAGE,
        )
        for storage_id in sorted(page):
            entry = page[storage_id]
            after = max(after, storage_id)
            event = entry.dagster_event
            data = event.event_specific_data if event is not None else None
            yield (
                storage_id,
                entry.run_id,
                data if isinstance(data, dg.AssetCheckEvaluation) else None,
            )
        if len(page) < CHECK_EVENT_PAGE:
            return


def build_check_failure_alert_sensor(
    check_keys: Sequence[dg.AssetCheckKey],
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds: int = ALERT_INTERVAL_SECONDS,
) -> dg.SensorDefinition:
    """A sensor posting ``check_failed`` / ``check_recovered`` alerts when a check of
    ``check_keys`` changes state (and, for a check listing files, when a new file is listed).

    It reads the evaluations the instance recorded after its cursor (whatever run or job made
    them) with one event-log query a tick, whatever the number of checks, and keeps those of
    ``check_keys``; so a check never waits on, or fails because of, a webhook. The first tick
    (or a reset cursor) starts from what is recorded then, like Dagster's run status sensors;
    a check then counts as unknown until its next evaluation (a failure alerts).
    """
    wanted = {key.to_user_string() for key in check_keys}

    @dg.sensor(
        name=CHECK_ALERT_SENSOR_NAME,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Posts a check_failed alert to the configured webhook when an invariant "
        "check starts failing (or lists a new set-aside file), and a check_recovered alert "
        "when it passes again; undeliverable alerts are retried on later ticks.",
    )
    def cdc_check_failure_alerts(
        context: dg.SensorEvaluationContext, alert_webhook: AlertWebhookResource
    ) -> dg.SensorResult:
        state = CheckAlertCursor.from_json(context.cursor)
        storage = context.instance.event_log_storage
        changes: list[_Change] = []
        if state.after is None:
            state.after = storage.get_maximum_record_id() or 0
        else:
            for storage_id, run_id, evaluation in _check_evaluations(storage, state.after):
                state.after = max(state.after, storage_id)
                if evaluation is None:
                    continue
                name = evaluation.asset_check_key.to_user_string()
                if name not in wanted:  # another code location's check
                    continue
                change = _transition(state.failing, name, run_id, evaluation)
                if change is not None:
                    changes.append(change)
        run_ids = sorted({c.run_id for c in changes if c.run_id})
        runs = (
            {
                r.dagster_run.run_id: r.dagster_run
                for r in context.instance.get_run_records(filters=dg.RunsFilter(run_ids=run_ids))
            }
            if run_ids
            else {}
        )
        for c in changes:
            payload = check_alert_payload(
                c.kind,
                runs.get(c.run_id),
                c.run_id,
                c.evaluation,
                alert_webhook.ui_base_url,
                files=c.files,
            )
            state.pending.append(_queued(payload))
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        failed = sum(c.kind == "check_failed" for c in changes)
        summary = (
            f"{failed} check(s) failing or newly listing files, {len(changes) - failed} "
            f"recovered, {len(state.failing)} failing; {delivered} alert(s) sent, "
            f"{len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_check_failure_alerts
