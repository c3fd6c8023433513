"""One landing sensor for all tables (``landing_sensor: fleet``): every table in one tick, and
runs that apply one hour range for several tables at once.

Why: with a sensor per table, the daemon's own cost per tick (about 0.1 CPU-second here) times
500 tables is most of a core while nothing lands, and each table-hour pays a run's fixed cost (a
process, imports, a Spark session) for a few seconds of merging. Here one tick looks at every
table with the same per-table logic (``defs.sensors.per_table.tick_table``), and the hours it requests
become runs of up to ``tables_per_run`` tables (``lib.fleet.sensor_cursor.batch``): each table is its
own step and its own commit, so a failing table fails its step and no other.

**State.** A table's cursor (``CursorState``) is kept in the instance's key-value store
(Dagster's daemon-cursor storage, in the instance's database), written only when it changed,
so a tick writes bytes for what moved, not for 500 cursors. It is written as soon as the
table's share of the tick is done, with where the next tick starts: a tick that dies later
(a timeout, a killed daemon) keeps every table's progress made before. The sensor's own cursor holds an
epoch and where the next tick starts: resetting it from the UI starts a new epoch, and every
table is seeded again from its applied-files ledger, as a reset per-table sensor is.

**Bounds.** A tick stops taking up tables after ``budget_seconds`` (a sensor evaluation must
answer within Dagster's 60 s); the next tick starts where this one stopped. Each table lists
at most ``sensor_cursor.LIST_REQUESTS_PER_TICK`` pages, and not past that deadline (a first
sweep or seeding of a large table goes on over several ticks), so no table holds up the
others. A table whose share
of the tick raises is logged, names its error, and is looked at again next tick; the others go
on. A landing root that cannot be listed fails the tick, as it fails a per-table sensor's.

**Durability.** The tables' cursors are written before Dagster launches the runs they asked
for. If the tick dies in between, those hours stay pending in the cursors and are requested
again after their backoff (``lib.fleet.sensor_cursor.reconcile``): late, never lost.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import dagster as dg

from cdc_platform.defs.sensors.per_table import (
    IN_PROGRESS,
    TableTick,
    check_landing_root,
    hours_request,
    partition_end_offset,
    partitions_of,
    tick_table,
    utcnow,
)
from cdc_platform.defs.tags import REASON_TAG, TABLE_TAG
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet.sensor_cursor import BatchRequest, CursorState, batch, tick_budget
from cdc_platform.lib.landing.where.zone import Landing
from cdc_platform.lib.storage.stores import Where

FLEET_SENSOR = "cdc_landing"
TABLES_TAG = "cdc_platform/tables"  # how many tables a run applies (the UI's run list shows it)
# A tick takes up no new table after this long; Dagster gives a sensor evaluation 60 s.
TICK_BUDGET_SECONDS = 30.0
_CURSOR_VERSION = 1


@dataclass(frozen=True)
class FleetCursor:
    """The fleet sensor's own cursor: which epoch of table cursors is live, and where the next
    tick starts in the table list."""

    epoch: str
    start: int = 0
    is_new: bool = True

    def to_json(self) -> str:
        return json.dumps({"v": _CURSOR_VERSION, "epoch": self.epoch, "start": self.start})

    @classmethod
    def from_json(cls, raw: str | None) -> FleetCursor:
        """A new epoch for ``None``/``""`` (a first tick or a reset) or an unknown cursor
        (``is_new``: the sensor stores it before it seeds any table)."""
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if not isinstance(data, dict) or data.get("v") != _CURSOR_VERSION:
            return cls(uuid.uuid4().hex)
        return cls(str(data["epoch"]), int(data.get("start") or 0), is_new=False)

    def key(self, table: str) -> str:
        """The table's key in the instance's key-value store."""
        return f"cdc_platform/landing/{self.epoch}/{table}"

    @property
    def position_key(self) -> str:
        """Where the next tick starts, as saved table by table (no table is named ``_``...)."""
        return self.key("_next")


def batch_run_request(request: BatchRequest) -> dg.RunRequest:
    """One run for the batch's tables: their assets selected, its hour or hour range tagged.
    Dagster puts it in its implicit asset job, which runs assets together when they share
    their partitions definition (``batch`` groups by start for that).
    A run for one table carries the table's tag too (the run queue's one-run-per-table
    limit then holds it in the queue while another run of the table is in flight)."""
    tags = {REASON_TAG: ", ".join(request.reasons), TABLES_TAG: str(len(request.tables))}
    if len(request.tables) == 1:
        tags[TABLE_TAG] = request.tables[0]
    selection = [dg.AssetKey(t) for t in request.tables]
    return hours_request(request, request.run_key, tags, asset_selection=selection)


class InFlight:
    """Table -> the partitions its queued or running runs will apply, from one query of the
    instance's runs in progress (made on the first question of a tick, if any is asked)."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self._instance = instance
        self._by_table: dict[str, set[str]] | None = None

    def __call__(self, table_name: str) -> set[str]:
        if self._by_table is None:
            by_table: dict[str, set[str]] = defaultdict(set)
            for run in self._instance.get_runs(filters=dg.RunsFilter(statuses=IN_PROGRESS)):
                names = {k.to_user_string() for k in run.asset_selection or ()}
                if run.tags.get(TABLE_TAG):
                    names.add(run.tags[TABLE_TAG])
                for name in names:
                    by_table[name].update(partitions_of(run.tags))
            self._by_table = by_table  # only once read whole: a failed query asks again
        return self._by_table.get(table_name, set())


def _store(
    instance: dg.DagsterInstance, changed: Mapping[str, str], stored: Mapping[str, str]
) -> None:
    """Write the changed cursors: new keys and known keys in separate calls (the storage
    inserts, and only on a conflict updates, all of one call's keys: a call mixing both
    would update the known ones and drop the new ones)."""
    new = {k: v for k, v in changed.items() if k not in stored}
    known = {k: v for k, v in changed.items() if k in stored}
    for pairs in (new, known):
        if pairs:
            instance.run_storage.set_cursor_values(pairs)


def _start(cursor: FleetCursor, stored: Mapping[str, str]) -> int:
    """Where this tick starts: the position saved table by table (a tick that died went that
    far), else the sensor cursor's."""
    try:
        return int(stored.get(cursor.position_key) or cursor.start)
    except ValueError:
        return cursor.start


def _save(
    instance: dg.DagsterInstance,
    stored: dict[str, str],
    cursor: FleetCursor,
    table: str,
    state: CursorState,
    position: str,
) -> None:
    """The table's cursor, if it changed, with where the next tick starts (one write)."""
    raw = state.to_json()
    if raw == stored.get(cursor.key(table)):
        return
    changed = {cursor.key(table): raw, cursor.position_key: position}
    _store(instance, changed, stored)
    stored.update(changed)


def _stored_state(
    context: dg.SensorEvaluationContext, table: TableConfig, raw: str | None
) -> CursorState | None:
    """The table's stored cursor; an unreadable one is dropped (the table is seeded again
    from its ledger, as after a reset), saying so."""
    if not raw:  # "" too: written by hand, it resets this one table
        return None
    try:
        return CursorState.from_json(raw)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        context.log.warning(
            f"{table.name}: its landing cursor cannot be read ({exc}); seeding it again from "
            "the applied-files ledger"
        )
        return None


@dataclass(frozen=True)
class _Fleet:
    """What every tick of the sensor looks at: the tables by name (in the order ticks take them
    up), where they land and are written, and each asset's not-yet-closed hours."""

    by_name: Mapping[str, TableConfig]
    names: list[str]
    landing_root: Landing
    warehouse_root: Where | None
    end_offsets: Mapping[str, int]


def build_fleet_landing_sensor(
    tables: Sequence[TableConfig],
    landing_root: Landing,
    warehouse_root: Where | None,
    assets: Mapping[str, dg.AssetsDefinition],
    tables_per_run: int,
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    clock: Callable[[], datetime] = utcnow,
    budget_seconds: float = TICK_BUDGET_SECONDS,
) -> dg.SensorDefinition:
    """The fleet's landing sensor: ``tick_table`` for each table, the requests batched."""
    by_name = {t.name: t for t in tables}
    names = sorted(by_name)
    fleet = _Fleet(
        by_name,
        names,
        landing_root,
        warehouse_root,
        {t.name: partition_end_offset(assets[t.name]) for t in tables},
    )

    @dg.sensor(
        name=FLEET_SENSOR,
        minimum_interval_seconds=min(t.sensor_interval_seconds for t in tables),
        # Targeting the assets, not a job of ours: the runs go to Dagster's implicit asset
        # job, so the code location serves no second 500-asset job snapshot.
        asset_selection=dg.AssetSelection.assets(*assets.values()),
        default_status=default_status,
        description=(
            f"Requests runs for new or changed hour folders of all {len(tables)} tables under "
            f"{landing_root}, up to {tables_per_run} table(s) per run."
        ),
    )
    def _fleet_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        check_landing_root(landing_root, FLEET_SENSOR)
        now = clock()
        cursor = FleetCursor.from_json(context.cursor)
        if cursor.is_new:
            # The epoch is stored first, alone: a first tick that fails or times out while it
            # seeds 500 tables then resumes the same epoch, not a new one every tick.
            return dg.SensorResult(cursor=cursor.to_json(), skip_reason="a new cursor epoch")
        keys = {cursor.key(n) for n in names} | {cursor.position_key}
        stored = dict(context.instance.run_storage.get_cursor_values(keys))
        start = _start(cursor, stored) % len(names)
        ticks, looked_at = _tick_tables(
            fleet, context, cursor, start, stored, now, time.monotonic() + budget_seconds
        )
        position = {cursor.position_key: str((start + looked_at) % len(names))}
        if stored.get(cursor.position_key, str(start)) != position[cursor.position_key]:
            _store(context.instance, position, stored)
        batches = batch(
            {name: tick.requests for name, tick in ticks.items()},
            {name: by_name[name].start_partition_key for name in ticks},
            tables_per_run,
        )
        run_requests = [batch_run_request(b) for b in batches]
        if looked_at < len(names):
            context.log.info(f"{looked_at} of {len(names)} tables looked at in this tick")
        return dg.SensorResult(
            run_requests=run_requests,
            cursor=FleetCursor(cursor.epoch, int(position[cursor.position_key])).to_json(),
            skip_reason=None if run_requests else "no new or changed hour folders",
            asset_events=[o for tick in ticks.values() for o in tick.observations],
        )

    return _fleet_sensor


def _tick_tables(
    fleet: _Fleet,
    context: dg.SensorEvaluationContext,
    cursor: FleetCursor,
    start: int,
    stored: dict[str, str],
    now: datetime,
    deadline: float,
) -> tuple[dict[str, TableTick], int]:
    """Each table's share, from where the last tick stopped, until the deadline; each
    table's cursor saved as soon as its share is done."""
    in_flight = InFlight(context.instance)
    ticks: dict[str, TableTick] = {}
    order = fleet.names[start:] + fleet.names[:start]
    looked_at = 0
    for name in order:
        if looked_at and time.monotonic() > deadline:
            break
        looked_at += 1
        table = fleet.by_name[name]
        try:
            state = _stored_state(context, table, stored.get(cursor.key(name)))
            ticks[name] = tick_table(
                context,
                table,
                fleet.landing_root,
                fleet.warehouse_root,
                state,
                now,
                in_flight,
                fleet.end_offsets[name],
                tick_budget(deadline - time.monotonic()),
            )
            position = str((start + looked_at) % len(fleet.names))
            _save(context.instance, stored, cursor, name, ticks[name].state, position)
        except Exception as exc:  # one table's trouble never stops the others
            context.log.error(
                f"{name}: its landing folders could not be looked at "
                f"({type(exc).__name__}: {exc}); the other tables go on, this one is "
                "looked at again next tick"
            )
    return ticks, looked_at
