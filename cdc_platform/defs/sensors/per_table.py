"""The landing sensor per table (``landing_sensor: per_table``), and the tick logic the
all-tables sensor shares: turn new or changed hour folders into (range) runs of a table's asset.

The decision logic lives in :mod:`cdc_platform.lib.fleet.sensor_cursor`; this module only adapts it to
Dagster: it loads/stores the cursor and expresses each :class:`PartitionRequest` as a
``RunRequest``. A single hour uses ``partition_key``; several consecutive hours become ONE run
over a partition key range, expressed with Dagster's range tags
``dagster/asset_partition_range_start`` / ``dagster/asset_partition_range_end`` (the same tags a
single-run backfill puts on its run; ``RunRequest`` has no ``partition_key_range`` argument in
Dagster 1.13). The target asset should use ``BackfillPolicy.single_run()`` so that its code reads
``context.partition_key_range`` / ``context.partition_time_window``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import dagster as dg

from cdc_platform.defs.tags import (
    BACKLOG_AGE,
    BACKLOG_HOURS,
    BACKLOG_OLDEST,
    BACKLOG_SINCE,
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REASON_TAG,
    TABLE_TAG,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet.sensor_cursor import (
    AppliedLookup,
    CursorState,
    HourRange,
    PartitionRequest,
    backlog,
    backlog_since,
    due_for_check,
    evaluate,
    postponed,
    reconcile,
    tick_budget,
)
from cdc_platform.lib.landing.where.layout import (
    hour_to_partition_key,
    hours_between,
    partition_key_to_hour,
)
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import Landing, ListBudget
from cdc_platform.lib.ledgers import applied_files
from cdc_platform.lib.storage.stores import Where


def utcnow() -> datetime:
    return datetime.now(UTC)


def partition_end_offset(target: dg.AssetsDefinition) -> int:
    """How many not-yet-closed hours the target's partitions include (0 unless configured)."""
    partitions_def = target.partitions_def
    if isinstance(partitions_def, dg.TimeWindowPartitionsDefinition):
        return partitions_def.end_offset
    return 0


def hours_request(
    hours: HourRange, run_key: str, tags: Mapping[str, str], **kwargs: Any
) -> dg.RunRequest:
    """One RunRequest for ``hours``: a single partition, or a partition range run through the
    range tags (both landing sensors spell their runs so)."""
    if len(hours.partition_keys) == 1:
        return dg.RunRequest(run_key=run_key, partition_key=hours.first, tags=tags, **kwargs)
    tags = {**tags, RANGE_START_TAG: hours.first, RANGE_END_TAG: hours.last}
    return dg.RunRequest(run_key=run_key, tags=tags, **kwargs)


def run_request_for(table: TableConfig, request: PartitionRequest) -> dg.RunRequest:
    """One table's run for ``request``."""
    tags = {TABLE_TAG: table.name, REASON_TAG: request.reason}
    return hours_request(request, request.run_key, tags)


@dataclass(frozen=True)
class TableTick:
    """One table's share of a landing-sensor tick."""

    requests: list[PartitionRequest]
    state: CursorState
    observations: list[dg.AssetObservation]


def tick_table(
    context: dg.SensorEvaluationContext,
    table: TableConfig,
    landing_root: Landing,
    warehouse_root: Where | None,
    state: CursorState | None,
    now: datetime,
    in_flight: Callable[[str], Collection[str]],
    end_offset: int = 0,
    budget: ListBudget | None = None,
) -> TableTick:
    """What either landing sensor does for one table: a missing ``state`` (a first tick, a
    reset cursor) is seeded, as its first sweep lists the table, from the files the table's
    materializations already read (``lib.ledgers.applied_files``): only folders holding a file
    never read are requested. Then the new or changed folders, and the pending hours whose
    backoff ran out (no hour left behind). ``in_flight``: table name -> the partitions its
    queued or running runs will apply. ``budget``: what the tick may list on a bucket
    (``sensor_cursor.tick_budget``); a sweep or a check past it goes on next tick."""
    fresh = state is None
    budget = budget or tick_budget()
    applied = None if warehouse_root is None else _ledger_lookup(warehouse_root, table)
    if state is None:
        state = CursorState()
        context.log.info(f"{table.name}: empty cursor; seeding it from the applied-files ledger")
    requests, new_state = evaluate(
        table, landing_root, now, state, end_offset=end_offset, applied=applied, budget=budget
    )
    if new_state.sweep is not None:
        context.log.info(f"{table.name}: the sweep's listing budget is spent; it goes on next tick")
    if warehouse_root is not None and due_for_check(table, new_state, now):
        retries, new_state = _reconcile(
            context, table, landing_root, warehouse_root, new_state, now, in_flight, budget
        )
        requests += retries
    for request in requests:
        context.log.info(
            f"{table.name}: requesting {request.first}..{request.last} "
            f"({len(request.partition_keys)} h, {request.reason})"
        )
    # After a reset cursor, always: the last report may no longer hold.
    observations = _backlog_observation(table, None if fresh else state, new_state, now)
    return TableTick(requests, new_state, observations)


def _ledger_lookup(warehouse_root: Where, table: TableConfig) -> AppliedLookup:
    """The applied-files ledger's rows for some partitions (its public, filtered read)."""
    path = applied_files.ledger_path(warehouse_root, table.name)
    return partial(applied_files.applied_by_partition, path)


def build_landing_sensor(
    table: TableConfig,
    landing_root: Landing,
    target: dg.AssetsDefinition,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    *,
    warehouse_root: Where | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> dg.SensorDefinition:
    """A sensor requesting runs of ``target`` for new/changed hour folders of ``table``
    (``landing_sensor: per_table``). The cursor (see ``CursorState``) is the only state;
    ``clock`` exists for tests."""
    end_offset = partition_end_offset(target)

    @dg.sensor(
        name=f"{table.name}_landing_sensor",
        minimum_interval_seconds=table.sensor_interval_seconds,
        target=target,
        default_status=default_status,
        description=(
            f"Requests runs of {table.name} when hour folders under {landing_root}/{table.name} "
            f"appear or change (lookback {table.lookback_hours}h, full sweep every "
            f"{table.full_sweep_minutes} min)."
        ),
        tags={TABLE_TAG: table.name},
    )
    def _landing_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        check_landing_root(landing_root, table.name)
        state = CursorState.from_json(context.cursor) if context.cursor else None
        tick = tick_table(
            context,
            table,
            landing_root,
            warehouse_root,
            state,
            clock(),
            partial(tagged_in_flight, context.instance),
            end_offset,
        )
        run_requests = [run_request_for(table, r) for r in tick.requests]
        return dg.SensorResult(
            run_requests=run_requests,
            cursor=tick.state.to_json(),
            skip_reason=None if run_requests else "no new or changed hour folders",
            asset_events=tick.observations,
        )

    return _landing_sensor


def tagged_in_flight(instance: dg.DagsterInstance, table_name: str) -> set[str]:
    """The partitions the table's queued or running runs (by its tag) will apply."""
    runs = instance.get_runs(
        filters=dg.RunsFilter(tags={TABLE_TAG: table_name}, statuses=IN_PROGRESS)
    )
    return {key for run in runs for key in partitions_of(run.tags)}


class LandingRootUnavailableError(RuntimeError):
    """The landing root is missing or cannot be listed: the tick fails, saying so."""


def check_landing_root(root: Landing, who: str) -> None:
    """Fail the tick when the landing root is gone or unreadable (an unmounted volume, lost
    permissions, a bucket that does not answer): an empty listing would look exactly like a
    quiet source. Dagster shows the failed ticks on the sensor's page."""
    landing = zone_at(root)
    if not landing.exists():
        raise LandingRootUnavailableError(
            f"{who}: the landing root {landing.root} cannot be listed: is the landing volume"
            " mounted and readable (the bucket reachable, its credentials valid)? No hour is"
            " requested until it is back."
        )


def _reconcile(
    context: dg.SensorEvaluationContext,
    table: TableConfig,
    landing_root: Landing,
    warehouse_root: Where,
    state: CursorState,
    now: datetime,
    in_flight: Callable[[str], Collection[str]],
    budget: ListBudget,
) -> tuple[list[PartitionRequest], CursorState]:
    """The due pending hours against the applied-files ledger and the table's runs in flight
    (one ledger read and one run query, only on ticks where some hour is due)."""
    due = due_for_check(table, state, now)
    try:
        applied = applied_files.applied_by_partition(
            applied_files.ledger_path(warehouse_root, table.name), due
        )
    except Exception as exc:  # the warehouse unreachable now: the hours wait, the tick goes on
        context.log.warning(
            f"{table.name}: the applied-files ledger cannot be read ({type(exc).__name__}); "
            f"{len(due)} pending hour(s) are looked at again after the backoff"
        )
        return [], postponed(state, due, now)
    flying = in_flight(table.name)
    requests, state = reconcile(table, landing_root, now, state, applied, flying, budget=budget)
    if requests:
        keys = [k for r in requests for k in r.partition_keys]
        context.log.warning(
            f"{table.name}: {len(keys)} hour(s) requested earlier are not applied and no run "
            f"for them is in flight; requesting again: {', '.join(keys[:10])}"
        )
    return requests, state


# Runs that will still apply their hours: queued, starting, started (Dagster's own list).
IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def partitions_of(tags: Mapping[str, str]) -> list[str]:
    """The hourly partitions a run covers, from its partition or range tags."""
    if tags.get(PARTITION_TAG):
        return [tags[PARTITION_TAG]]
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    if not (start and end):
        return []
    hours = hours_between(partition_key_to_hour(start), partition_key_to_hour(end))
    return [hour_to_partition_key(h) for h in hours]


def _backlog_observation(
    table: TableConfig, before: CursorState | None, after: CursorState, now: datetime
) -> list[dg.AssetObservation]:
    """The backlog, when it differs from ``before``'s (None: report it anyway)."""
    count, oldest, age = backlog(after, now)
    since = backlog_since(after)
    if before is not None and (count, oldest, since) == (
        *backlog(before, now)[:2],
        backlog_since(before),
    ):
        return []
    metadata: dict[str, Any] = {
        BACKLOG_HOURS: count,
        BACKLOG_OLDEST: oldest or "",
        BACKLOG_AGE: dg.MetadataValue.float(round(age, 1)),
        BACKLOG_SINCE: dg.MetadataValue.float(since or 0.0),
    }
    return [dg.AssetObservation(asset_key=dg.AssetKey(table.name), metadata=metadata)]
