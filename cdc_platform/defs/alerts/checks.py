"""The check alert sensor: it alerts on state changes, ``check_failed`` when a check goes from
passed (or unknown) to failed, ``check_recovered`` when it passes again; a check that fails run
after run alerts once. A check whose result lists files (``no_quarantined_files``) also alerts
when a new file joins the set, naming the new files only. Delivery is
``defs.alerts.webhook.deliver``'s."""

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from cdc_platform.defs.alerts.webhook import (
    ALERT_INTERVAL_SECONDS,
    AlertWebhookResource,
    deliver,
    metadata_int,
    partition_for_run,
    queued,
)
from cdc_platform.lib.fleet.alerts import (
    build_alert,
)
from cdc_platform.lib.history import invariants

CHECK_ALERT_SENSOR_NAME = "cdc_check_failure_alerts"
# Check evaluations read per event-log query; a tick reads at most CHECK_EVENT_PAGES pages (the
# rest on the next tick). 500 tables x 10 checks, all run in one hour, is 5,000 a hour.
CHECK_EVENT_PAGE = 1000
CHECK_EVENT_PAGES = 10


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
            state.pending.append(queued(payload))
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        failed = sum(c.kind == "check_failed" for c in changes)
        summary = (
            f"{failed} check(s) failing or newly listing files, {len(changes) - failed} "
            f"recovered, {len(state.failing)} failing; {delivered} alert(s) sent, "
            f"{len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_check_failure_alerts
