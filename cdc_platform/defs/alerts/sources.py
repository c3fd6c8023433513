"""Alerts for what no run reports: a source gone quiet, hours that stay unapplied, a sensor
whose ticks keep failing. Each is alerted once when it starts and once when it ends.

- ``source_stale`` / ``source_fresh``: Dagster's freshness daemon changed a table's freshness
  state (its ``expected_delivery_hours``): WARN and FAIL alert, PASS again recovers.
- ``hours_unapplied`` / ``hours_applied``: the landing sensor reports its backlog (hours
  requested and not yet seen applied, ``defs.sensors.per_table``) as an observation when it changes; an
  hour still in it after the table's ``unapplied_alert_minutes`` alerts.
- ``sensor_failing`` / ``sensor_recovered``: a sensor's last ``FAILING_TICKS`` ticks all
  failed (a landing root unmounted: ``check_landing_root``), and then one did not.

A tick reads the event log from a storage-id cursor (one query per event type, as the check
alert sensor reads) and the sensors' states (one query, plus one for each sensor whose latest
tick failed), whatever the number of tables. More than ``DIGEST_OVER`` alerts of one kind in a
tick go out as one digest (an unmounted landing root fails every table's sensor at once).
Delivery is ``defs.alerts.webhook.deliver``'s, retried from the cursor.
"""

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from dagster._core.definitions.freshness import FreshnessState, FreshnessStateChange
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.definitions.selector import InstigatorSelector
from dagster._core.scheduler.instigation import SensorInstigatorData, TickStatus

from cdc_platform.defs.alerts.webhook import (
    ALERT_INTERVAL_SECONDS,
    AlertWebhookResource,
    deliver,
    metadata_int,
    queued,
    root_message,
)
from cdc_platform.defs.tags import BACKLOG_AGE, BACKLOG_HOURS, BACKLOG_OLDEST, BACKLOG_SINCE
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet.alerts import source_alert, source_digest

SOURCE_ALERT_SENSOR_NAME = "cdc_source_alerts"
# A sensor is alerted once this many of its latest ticks in a row failed (one is a blip).
FAILING_TICKS = 3
# More alerts of one kind than this in one tick are sent as one digest.
DIGEST_OVER = 5
EVENT_PAGE = 1000
EVENT_PAGES = 5
# The code location's name when the sensor runs outside one (tests): pyproject's.
DEFAULT_LOCATION = "cdc_platform"
_EVENTS = (dg.DagsterEventType.FRESHNESS_STATE_CHANGE, dg.DagsterEventType.ASSET_OBSERVATION)
_PROBLEM_SEVERITY = {"WARN": "WARN", "FAIL": "ERROR"}


@dataclass
class SourceAlertCursor:
    """``after``: the last storage id read. ``stale``: table -> the freshness state alerted.
    ``backlog``: table -> its oldest unapplied hour, since when (epoch seconds), how many,
    whether alerted. ``failing``: the sensors alerted as failing. ``pending``: undelivered."""

    after: int | None = None
    stale: dict[str, str] = field(default_factory=dict)
    backlog: dict[str, dict[str, Any]] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        body = {"v": 1, **{k: getattr(self, k) for k in self.__dataclass_fields__}}
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | None) -> "SourceAlertCursor":
        if not raw:
            return cls()
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != 1:
            raise ValueError("unsupported source alert cursor; reset the sensor cursor")
        after = data.get("after")
        return cls(
            after=after if isinstance(after, int) else None,
            stale=dict(data.get("stale") or {}),
            backlog=dict(data.get("backlog") or {}),
            failing=list(data.get("failing") or []),
            pending=list(data.get("pending") or []),
        )


@dataclass
class _Links:
    """The UI pages alerts point at (``CDC_UI_BASE_URL``)."""

    base: str
    location: str
    repository: str

    def asset(self, table: str) -> str:
        return f"{self.base.rstrip('/')}/assets/{table}"

    def sensor(self, name: str) -> str:
        where = (
            self.location
            if self.repository == "__repository__"
            else f"{self.repository}@{self.location}"
        )
        return f"{self.base.rstrip('/')}/locations/{where}/sensors/{name}"


def freshness_change(
    state: SourceAlertCursor, change: FreshnessStateChange, table: TableConfig, links: _Links
) -> dict[str, Any] | None:
    """The alert a freshness state change calls for: late or stale (once per state), fresh
    again after either (at the severity of what it ends). No policy any more ends it quietly."""
    name, new = table.name, change.new_state
    if new in (FreshnessState.WARN, FreshnessState.FAIL):
        if state.stale.get(name) == new.value:
            return None
        state.stale[name] = new.value
        hours = table.expected_delivery_hours or 0
        late = hours * (2 if new == FreshnessState.FAIL else 1)
        return source_alert(
            "source_stale",
            name,
            f"no new data for {late} h or more (expected every {hours} h; freshness {new.value})",
            links.asset(name),
            severity="ERROR" if new == FreshnessState.FAIL else "WARN",
            table=name,
        )
    before = state.stale.pop(name, None)
    if new == FreshnessState.PASS and before is not None:
        return source_alert(
            "source_fresh",
            name,
            "new data arrived",
            links.asset(name),
            severity=_PROBLEM_SEVERITY.get(before, "ERROR"),
            table=name,
        )
    return None


def seed_freshness(
    state: SourceAlertCursor,
    instance: dg.DagsterInstance,
    tables: Mapping[str, TableConfig],
    links: _Links,
) -> list[dict[str, Any]]:
    """On the first tick (or a reset cursor), the freshness states recorded so far (one query):
    a table already stale then is alerted too, not only one that turns stale later."""
    keys = [dg.AssetKey(name) for name, t in tables.items() if t.expected_delivery_hours]
    alerts: list[dict[str, Any]] = []
    for key, record in instance.get_freshness_state_records(keys).items():
        change = FreshnessStateChange(
            key=key,
            new_state=record.freshness_state,
            previous_state=FreshnessState.UNKNOWN,
            state_change_timestamp=record.updated_at.timestamp(),
        )
        alert = freshness_change(state, change, tables[key.to_user_string()], links)
        if alert is not None:
            alerts.append(alert)
    return alerts


def backlog_change(
    state: SourceAlertCursor, table: str, metadata: Mapping[str, Any], at: float, links: _Links
) -> dict[str, Any] | None:
    """Remember a table's reported backlog; an emptied backlog that was alerted recovers."""
    hours = metadata_int(metadata.get(BACKLOG_HOURS) or 0)
    before = state.backlog.get(table)
    if hours == 0:
        state.backlog.pop(table, None)
        if before is not None and before.get("alerted"):
            return source_alert("hours_applied", table, "", links.asset(table), table=table)
        return None
    since = float(metadata.get(BACKLOG_SINCE) or 0.0)  # older landing sensors: from the age
    state.backlog[table] = {
        "oldest": str(metadata.get(BACKLOG_OLDEST) or ""),
        "since": since or at - float(metadata.get(BACKLOG_AGE) or 0.0) * 60,
        "hours": hours,
        "alerted": bool(before and before.get("alerted")),
    }
    return None


def overdue(
    state: SourceAlertCursor, tables: Mapping[str, TableConfig], now: float, links: _Links
) -> list[dict[str, Any]]:
    """``hours_unapplied`` for each backlog older than its table's threshold, once."""
    alerts = []
    for name, entry in sorted(state.backlog.items()):
        table = tables.get(name)
        if table is None or entry.get("alerted"):
            continue
        minutes = (now - float(entry["since"])) / 60
        if minutes < table.unapplied_alert_minutes:
            continue
        entry["alerted"] = True
        alerts.append(
            source_alert(
                "hours_unapplied",
                name,
                f"{entry['hours']} hour(s) requested and not applied for {minutes:.0f} min, "
                f"the oldest {entry['oldest']}; they are requested again with backoff",
                links.asset(name),
                table=name,
                counts={"unapplied_hours": int(entry["hours"])},
            )
        )
    return alerts


def _events(storage: Any, after: int) -> Iterable[tuple[int, dg.EventLogEntry]]:
    """The freshness changes and observations recorded after ``after``, in storage order: a
    query per event type and page (at most ``EVENT_PAGES`` pages a tick: the rest next tick,
    from the lowest id a full page stopped at)."""
    entries: dict[int, dg.EventLogEntry] = {}
    until: int | None = None  # a full page's last id: what comes after it is read next tick
    for event_type in _EVENTS:
        start = after
        for _ in range(EVENT_PAGES):
            page = storage.get_logs_for_all_runs_by_log_id(
                after_cursor=start, dagster_event_type=event_type, limit=EVENT_PAGE
            )
            entries.update(page)
            if len(page) < EVENT_PAGE:
                break
            start = max(page)
        else:
            until = start if until is None else min(until, start)
    for storage_id in sorted(entries):
        if until is None or storage_id <= until:
            yield storage_id, entries[storage_id]


def _read_events(
    context: dg.SensorEvaluationContext,
    state: SourceAlertCursor,
    tables: Mapping[str, TableConfig],
    links: _Links,
) -> list[dict[str, Any]]:
    alerts = []
    assert state.after is not None
    for storage_id, entry in _events(context.instance.event_log_storage, state.after):
        state.after = max(state.after, storage_id)
        try:
            alert = _one_event(state, entry, tables, links)
        except (TypeError, ValueError) as exc:  # a foreign observation: never stop the sensor
            context.log.warning(f"event {storage_id} skipped: {type(exc).__name__}: {exc}")
            continue
        if alert is not None:
            alerts.append(alert)
    return alerts


def _one_event(
    state: SourceAlertCursor,
    entry: dg.EventLogEntry,
    tables: Mapping[str, TableConfig],
    links: _Links,
) -> dict[str, Any] | None:
    event = entry.dagster_event
    key = event.asset_key if event is not None else None
    table = tables.get(key.to_user_string()) if key is not None else None
    if event is None or table is None:
        return None  # another code location's asset
    data = event.event_specific_data
    if isinstance(data, FreshnessStateChange):
        return freshness_change(state, data, table, links)
    if event.event_type == dg.DagsterEventType.ASSET_OBSERVATION:
        observed = event.asset_observation_data.asset_observation.metadata
        meta = {k: v.value for k, v in observed.items()}
        if BACKLOG_HOURS in meta:
            return backlog_change(state, table.name, meta, entry.timestamp, links)
    return None


def failing_sensors(
    state: SourceAlertCursor,
    instance: dg.DagsterInstance,
    selectors: Mapping[str, str],
    links: _Links,
) -> list[dict[str, Any]]:
    """``sensor_failing`` when a sensor's latest ``FAILING_TICKS`` ticks failed (naming the
    innermost error's first line), ``sensor_recovered`` after its next good tick.

    As Dagster's sensor daemon decides it: a sensor whose state records a successful last tick
    is fine (one query for every sensor); only for the others is the latest tick read, whose
    ``consecutive_failure_count`` counts the failures in a row (a tick still running is not a
    failure)."""
    names = {selector_id: name for name, selector_id in selectors.items()}
    alerts = []
    for sensor in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        name = names.get(sensor.selector_id)
        data = sensor.instigator_data
        if name is None or not isinstance(data, SensorInstigatorData):
            continue
        if data.last_tick_success_timestamp is not None:
            if name in state.failing:
                state.failing.remove(name)
                alerts.append(source_alert("sensor_recovered", name, "", links.sensor(name)))
            continue
        if name in state.failing:
            continue
        latest = instance.get_ticks(sensor.instigator_origin_id, sensor.selector_id, limit=1)
        if not latest or latest[0].status != TickStatus.FAILURE:
            continue
        tick = latest[0]
        if (tick.consecutive_failure_count or tick.failure_count or 0) < FAILING_TICKS:
            continue
        state.failing.append(name)
        lines = root_message(tick.error).strip().splitlines() if tick.error else []
        alerts.append(
            source_alert(
                "sensor_failing",
                name,
                f"its last {FAILING_TICKS} ticks or more failed: {lines[0] if lines else '?'}",
                links.sensor(name),
            )
        )
    return alerts


def forget_unknown(
    state: SourceAlertCursor, tables: Mapping[str, TableConfig], watched: Sequence[str]
) -> None:
    """Drop what the config no longer has (a table removed, its freshness unset, a sensor
    gone): it will not end with an alert, and it must not count as failing."""
    with_policy = {n for n, t in tables.items() if t.expected_delivery_hours}
    state.stale = {n: v for n, v in state.stale.items() if n in with_policy}
    state.backlog = {n: v for n, v in state.backlog.items() if n in tables}
    state.failing = [n for n in state.failing if n in watched]


def digested(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """More than ``DIGEST_OVER`` alerts of one kind become one digest of them (a cause shared
    by the whole fleet is one message, and the pending queue keeps every one)."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for alert in alerts:
        kinds.setdefault(alert["kind"], []).append(alert)
    out = []
    for group in kinds.values():
        out += [source_digest(group)] if len(group) > DIGEST_OVER else group
    return out


def build_source_alert_sensor(
    tables: Sequence[TableConfig],
    watched_sensors: Sequence[str],
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds: int = ALERT_INTERVAL_SECONDS,
    clock: Callable[[], float] | None = None,
) -> dg.SensorDefinition:
    """The sensor posting the alerts above for ``tables`` and the ``watched_sensors`` (its
    own failures show on its page: it cannot alert on itself). ``clock``: for tests."""
    import time

    by_name = {t.name: t for t in tables}
    now = clock or time.time

    @dg.sensor(
        name=SOURCE_ALERT_SENSOR_NAME,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Posts an alert when a table's source goes stale (freshness), when landed "
        "hours stay unapplied past unapplied_alert_minutes, and when a sensor keeps failing; "
        "and once more when each is over.",
    )
    def cdc_source_alerts(
        context: dg.SensorEvaluationContext, alert_webhook: AlertWebhookResource
    ) -> dg.SensorResult:
        state = SourceAlertCursor.from_json(context.cursor)
        origin = context.code_location_origin
        links = _Links(
            alert_webhook.ui_base_url,
            origin.location_name if origin is not None else DEFAULT_LOCATION,
            context.repository_name or "__repository__",
        )
        storage = context.instance.event_log_storage
        forget_unknown(state, by_name, watched_sensors)
        alerts: list[dict[str, Any]] = []
        if state.after is None:
            state.after = storage.get_maximum_record_id() or 0
            alerts += seed_freshness(state, context.instance, by_name, links)
        else:
            alerts += _read_events(context, state, by_name, links)
        alerts += overdue(state, by_name, now(), links)
        selectors = {
            name: InstigatorSelector(
                location_name=links.location, repository_name=links.repository, name=name
            ).get_id()
            for name in watched_sensors
        }
        alerts += failing_sensors(state, context.instance, selectors, links)
        state.pending += [queued(a) for a in digested(alerts)]
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        summary = (
            f"{len(alerts)} change(s); {len(state.stale)} stale, "
            f"{sum(bool(b.get('alerted')) for b in state.backlog.values())} with overdue hours, "
            f"{len(state.failing)} sensor(s) failing; {delivered} alert(s) sent, "
            f"{len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_source_alerts
