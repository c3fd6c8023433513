"""The restatements sensor: late data reaches the downstream partitions it made wrong.

Every run that changes a history table records the valid time it restated (``restated_from``,
``restated_to``: docs/history-table.md, "What a run restated"). A time-partitioned asset that
depends on a history table, in the same code location, gets the partitions overlapping that
window requested again, if it had materialized them: a late file into a three-day-old hour
re-runs the days it changed and no other. A partition materialized after the restating run
has read the restated rows, and is left alone. A restatement of many partitions is requested
a few at a time (``MAX_PARTITIONS_PER_TICK``), the rest kept in the cursor, so it cannot
flood the run queue. Dagster offers no automation condition that reads a parent's metadata,
hence a sensor; a partition's time window is Dagster's (``time_window_for_partition_key``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import dagster as dg

RESTATEMENTS_SENSOR = "cdc_restatements"
MAX_PARTITIONS_PER_TICK = 20
# History materializations read a tick, per table with a partitioned downstream asset.
RECORDS_PER_TICK = 100
RESTATED_BY_TAG = "cdc_platform/restated_by"


@dataclass
class _Cursor:
    """Per history table, the last materialization read (its storage id); and the partitions
    still to request, each as (asset, partition, the history materialization's storage id)."""

    after: dict[str, int] = field(default_factory=dict)
    queue: list[tuple[str, str, int]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str | None) -> _Cursor:
        if not text:
            return cls()
        raw = json.loads(text)
        return cls(dict(raw["after"]), [(a, p, int(s)) for a, p, s in raw["queue"]])

    def dump(self) -> str:
        return json.dumps({"after": self.after, "queue": self.queue}, sort_keys=True)


def build_restatements_sensor(history: Sequence[dg.AssetKey]) -> dg.SensorDefinition:
    """The sensor over the history assets ``history``; it queries the instance only for those
    with a time-partitioned downstream asset (none: a tick reads nothing)."""
    watched = list(history)

    @dg.sensor(
        name=RESTATEMENTS_SENSOR,
        # The history tables' direct children, resolved with the whole code location's assets
        # (a user's merged in too); each run request asks for one child's partition.
        target=dg.AssetSelection.assets(*watched).downstream(depth=1, include_self=False),
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Requests again the partitions of time-partitioned assets downstream of a history"
            " table that a run restated (its restated_from/restated_to metadata)."
        ),
    )
    def cdc_restatements(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        cursor = _Cursor.parse(context.cursor)
        repository = context.repository_def
        now = datetime.now(UTC)
        for key in watched:
            children = _partitioned_children(repository, key) if repository else {}
            if children:
                _read_new(context.instance, key, children, now, cursor)
        now_due, cursor.queue = (
            cursor.queue[:MAX_PARTITIONS_PER_TICK],
            cursor.queue[MAX_PARTITIONS_PER_TICK:],
        )
        requests = [_request(asset, p, s) for asset, p, s in now_due]
        return dg.SensorResult(run_requests=requests, cursor=cursor.dump())

    return cdc_restatements


def _partitioned_children(
    repository: dg.RepositoryDefinition, key: dg.AssetKey
) -> dict[dg.AssetKey, dg.TimeWindowPartitionsDefinition]:
    """The assets directly downstream of ``key`` with time-window partitions."""
    graph = repository.asset_graph
    if not graph.has(key):
        return {}
    out = {}
    for child in graph.get(key).child_keys:
        partitions = graph.get(child).partitions_def
        if isinstance(partitions, dg.TimeWindowPartitionsDefinition):
            out[child] = partitions
    return out


def _read_new(
    instance: dg.DagsterInstance,
    key: dg.AssetKey,
    children: dict[dg.AssetKey, dg.TimeWindowPartitionsDefinition],
    now: datetime,
    cursor: _Cursor,
) -> None:
    """Queue the partitions each new materialization of ``key`` restated: those of ``children``
    overlapping its window and materialized before it (one built since has read the restated
    rows already)."""
    name = key.to_user_string()
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, after_storage_id=cursor.after.get(name)),
        limit=RECORDS_PER_TICK,
        ascending=True,
    ).records
    queued = {(a, p) for a, p, _ in cursor.queue}
    for record in records:
        cursor.after[name] = record.storage_id
        materialization = record.asset_materialization
        window = _window(materialization.metadata if materialization else {}, now)
        if window is None:
            continue
        for child, partitions in children.items():
            built = instance.get_materialized_partitions(child, before_cursor=record.storage_id)
            for p in _overlapping(partitions, window, built):
                if (child.to_user_string(), p) not in queued:
                    queued.add((child.to_user_string(), p))
                    cursor.queue.append((child.to_user_string(), p, record.storage_id))


def _window(metadata: Mapping[str, dg.MetadataValue], now: datetime) -> dg.TimeWindow | None:
    """The restated valid time, up to ``now`` (a live version's end is 9999-12-31). None for
    none, and for values that are not times (metadata anyone can write: never a stuck tick)."""
    start, end = metadata.get("restated_from"), metadata.get("restated_to")
    if start is None or end is None:
        return None
    first, last = _instant(start.value), _instant(end.value)
    if first is None or last is None or min(last, now) < first:
        return None
    return dg.TimeWindow(first, min(last, now))


def _instant(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


def _overlapping(
    partitions: dg.TimeWindowPartitionsDefinition, window: dg.TimeWindow, built: set[str]
) -> Iterator[str]:
    """The materialized partitions whose time window overlaps ``window``, its end included (a
    partition's window is half-open, the restated end is an instant that changed)."""
    for p in sorted(built):
        try:
            w = partitions.time_window_for_partition_key(p)
        except (ValueError, TypeError):  # a key of an earlier partitions definition
            continue
        if w.start <= window.end and w.end > window.start:
            yield p


def _request(asset: str, partition: str, storage_id: int) -> dg.RunRequest:
    return dg.RunRequest(
        run_key=f"{asset}|{partition}|{storage_id}",
        asset_selection=[dg.AssetKey.from_user_string(asset)],
        partition_key=partition,
        tags={RESTATED_BY_TAG: str(storage_id)},
    )
