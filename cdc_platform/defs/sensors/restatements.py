"""The restatements sensor: late data reaches the downstream partitions it made wrong.

Every run that changes a history table records the valid time it restated (``restated_from``,
``restated_to``: docs/history-table.md, "What a run restated"), on its materializations, or on
an observation when an operator job names no hour. A time-partitioned asset that depends on a
history table, in the same code location, gets the partitions overlapping that span requested
again when its latest materialization came before the restating run: a late file into a
three-day-old hour re-runs the days its span reaches and no other, and a partition built since
has read the restated rows already. A restatement of many partitions is requested a few at a
time (``MAX_PARTITIONS_PER_TICK``), the rest kept in the cursor, so it cannot flood the run
queue; a failed request is retried by Dagster's run retries. Dagster offers no automation
condition that reads a parent's metadata, hence a sensor; a partition's time window is
Dagster's (``time_window_for_partition_key``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import dagster as dg

from cdc_platform.lib.history.merge import RESTATED_KEYS

RESTATEMENTS_SENSOR = "cdc_restatements"
MAX_PARTITIONS_PER_TICK = 20
# Records read a tick (each of materializations and observations), per table with a
# partitioned downstream asset.
RECORDS_PER_TICK = 100
RESTATED_BY_TAG = "cdc_platform/restated_by"
RESTATEMENT_RETRIES = 2
OBSERVED = "#observed"  # the cursor's key for a table's observations


@dataclass
class _Cursor:
    """Per history table, the last materialization and observation read (storage ids); and
    the partitions still to request, each as (asset, partition, the restating record's id)."""

    after: dict[str, int] = field(default_factory=dict)
    queue: list[tuple[str, str, int]] = field(default_factory=list)
    # Per table, the last span queued: its run and metadata (the next hour of that run, same).
    last: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | None) -> _Cursor:
        if not text:
            return cls()
        raw = json.loads(text)
        queue = [(a, p, int(s)) for a, p, s in raw["queue"]]
        return cls(dict(raw["after"]), queue, dict(raw.get("last", {})))

    def dump(self) -> str:
        state = {"after": self.after, "queue": self.queue, "last": self.last}
        return json.dumps(state, sort_keys=True)


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
        children_of = {key: _partitioned_children(context.repository_def, key) for key in watched}
        built = _Built(context.instance)
        now = datetime.now(UTC)
        for key, children in children_of.items():
            if children:
                _read_new(context.instance, key, children, built, now, cursor)
        known = {c: p for children in children_of.values() for c, p in children.items()}
        return dg.SensorResult(run_requests=_due(cursor, known), cursor=cursor.dump())

    return cdc_restatements


class _Built:
    """Per downstream asset, each materialized partition's latest materialization (its
    storage id) and time window: read once a tick, whatever the number of records."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance
        self.cache: dict[dg.AssetKey, dict[str, tuple[int, dg.TimeWindow]]] = {}

    def of(
        self, child: dg.AssetKey, partitions: dg.TimeWindowPartitionsDefinition
    ) -> dict[str, tuple[int, dg.TimeWindow]]:
        if child not in self.cache:
            latest = self.instance.get_latest_storage_id_by_partition(
                child, dg.DagsterEventType.ASSET_MATERIALIZATION
            )
            self.cache[child] = {
                p: (storage_id, w)
                for p, storage_id in latest.items()
                if (w := _partition_window(partitions, p)) is not None
            }
        return self.cache[child]


def _partition_window(
    partitions: dg.TimeWindowPartitionsDefinition, key: str
) -> dg.TimeWindow | None:
    """A partition's time window; None for a key this definition no longer has."""
    try:
        return partitions.time_window_for_partition_key(key)
    except (ValueError, TypeError, dg.DagsterInvalidDefinitionError):
        return None


def _partitioned_children(
    repository: dg.RepositoryDefinition | None, key: dg.AssetKey
) -> dict[dg.AssetKey, dg.TimeWindowPartitionsDefinition]:
    """The assets directly downstream of ``key`` with time-window partitions."""
    if repository is None or not repository.asset_graph.has(key):
        return {}
    graph = repository.asset_graph
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
    built: _Built,
    now: datetime,
    cursor: _Cursor,
) -> None:
    """Queue the partitions each new record of ``key`` restated: its materializations, and the
    observations an operator job records when it names no hour. A run of many hours records
    the same span on each: it is read once (``_Cursor.last``)."""
    name = key.to_user_string()
    for kind, fetch in (
        ("", instance.fetch_materializations),
        (OBSERVED, instance.fetch_observations),
    ):
        records = fetch(
            dg.AssetRecordsFilter(asset_key=key, after_storage_id=cursor.after.get(name + kind)),
            limit=RECORDS_PER_TICK,
            ascending=True,
        ).records
        for record in records:
            cursor.after[name + kind] = record.storage_id
            event = record.asset_materialization or record.asset_observation
            metadata = event.metadata if event else {}
            window = _window(metadata, now)
            span = [
                record.run_id,
                *(str(getattr(metadata.get(k), "value", "")) for k in RESTATED_KEYS),
            ]
            if window is None or cursor.last.get(name + kind) == span:
                continue
            cursor.last[name + kind] = span
            _queue(cursor, children, built, window, record.storage_id)


def _queue(
    cursor: _Cursor,
    children: dict[dg.AssetKey, dg.TimeWindowPartitionsDefinition],
    built: _Built,
    window: dg.TimeWindow,
    storage_id: int,
) -> None:
    """Queue each child's partition whose window overlaps ``window`` and whose latest
    materialization came before the record (one built since has read the restated rows)."""
    queued = {(a, p) for a, p, _ in cursor.queue}
    for child, partitions in children.items():
        asset = child.to_user_string()
        for p, (latest, w) in built.of(child, partitions).items():
            if latest < storage_id and _overlaps(w, window) and (asset, p) not in queued:
                queued.add((asset, p))
                cursor.queue.append((asset, p, storage_id))


def _due(
    cursor: _Cursor, known: dict[dg.AssetKey, dg.TimeWindowPartitionsDefinition]
) -> list[dg.RunRequest]:
    """The next requests off the queue, dropping those for an asset or partition the code
    location no longer has (a request Dagster would refuse, failing every tick)."""
    due: list[dg.RunRequest] = []
    while cursor.queue and len(due) < MAX_PARTITIONS_PER_TICK:
        asset, p, storage_id = cursor.queue.pop(0)
        partitions = known.get(dg.AssetKey.from_user_string(asset))
        if partitions is not None and partitions.has_partition_key(p):
            due.append(_request(asset, p, storage_id))
    return due


def _window(metadata: Mapping[str, dg.MetadataValue], now: datetime) -> dg.TimeWindow | None:
    """The restated valid time, up to ``now`` (a live version's end is 9999-12-31). None for
    none, and for values that are not times (metadata anyone can write: never a stuck tick)."""
    start, end = (metadata.get(k) for k in RESTATED_KEYS[:2])
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


def _overlaps(partition: dg.TimeWindow, span: dg.TimeWindow) -> bool:
    """A partition's half-open window against a restated span whose end is an instant that
    changed (included)."""
    return partition.start <= span.end and partition.end > span.start


def _request(asset: str, partition: str, storage_id: int) -> dg.RunRequest:
    """One partition again; retried by Dagster's run retries if it fails (a request's run key
    is used once)."""
    return dg.RunRequest(
        run_key=f"{asset}|{partition}|{storage_id}",
        asset_selection=[dg.AssetKey.from_user_string(asset)],
        partition_key=partition,
        tags={
            RESTATED_BY_TAG: str(storage_id),
            "dagster/max_retries": str(RESTATEMENT_RETRIES),
            "dagster/retry_on_asset_or_op_failure": "true",
        },
    )
