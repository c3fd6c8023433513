"""Alerts for what no run reports: a source gone quiet, hours that stay unapplied, a sensor
whose ticks keep failing. Each is alerted once when it starts and once when it ends.

- ``source_stale`` / ``source_fresh``: Dagster's freshness daemon changed a table's freshness
  state (its ``expected_delivery_hours``): WARN and FAIL alert, PASS again recovers.
- ``hours_unapplied`` / ``hours_applied``: the landing sensor reports its backlog (hours
  requested and not yet seen applied, ``defs.sensors``) as an observation when it changes; an
  hour still in it after the table's ``unapplied_alert_minutes`` alerts.
- ``sensor_failing`` / ``sensor_recovered``: a sensor's last ``FAILING_TICKS`` ticks all
  failed (a landing root unmounted: ``check_landing_root``), and then one did not.

One event-log query (from a storage-id cursor, as the check alert sensor reads) and one tick
query a tick, whatever the number of tables; delivery is ``defs.alerts.deliver``'s, retried
from the cursor.
"""

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from dagster._core.definitions.freshness import FreshnessState, FreshnessStateChange
from dagster._core.definitions.selector import InstigatorSelector
from dagster._core.scheduler.instigation import TickStatus

from cdc_platform.defs.alerts import AlertWebhookResource, _queued, deliver, metadata_int
from cdc_platform.defs.sensors import BACKLOG_AGE, BACKLOG_HOURS, BACKLOG_OLDEST
from cdc_platform.lib.alerts import source_alert
from cdc_platform.lib.config import TableConfig

SOURCE_ALERT_SENSOR_NAME = "cdc_source_alerts"
# A sensor is alerted once this many of its latest ticks in a row failed (one is a blip).
FAILING_TICKS = 3
EVENT_PAGE = 1000
EVENT_PAGES = 5
# The code location's name when the sensor runs outside one (tests): pyproject's.
DEFAULT_LOCATION = "cdc_platform"
_EVENTS = {dg.DagsterEventType.FRESHNESS_STATE_CHANGE, dg.DagsterEventType.ASSET_OBSERVATION}


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
    again after either."""
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
    if new == FreshnessState.PASS and state.stale.pop(name, None) is not None:
        return source_alert("source_fresh", name, "new data arrived", links.asset(name), table=name)
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
    age = float(metadata.get(BACKLOG_AGE) or 0.0)
    state.backlog[table] = {
        "oldest": str(metadata.get(BACKLOG_OLDEST) or ""),
        "since": at - age * 60,
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
                f"{entry['hours']} hour(s) landed and not applied for {minutes:.0f} min, the "
                f"oldest {entry['oldest']}; they are requested again with backoff",
                links.asset(name),
                table=name,
                counts={"unapplied_hours": int(entry["hours"])},
            )
        )
    return alerts


def _events(storage: Any, after: int) -> Iterable[tuple[int, dg.EventLogEntry]]:
    """The freshness changes and observations recorded after ``after``, in order, a page a
    query (at most ``EVENT_PAGES`` a tick: the rest next tick)."""
    for _ in range(EVENT_PAGES):
        page = storage.get_logs_for_all_runs_by_log_id(
            after_cursor=after, dagster_event_type=_EVENTS, limit=EVENT_PAGE
        )
        for storage_id in sorted(page):
            after = max(after, storage_id)
            yield storage_id, page[storage_id]
        if len(page) < EVENT_PAGE:
            return


def _read_events(
    state: SourceAlertCursor,
    storage: Any,
    tables: Mapping[str, TableConfig],
    links: _Links,
) -> list[dict[str, Any]]:
    alerts = []
    assert state.after is not None
    for storage_id, entry in _events(storage, state.after):
        state.after = max(state.after, storage_id)
        event = entry.dagster_event
        key = event.asset_key if event is not None else None
        table = tables.get(key.to_user_string()) if key is not None else None
        if event is None or table is None:
            continue  # another code location's asset
        data = event.event_specific_data
        alert = None
        if isinstance(data, FreshnessStateChange):
            alert = freshness_change(state, data, table, links)
        elif event.event_type == dg.DagsterEventType.ASSET_OBSERVATION:
            meta = {
                k: v.value
                for k, v in event.asset_observation_data.asset_observation.metadata.items()
            }
            if BACKLOG_HOURS in meta:
                alert = backlog_change(state, table.name, meta, entry.timestamp, links)
        if alert is not None:
            alerts.append(alert)
    return alerts


def failing_sensors(
    state: SourceAlertCursor,
    instance: dg.DagsterInstance,
    selectors: Mapping[str, str],
    links: _Links,
) -> list[dict[str, Any]]:
    """``sensor_failing`` when a sensor's last ``FAILING_TICKS`` ticks failed (with the last
    error's first line), ``sensor_recovered`` when its latest tick did not (one query)."""
    ticks = instance.get_batch_ticks(list(selectors.values()), limit=FAILING_TICKS)
    alerts = []
    for name, selector_id in sorted(selectors.items()):
        latest = ticks.get(selector_id) or []
        failed = [t for t in latest if t.status == TickStatus.FAILURE]
        if len(latest) == FAILING_TICKS and len(failed) == FAILING_TICKS:
            if name in state.failing:
                continue
            state.failing.append(name)
            error = latest[0].error
            message = (error.message if error is not None else "").strip().splitlines()
            alerts.append(
                source_alert(
                    "sensor_failing",
                    name,
                    f"its last {FAILING_TICKS} ticks failed: {message[0] if message else '?'}",
                    links.sensor(name),
                )
            )
        elif latest and latest[0].status != TickStatus.FAILURE and name in state.failing:
            state.failing.remove(name)
            alerts.append(source_alert("sensor_recovered", name, "", links.sensor(name)))
    return alerts


def build_source_alert_sensor(
    tables: Sequence[TableConfig],
    watched_sensors: Sequence[str],
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds: int = 30,
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
        alerts: list[dict[str, Any]] = []
        if state.after is None:
            state.after = storage.get_maximum_record_id() or 0
            alerts += seed_freshness(state, context.instance, by_name, links)
        else:
            alerts += _read_events(state, storage, by_name, links)
        alerts += overdue(state, by_name, now(), links)
        selectors = {
            name: InstigatorSelector(
                location_name=links.location, repository_name=links.repository, name=name
            ).get_id()
            for name in watched_sensors
        }
        alerts += failing_sensors(state, context.instance, selectors, links)
        state.pending += [_queued(a) for a in alerts]
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        summary = (
            f"{len(alerts)} change(s); {len(state.stale)} stale, "
            f"{sum(bool(b.get('alerted')) for b in state.backlog.values())} with overdue hours, "
            f"{len(state.failing)} sensor(s) failing; {delivered} alert(s) sent, "
            f"{len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_source_alerts
