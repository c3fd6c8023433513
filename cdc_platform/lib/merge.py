"""Bringing the history table up to date with the change log, as one atomic Delta commit.

The history table records, in each commit, the change-log version it reflects (a Delta app
transaction). Whatever was logged after that version is *pending*. A run costs what the pending
events touch, not what the table holds:

* **Files by segment.** Every history file holds rows of one segment only: *live* (active
  rows), *deleted* (the last version of a deleted key) or *closed* (every version that is no
  longer a key's latest). The live and deleted segments hold one row per key at most; the
  closed segment only grows by appends. File statistics (min = max of ``_fivetran_active`` and
  ``_cdc_current``) say which segment a file is, so readers skip the closed part of
  ``WHERE _fivetran_active`` and a run never opens a closed file unless it must.
* **Fast path.** A key whose pending events are all later than the last event it received
  (``_cdc_last_event_at`` on its current row) is folded from its current row alone: the row
  stands in for the key's whole past (its image, whether it is live, and when it last changed).
  Such a key never reads the change log nor a closed file.
* **Slow path.** A key with a pending event at or before its last event (a late event, even in
  the same millisecond) is refolded from the change log. Only its versions ending at or after
  the earliest late event can change (``unchanged_before``): closed files are clustered by the
  time their versions ended, so those that ended earlier are neither read nor rewritten, and
  an hour's late events rewrite the recent closed files only. The refold starts from the
  key's latest version read that started before its late event, replayed (``_slow_events``),
  so the change-log files logged before it are skipped too.
* **Keys with no version.** A key whose every event is a delete has no row in the table, yet
  its deletes matter if an older insert lands later. Such keys, with their last event time,
  are kept in a small side table (``delete_only_keys``) so that a new key can be told from one.
* **Retracted keys.** Un-applying a landing file (``lib.revocation``) takes its events out of
  the change log, so a key may lose events without gaining any. Such keys are listed in a side
  table (``retracted_keys``) with the change-log version the removal followed; until the
  history table has caught up past it, they are recomputed (slow path), even with no event left.

Only files holding a row that changes are rewritten (copy-on-write); rows that stay as they
were keep their ``_fivetran_synced``. Removes and adds are committed together with the new
watermark. A crash at any point leaves the previous version intact, and the next run finds the
same pending work.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from cdc_platform.lib import changelog, delta, joins
from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGED,
    CURRENT,
    END,
    HISTORY_SYSTEM_COLUMNS,
    LAST_EVENT_AT,
    OP,
    SEQ,
    START,
    STATE_COLUMNS,
    SYNCED,
    TS,
    UNMODIFIED,
    col,
    cols,
    from_unix_micros,
    internal,
    quote,
    timestamp_lit,
    unix_micros,
)
from cdc_platform.lib.history import (
    HISTORY_COLUMNS_PROPERTY,
    TRACK_ALL,
    HistoryColumns,
    build_versions,
    dedupe_events,
)
from cdc_platform.lib.run_cost import lap
from cdc_platform.lib.spark import ADAPTIVE, interpreted, persisted
from cdc_platform.lib.storage import Location
from cdc_platform.lib.table import Commit, Table
from cdc_platform.lib.warehouse import TablePaths

if TYPE_CHECKING:
    from deltalake.transaction import AddAction
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

APP_ID = "cdc_platform/changelog"
# History files are smaller than the change log's: a late event rewrites whole closed files.
HISTORY_ROWS_PER_FILE = delta.ROWS_PER_FILE // 4
COMMIT_ATTEMPTS = delta.COMMIT_ATTEMPTS
FAULT_ENV = "CDC_PLATFORM_FAULT"
SYSTEM_COLUMNS = (*HISTORY_SYSTEM_COLUMNS, *STATE_COLUMNS)

# Working columns of the merge, never stored, under the internal prefix (never a source name).
_FILE = internal("file")
_MIN_MS = internal("min_ms")
_SLOW = internal("slow")
_SEGMENT = internal("segment")
_OLD_FILE = internal("old_file")
_OLD_SYNCED = internal("old_synced")
_OLD_ACTIVE = internal("old_active")
_DELETE_ONLY = internal("delete_only")
_FORCED = internal("forced")
_MARKED = internal("marked")  # a key's pending events carry an unmodified marker (rule 1)
_CHECKPOINT = internal("checkpoint")
# The seq of a replayed version (``_slow_events``): below any logged event of its millisecond.
REPLAY_SEQ = -(2**63)

# Column of the retracted-keys side table: the change-log version its removal commit followed.
AFTER_LOG_VERSION = "_cdc_after_log_version"
# In a history commit's metadata: the keys it recomputed (a JSON list; a small run's only), so
# that the checks after the run verify those keys (``invariants.touched_keys``).
TOUCHED_KEYS = "cdc_platform.touched_keys"
MAX_TOUCHED_KEYS_BYTES = 32_768  # the log is read by every reader: keep its commits small


class HistoryColumnsError(ValueError):
    """The table's selective-history setting names a column the table does not have."""


@dataclass(frozen=True)
class MergeResult:
    keys_affected: int = 0
    fast_keys: int = 0
    slow_keys: int = 0
    versions_opened: int = 0
    versions_closed: int = 0
    rows_written: int = 0
    files_removed: int = 0
    files_added: int = 0
    bytes_removed: int = 0
    bytes_added: int = 0
    changelog_bytes_read: int = 0
    history_bytes_read: int = 0
    history_version: int | None = None
    changelog_version: int | None = None
    attempts: int = 0


def fault_point(name: str) -> None:
    """Crash the process here when ``CDC_PLATFORM_FAULT`` names this point (crash-safety tests)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), 9)


def history_schema(primary_key: Sequence[str], key_and_data: pa.Schema) -> pa.Schema:
    ts = pa.timestamp("us", tz="UTC")
    keys = [key_and_data.field(k) for k in primary_key]
    data = [f for f in key_and_data if f.name not in primary_key]
    system = [
        pa.field(START, ts),
        pa.field(END, ts),
        pa.field(ACTIVE, pa.bool_()),
        pa.field(SYNCED, ts),
        pa.field(CURRENT, pa.bool_()),
        pa.field(LAST_EVENT_AT, ts),
        pa.field(CHANGED, pa.list_(pa.string())),
    ]
    return pa.schema([f.with_nullable(True) for f in (*keys, *data, *system)])


def is_closed_file(f: delta.DataFile) -> bool:
    """A file of the closed segment: no row in it is any key's latest version."""
    return f.max_values.get(CURRENT) is False


def apply_pending(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    synced_at: datetime,
    history_columns: HistoryColumns = TRACK_ALL,
    list_keys: bool = False,
) -> MergeResult:
    """Recompute the keys with pending change-log events; retry if another writer commits first.

    A table built with another ``history_columns`` setting is recomputed whole, once: its
    versions were cut by other columns. The setting is then recorded on the table.
    ``list_keys``: a small run names its keys in its commit, for the checks that follow
    (``TOUCHED_KEYS``; never for an encrypted table: its keys are decrypted data).
    """
    result, attempts = delta.with_commit_retries(
        lambda: _apply_once(spark, paths, primary_key, synced_at, history_columns, list_keys),
        f"history commit for {paths.history}",
    )
    if result.history_version is not None:
        record_history_columns(paths, history_columns, result.history_version)
    return replace(result, attempts=attempts)


def caught_up(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    synced_at: datetime,
    history_columns: HistoryColumns = TRACK_ALL,
) -> Table | None:
    """The change log as the history table now reflects it, after merging what was pending:
    the version an operator job decides on (None: no change log yet). Raises
    ``CommitFailedError`` when events were logged during the catch-up, so the caller's retry
    (``delta.with_commit_retries``) catches up and decides again."""
    from deltalake.exceptions import CommitFailedError

    apply_pending(spark, paths, primary_key, synced_at, history_columns)
    log = Table.open(paths.changelog)
    if not log.exists:
        return None
    if changelog.files_since(log, Table.open(paths.history).watermark(APP_ID)):
        raise CommitFailedError(f"{paths.changelog}: events were logged during the catch-up")
    return log


def widen_to_changelog(spark: SparkSession, snap: _Snapshot) -> bool:
    """Give the history table and its side tables the column types the change-log snapshot
    has (wider, after a file widened a column there), each in one strict commit before the
    merge: every version keeps its values, cast, and the merge then runs on the widened table.
    Part of each merge attempt: a widening that loses a race is retried with the rest.
    Returns whether a table was widened."""
    logged = changelog.key_and_data_of(snap.changelog.arrow_schema)
    widened = False
    for table in (snap.history, snap.delete_only_keys, snap.retracted_keys):
        if table.exists:
            widened |= table.widened(spark, logged) is not table
    return widened


def record_history_columns(
    paths: TablePaths, history_columns: HistoryColumns, data_version: int
) -> bool:
    """Record the setting once the versions follow it: a metadata-only commit right after the
    data commit ``data_version``, and strict. If any other commit came in between (a run with
    the old setting may have merged some keys its way), nothing is recorded: the table still
    says the old setting, so the next run recomputes it whole again. A crash in between has
    the same effect. Returns whether the setting was recorded now."""
    from deltalake import CommitProperties
    from deltalake.exceptions import CommitFailedError

    dt = Table.open(paths.history).dt
    assert dt is not None  # it has just committed ``data_version``
    if HistoryColumns.of_table(dt).same_as(history_columns) or dt.version() != data_version:
        return False
    try:
        dt.alter.set_table_properties(
            {HISTORY_COLUMNS_PROPERTY: history_columns.to_json()},
            raise_if_not_exists=False,
            commit_properties=CommitProperties(max_commit_retries=0),
        )
    except CommitFailedError:
        return False
    return True


@dataclass(frozen=True)
class _Snapshot:
    """What one attempt saw: each of its four tables opened once, so the whole attempt sees
    one version of each and commits against it."""

    changelog: Table
    history: Table
    delete_only_keys: Table
    retracted_keys: Table
    applied: int | None  # change-log version the history table reflects
    # The history table predates a state column, or follows another history_columns
    # setting: recompute every key.
    rebuild: bool

    @classmethod
    def open(cls, paths: TablePaths, history_columns: HistoryColumns) -> _Snapshot | None:
        log = Table.open(paths.changelog)
        if not log.exists:
            return None
        history = Table.open(paths.history)
        rebuild = history.dt is not None and (
            not set(STATE_COLUMNS) <= set(history.arrow_schema.names)
            or not HistoryColumns.of_table(history.dt).same_as(history_columns)
        )
        applied = None if rebuild else history.watermark(APP_ID)
        side, retracted = Table.open(paths.delete_only_keys), Table.open(paths.retracted_keys)
        return cls(log, history, side, retracted, applied, rebuild)

    @property
    def delete_only_keys_stale(self) -> bool:
        """The delete-only side table missed the history table's last commit (a crash came
        between the two), or is missing while the history table has applied events."""
        if not self.delete_only_keys.exists:
            return self.applied is not None
        return self.delete_only_keys.watermark(APP_ID) != self.applied


@dataclass(frozen=True)
class _Attempt:
    """One attempt's fixed facts, handed to every stage: the snapshot it read, the pending
    change-log files, the history table it writes (created if new) and its files by segment."""

    spark: SparkSession
    paths: TablePaths
    pk: list[str]
    history_columns: HistoryColumns
    snap: _Snapshot
    log_version: int  # the change-log version this attempt reads up to
    pending: list[delta.DataFile]
    retracted: DataFrame | None  # keys an un-apply took events from (``_pending_retractions``)
    retracted_rows: int | None
    history: Table  # the history table this attempt writes (created if new)
    data_columns: list[str]
    # A run of a few keys: what it reuses is kept as local checkpoints (``_cached``), and it
    # runs ``interpreted``.
    small: bool
    stack: ExitStack  # what the attempt keeps (``keep``) is released when it ends

    @property
    def columns(self) -> list[str]:
        return self.history.arrow_schema.names

    @property
    def files(self) -> list[delta.DataFile]:
        return self.history.files

    @property
    def log(self) -> Table:
        return self.snap.changelog

    @property
    def current_files(self) -> list[delta.DataFile]:
        return [f for f in self.files if not is_closed_file(f)]

    @property
    def closed_files(self) -> list[delta.DataFile]:
        return [f for f in self.files if is_closed_file(f)]

    @property
    def touched_rows(self) -> int | None:
        """A bound on the run's key rows, from Delta statistics and the run's own counts
        (``lib.joins``: never Spark's estimate of them)."""
        return joins.add(joins.records(self.pending), self.retracted_rows)

    def keep(self, df: DataFrame) -> DataFrame:
        """``df``, computed once for the Spark jobs of this attempt that reuse it."""
        return self.stack.enter_context(_cached(df, self.small))

    def read_history(
        self, files: Sequence[delta.DataFile], where: Column | None = None
    ) -> DataFrame:
        return _read_history(self.spark, self.history, files, where)


@dataclass(frozen=True)
class _Touched:
    """The keys with pending events (or retracted), and the rows the fast path folds from."""

    events: DataFrame  # the pending events, deduplicated (rule 2)
    keys: DataFrame  # each key with its earliest pending millisecond and whether it is forced
    values: list[Any] | None  # the keys, held on the driver (a small run's)
    current: DataFrame  # their current rows, with ``_FILE``
    current_rows: int | None
    unversioned: DataFrame  # every delete-only key
    unversioned_rows: int | None
    unversioned_touched: DataFrame  # the run's delete-only keys
    side_stale: bool  # the delete-only side table missed the last commit (a crash)
    tiny: int | None  # bound on the key rows when they are held: joins among them shuffle


@dataclass(frozen=True)
class _Split:
    """The run's keys split into the fast path and the slow path (``_classify``)."""

    keys: DataFrame  # every touched key with ``_SLOW`` and ``_DELETE_ONLY`` (may repeat one)
    affected: int
    slow_count: int
    delete_only_touched: int
    cut: datetime | None  # versions ending before it cannot change (``unchanged_before``)
    slow_keys: DataFrame
    fast_keys: DataFrame
    slow_values: list[Any] | None
    fast_values: list[Any] | None
    resolve_unmodified: bool  # may an event to fold carry an unmodified marker (rule 1)?

    @property
    def fast_count(self) -> int:
        return self.affected - self.slow_count


@dataclass(frozen=True)
class _Gathered:
    """What the fold reads: the events of every key and the old rows it compares against."""

    events: DataFrame
    old: DataFrame  # the old rows that may change, with ``_FILE``
    old_rows: int | None
    closed_read: list[delta.DataFile]
    log_read: list[delta.DataFile]
    checkpoints: DataFrame | None  # each slow key's ``_CHECKPOINT`` (``_slow_events``)
    version_rows: int | None  # bound on the versions the fold makes
    probe: int | None  # ``version_rows`` when the run's rows are tiny (joins among them shuffle)


def _apply_once(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    synced_at: datetime,
    history_columns: HistoryColumns,
    list_keys: bool = False,
) -> MergeResult:
    """One attempt of the merge, stage by stage: open, classify, fold and compare, write,
    commit, side tables (each stage's time and Spark jobs go to the run's cost)."""
    lap("merge_open")
    with ExitStack() as stack:
        a = _open_attempt(spark, paths, list(primary_key), history_columns, stack)
        if isinstance(a, MergeResult):
            return a
        if a.small:
            stack.enter_context(interpreted(spark))
        lap("merge_classify")
        touched = _touch(a)
        split = _split(a, touched)
        lap("merge_fold_compare")
        gathered = _gather(a, touched, split)
        compared, last_events = _fold(a, split, gathered, synced_at)
        old_rows = gathered.old_rows if touched.tiny else None
        old = gathered.old if gathered.old_rows != 0 else None  # a first load has no old rows
        change = _changes(compared, old, a.pk, gathered.version_rows, old_rows)
        rewritten = _rewritten(a, change)
        lap("merge_write")
        with a.history.committing() as commit:
            adds = _write(a, commit, gathered, compared, rewritten)
            lap("merge_commit")
            version = _commit(a, commit, touched, split.affected, rewritten, list_keys)
        lap("merge_side_tables")
        _store_side_tables(a, touched, split, compared, last_events, change, gathered)
    return MergeResult(
        keys_affected=split.affected,
        fast_keys=split.fast_count,
        slow_keys=split.slow_count,
        versions_opened=change.opened,
        versions_closed=change.closed + change.vanished,
        rows_written=sum(delta.num_records(x) for x in adds),
        files_removed=len(rewritten),
        files_added=len(adds),
        bytes_removed=sum(f.size for f in rewritten),
        bytes_added=sum(x.size for x in adds),
        changelog_bytes_read=sum(f.size for f in (*a.pending, *gathered.log_read)),
        history_bytes_read=sum(f.size for f in (*a.current_files, *gathered.closed_read))
        + sum(f.size for f in rewritten),
        history_version=version,
        changelog_version=a.log_version,
    )


def _rewritten(a: _Attempt, change: _Changes) -> list[delta.DataFile]:
    """The files to remove. Each name comes from a row's file URL (``table_relative``); one
    that is not a file of the snapshot would leave its rows in place beside their new copies,
    so the run stops before writing anything."""
    rewritten = [f for f in a.files if f.path in change.rewritten]
    unknown = change.rewritten - {f.path for f in rewritten}
    if unknown:
        raise RuntimeError(
            f"{a.history}: rows came from files the table's snapshot does not list "
            f"({sorted(unknown)[:3]}); nothing was written"
        )
    return rewritten


def _open_attempt(
    spark: SparkSession,
    paths: TablePaths,
    pk: list[str],
    history_columns: HistoryColumns,
    stack: ExitStack,
) -> _Attempt | MergeResult:
    """Open every table once and find the pending change-log files; with none (and no
    retracted key), the result as it stands. The history table is created on the first run,
    with the change log's key and data columns and the system columns (rule 1)."""
    snap = _Snapshot.open(paths, history_columns)
    if snap is None:
        return MergeResult(history_version=delta.version_or_none(paths.history))
    while widen_to_changelog(spark, snap):  # types only widen: it ends
        snap = _Snapshot.open(paths, history_columns)
        assert snap is not None
    log_version = snap.changelog.version
    assert log_version is not None
    pending = changelog.files_since(snap.changelog, snap.applied)
    retracted, retracted_rows = _pending_retractions(spark, snap, log_version)
    if not pending and retracted is None:
        if snap.history.exists and snap.delete_only_keys_stale:
            # A crash came between the last history commit and its side-table commit.
            unversioned, _ = _read_delete_only_keys(spark, pk, snap)
            assert snap.applied is not None
            _store_delete_only_keys(snap.delete_only_keys, unversioned, snap.applied)
        return MergeResult(history_version=snap.history.version, changelog_version=log_version)
    schema = history_schema(pk, changelog.key_and_data_of(snap.changelog.arrow_schema))
    data_columns = [f.name for f in schema if f.name not in pk and f.name not in SYSTEM_COLUMNS]
    unknown = history_columns.unknown(data_columns)
    if unknown:
        raise HistoryColumnsError(
            f"{paths.history}: the config's track_history_columns / ignore_history_columns name "
            f"{unknown}, which the table does not have (its data columns: "
            f"{', '.join(data_columns)}). Nothing was merged: fix the config and run again."
        )
    history = snap.history.ensure(schema, "cdc_platform history-mode table")
    return _Attempt(
        spark=spark,
        paths=paths,
        pk=pk,
        history_columns=history_columns,
        snap=snap,
        log_version=log_version,
        pending=pending,
        retracted=retracted,
        retracted_rows=retracted_rows,
        history=history,
        data_columns=data_columns,
        small=_small(spark, joins.add(joins.records(pending), retracted_rows)),
        stack=stack,
    )


def _small(spark: SparkSession, touched_rows: int | None) -> bool:
    """Whether a run is small enough for local checkpoints: a few keys' rows, and planned
    whole (under adaptive execution, making a checkpoint already runs its stages)."""
    adaptive = str(spark.conf.get(ADAPTIVE, "true")).strip().lower()
    return touched_rows is not None and touched_rows <= joins.MAX_KEY_VALUES and adaptive == "false"


def _touch(a: _Attempt) -> _Touched:
    """The keys this run recomputes (those with pending events, and retracted keys whatever
    their events say) and their current rows and delete-only records. A small run holds its
    keys on the driver (one Spark job): each read by key is then a filter, and the joins
    between what those reads give are shuffles inside one job."""
    from pyspark.sql import functions as F

    pk = a.pk
    events = dedupe_events(a.log.read(a.spark, a.pending), pk)
    if not a.small:  # read and sorted once for the keys, their last events and the fold
        events = a.keep(events)
    ms = F.date_trunc("millisecond", col(TS))
    marked = F.coalesce(F.size(col(UNMODIFIED)) > 0, F.lit(False))
    keys = events.select(
        *cols(pk), ms.alias(_MIN_MS), F.lit(False).alias(_FORCED), marked.alias(_MARKED)
    )
    if a.retracted is not None:
        no_time = F.lit(None).cast("timestamp").alias(_MIN_MS)
        keys = keys.unionByName(
            a.retracted.select(
                *cols(pk), no_time, F.lit(True).alias(_FORCED), F.lit(False).alias(_MARKED)
            )
        )
    keys = a.keep(
        keys.groupBy(*cols(pk)).agg(
            F.min(_MIN_MS).alias(_MIN_MS),
            F.max(_FORCED).alias(_FORCED),
            F.max(_MARKED).alias(_MARKED),
        )
    )
    touched_rows = a.touched_rows
    values = joins.key_values(keys, pk, touched_rows)
    # The live and deleted segments hold one row per key: at most one per touched key.
    one_per_key = all(f.min_values.get(CURRENT) is True for f in a.current_files)
    current_rows = joins.smallest(
        joins.records(a.current_files), touched_rows if one_per_key else None
    )
    if values is not None:
        current = a.read_history(a.current_files, joins.in_keys(pk, values))
    else:
        current = a.read_history(a.current_files).join(
            joins.build_side(keys.select(*cols(pk)), touched_rows), pk, "left_semi"
        )
    side_stale = a.snap.delete_only_keys_stale
    unversioned, unversioned_rows = _read_delete_only_keys(a.spark, pk, a.snap)
    return _Touched(
        events=events,
        keys=keys,
        values=values,
        current=a.keep(current),
        current_rows=current_rows,
        unversioned=unversioned,
        unversioned_rows=unversioned_rows,
        unversioned_touched=unversioned
        if values is None
        else unversioned.filter(joins.in_keys(pk, values)),
        side_stale=side_stale,
        tiny=touched_rows if values is not None else None,
    )


def _split(a: _Attempt, t: _Touched) -> _Split:
    """Classify the keys fast or slow and count them, in one Spark job; the earliest late
    event gives the time before which nothing changes (``unchanged_before``)."""
    from pyspark.sql import functions as F

    pk = a.pk
    keys = a.keep(
        _classify(
            t.keys,
            t.current,
            t.unversioned_touched,
            pk,
            slow_everything=a.snap.rebuild,
            rows=(t.current_rows, t.unversioned_rows),
            tiny=t.tiny,
        )
    )
    slow_set = (
        [F.collect_set(F.when(col(_SLOW), col(pk[0]))).alias("slow_values")]
        if t.values is not None
        else []
    )
    counts = keys.agg(
        F.count(F.lit(1)).alias("n"),
        F.sum(col(_SLOW).cast("int")).alias("slow"),
        F.sum(col(_DELETE_ONLY).cast("int")).alias("delete_only"),
        F.min(F.when(col(_SLOW), F.unix_micros(col(_MIN_MS)))).alias("earliest_late"),
        F.max((col(_SLOW) & (col(_FORCED) | col(_MIN_MS).isNull())).cast("int")).alias("unbounded"),
        F.max(col(_MARKED).cast("int")).alias("marked"),
        *slow_set,
    ).collect()[0]  # a global aggregate: exactly one row
    affected, slow_count = int(counts["n"]), int(counts["slow"] or 0)
    slow_keys = keys.filter(col(_SLOW)).select(*cols(pk))
    slow_values = fast_values = None
    if t.values is not None:  # held: the classification's own collect
        slow_values = sorted(counts["slow_values"])
        fast_values = sorted(set(t.values) - set(slow_values))
    elif slow_count:
        slow_values = joins.key_values(slow_keys, pk, slow_count)
    return _Split(
        keys=keys,
        affected=affected,
        slow_count=slow_count,
        delete_only_touched=int(counts["delete_only"] or 0),
        cut=None
        if a.snap.rebuild or counts["unbounded"]
        else unchanged_before(counts["earliest_late"]),
        slow_keys=slow_keys,
        # A key that repeats in ``keys`` is slow if any of its rows is.
        fast_keys=keys.groupBy(*cols(pk))
        .agg(F.max(col(_SLOW)).alias(_SLOW))
        .filter(~col(_SLOW))
        .select(*cols(pk)),
        slow_values=slow_values,
        fast_values=fast_values,
        # A slow key is refolded from logged events, which may carry markers.
        resolve_unmodified=bool(slow_count or counts["marked"]),
    )


def _gather(a: _Attempt, t: _Touched, s: _Split) -> _Gathered:
    """The events to fold and the old rows to compare with. A fast key's events are its
    pending ones after its current row (or delete-only record) replayed (``_state_events``);
    a slow key's are read back from the change log (``_slow_events``), with its closed rows
    that may change (those ending at or after the cut) among the old rows."""
    pk = a.pk

    def fast(df: DataFrame) -> DataFrame:
        return joins.restrict(df, s.fast_keys, pk, s.fast_count, s.fast_values)

    # With no slow key (a first load, an hour of new keys) the touched keys' events and
    # current rows are all the fast path's: no join to restrict them.
    fast_events, fast_current = (
        (fast(t.events), fast(t.current)) if s.slow_count else (t.events, t.current)
    )
    events = fast_events.unionByName(
        _state_events(fast_current, pk, a.data_columns), allowMissingColumns=True
    ).unionByName(_ghost_events(fast(t.unversioned_touched), pk), allowMissingColumns=True)
    old = t.current.select(*cols([*a.columns, _FILE]))
    closed_read: list[delta.DataFile] = []
    if s.slow_count:
        closed_read = [
            f
            for f in _files_maybe_holding(a.closed_files, pk, s.slow_values)
            if _may_reach(f, END, s.cut)
        ]
    if closed_read:  # read once: checkpoints, comparison and carried rows use it
        closed = _read_closed(a, s, closed_read).select(*cols([*a.columns, _FILE]))
        old = a.keep(old.unionByName(closed))
    old_rows = joins.add(t.current_rows, joins.records(closed_read))
    log_read: list[delta.DataFile] = []
    checkpoints = None
    if s.slow_count:
        held = old_rows if t.tiny is not None else None
        slow_events, log_read, checkpoints, old = _slow_events(a, s, old, held)
        events = events.unionByName(slow_events, allowMissingColumns=True)
    # Versions come from events: the pending ones, up to two replayed per current row and one
    # per delete-only key, the change-log events and old rows of slow keys.
    version_rows = joins.add(
        joins.records(a.pending),
        t.current_rows,
        t.current_rows,
        s.affected,
        joins.records(log_read),
        old_rows,
    )
    if a.small or s.slow_count:
        # Read twice (the keys' versions, and their last events for the side table): computed
        # once. A large run without slow keys recomputes only a union over its kept events.
        events = a.keep(events)
    return _Gathered(
        events=events,
        old=old,
        old_rows=old_rows,
        closed_read=closed_read,
        log_read=log_read,
        checkpoints=checkpoints,
        version_rows=version_rows,
        probe=version_rows if t.tiny is not None else None,
    )


def _fold(a: _Attempt, s: _Split, g: _Gathered, synced_at: datetime) -> tuple[DataFrame, DataFrame]:
    """The keys' versions (rules 3-7: ``history.build_versions``), each marked current or not,
    compared with the old rows (``_compare``); and each key's last event time, which the
    delete-only side table needs after the commit (computed then, from ``g.events``)."""
    from pyspark.sql import functions as F

    pk = a.pk
    last_events = g.events.groupBy(*cols(pk)).agg(
        F.max(F.date_trunc("millisecond", col(TS))).alias(LAST_EVENT_AT)
    )
    versions = build_versions(
        g.events,
        pk,
        a.data_columns,
        deduplicated=True,
        history_columns=a.history_columns,
        with_state=True,
        resolve_unmodified=s.resolve_unmodified,
    )
    # One row per key (``current`` may hold more than one row of a key when file statistics
    # cannot tell closed files apart, so ``keys`` may repeat a key).
    if s.slow_count:
        slow_of = s.keys.groupBy(*cols(pk)).agg(F.max(col(_SLOW)).alias(_SLOW))
        if g.checkpoints is not None:
            slow_of = slow_of.join(
                joins.build_side(g.checkpoints, s.slow_count, g.probe), pk, "left"
            )
        else:
            slow_of = slow_of.withColumn(_CHECKPOINT, F.lit(None).cast("timestamp"))
        versions = versions.join(joins.build_side(slow_of, s.affected, g.probe), pk, "left")
    else:  # every key fast: nothing to join
        versions = versions.select(
            "*", F.lit(False).alias(_SLOW), F.lit(None).cast("timestamp").alias(_CHECKPOINT)
        )
    compared = _compare(
        versions,
        joins.build_side(g.old, g.old_rows, g.probe),
        pk,
        a.data_columns,
        synced_at,
        s.cut,
    )
    return a.keep(compared), last_events


def _write(
    a: _Attempt,
    commit: Commit,
    g: _Gathered,
    compared: DataFrame,
    rewritten: list[delta.DataFile],
) -> list[AddAction]:
    """Write the new files (copy-on-write): the new and changed rows, and the rows of the
    rewritten files that this run did not recompute, carried as they are."""
    pk = a.pk
    carried = (
        a.read_history(rewritten)
        .join(
            joins.build_side(g.old.select(*cols([*pk, START])), g.old_rows),
            [*pk, START],
            "left_anti",
        )
        .select(*cols(a.columns))
    )
    names = sorted(f.path for f in rewritten)
    fresh = compared.filter(col(_OLD_FILE).isNull() | col(_OLD_FILE).isin(names))
    expected = sum(f.num_records or 0 for f in (*rewritten, *a.pending))
    return write_segments(
        carried.unionByName(fresh.select(*cols(a.columns))), commit, a.pk, expected
    )


def _commit(
    a: _Attempt,
    commit: Commit,
    t: _Touched,
    keys_affected: int,
    rewritten: list[delta.DataFile],
    list_keys: bool,
) -> int:
    """Removes, adds and the change-log version now reflected, in one strict commit: a crash
    or a lost race leaves the table as it was (``Table.committing`` discards the files)."""
    fault_point("before_history_commit")
    return commit.commit(
        delta.removes_for(rewritten),
        app_transaction=(APP_ID, a.log_version),
        metadata={
            "cdc_platform.keys_affected": keys_affected,
            "cdc_platform.changelog_version": a.log_version,
            # A rebuild may change other keys' rows: no list.
            **touched_keys_metadata(t.values if list_keys and not a.snap.rebuild else None),
        },
        strict=True,
    )


def _store_side_tables(
    a: _Attempt,
    t: _Touched,
    s: _Split,
    compared: DataFrame,
    last_events: DataFrame,
    change: _Changes,
    g: _Gathered,
) -> None:
    """The delete-only keys after this run: keys whose events (all of them, or the state the
    fast path replayed) made no version; untouched delete-only keys stay. Rewritten only when
    it changed, or missed a commit."""
    pk = a.pk
    now_unversioned = last_events.join(
        joins.build_side(
            compared.select(*cols(pk)), g.version_rows, s.affected if t.tiny else None
        ),
        pk,
        "left_anti",
    )
    kept_unversioned = joins.restrict(t.unversioned, s.keys, pk, s.affected, t.values, "left_anti")
    changed = bool(s.delete_only_touched or s.affected > change.keys)
    side = a.snap.delete_only_keys
    rewrite = changed or t.side_stale or a.snap.rebuild or not side.exists
    _store_delete_only_keys(
        side,
        kept_unversioned.unionByName(now_unversioned) if rewrite else None,
        a.log_version,
    )


def touched_keys_metadata(values: list[Any] | None) -> dict[str, str]:
    """The commit metadata naming the keys a run recomputed, when they are held and few (every
    row the commit changes is one of theirs: the others' rows are carried as they were)."""
    if values is None:
        return {}
    listed = json.dumps(values, ensure_ascii=True, separators=(",", ":"))
    return {TOUCHED_KEYS: listed} if len(listed) <= MAX_TOUCHED_KEYS_BYTES else {}


def _slow_events(
    a: _Attempt, s: _Split, old: DataFrame, old_rows: int | None
) -> tuple[DataFrame, list[delta.DataFile], DataFrame, DataFrame]:
    """The events the slow keys are refolded from, the change-log files read for them, each
    slow key's ``_CHECKPOINT`` (null: refolded from its first event) and ``old`` without the
    versions before the checkpoints.

    A slow key is refolded from its checkpoint: the latest version this run read (``old``:
    the current row and the closed rows ending at or after ``cut``) that started before the
    key's earliest pending event (the version that event falls in, or the deleted version
    before it). The versions before it cannot change (``unchanged_before``); the version itself,
    replayed as an insert sorting before every event of its millisecond, stands for the key's
    past; the events logged from its start on do the rest (the start's own events are folded
    again, they give the same image). So a late key reads the change log back to its
    checkpoint, not to its first event, and change-log files whose events all came earlier
    are skipped. Retracted keys, a table recomputed whole, keys without such
    a version and tables with untracked columns (a version's stored image is that of its last
    step, so it cannot stand for its first) are refolded from all their events.

    ``old_rows`` bounds ``old``'s when a small run read it by key (joins of two tiny sides are
    shuffles), as the Delta statistics of the change-log files read bound the events'; the
    slow keys' count bounds theirs (``lib.joins``: broadcast only when small).
    """
    from pyspark.sql import functions as F

    pk, keys, cut, slow_values, slow_rows = a.pk, s.keys, s.cut, s.slow_values, s.slow_count
    untracked = bool(a.history_columns.untracked(a.data_columns))

    slow = (
        keys.filter(col(_SLOW))
        .groupBy(*cols(pk))
        .agg(F.min(col(_MIN_MS)).alias(_MIN_MS), F.max(col(_FORCED)).alias(_FORCED))
    )
    since: datetime | None = None
    if cut is None:
        checkpoints = slow.select(*cols(pk), F.lit(None).cast("timestamp").alias(_CHECKPOINT))
    else:
        last_before = (
            old.join(
                joins.build_side(slow.select(*cols([*pk, _MIN_MS])), slow_rows, old_rows),
                pk,
                "inner",
            )
            .groupBy(*cols(pk))
            .agg(F.max(F.when(col(START) < col(_MIN_MS), col(START))).alias(_CHECKPOINT))
        )
        usable = ~col(_FORCED)
        if untracked:  # the stored image is the version's last step's, not its first's
            usable = F.lit(False)
        checkpoints = slow.join(
            joins.build_side(last_before, slow_rows, slow_rows if old_rows else None), pk, "left"
        ).select(*cols(pk), F.when(usable, col(_CHECKPOINT)).alias(_CHECKPOINT))
        bounds = checkpoints.agg(
            F.min(F.unix_micros(col(_CHECKPOINT))).alias("since"),
            F.max(col(_CHECKPOINT).isNull().cast("int")).alias("from_first"),
        ).collect()[0]
        if not bounds["from_first"] and bounds["since"] > _EARLIEST_CUT_US:
            since = from_unix_micros(bounds["since"])
    # Key statistics skip files holding no slow key (compacted files are key-sorted), time
    # statistics those logged entirely before every checkpoint.
    log_read = [
        f for f in _files_maybe_holding(a.log.files, pk, slow_values) if _may_reach(f, TS, since)
    ]
    log = a.log.read(a.spark, log_read)
    if slow_values is not None:  # held: the events of other keys never reach the join
        log = log.filter(joins.in_keys(pk, slow_values))
    logged = (
        dedupe_events(log, pk)
        .join(
            joins.build_side(
                checkpoints, slow_rows, joins.records(log_read) if old_rows is not None else None
            ),
            pk,
            "inner",
        )
        .filter(
            col(_CHECKPOINT).isNull() | (F.date_trunc("millisecond", col(TS)) >= col(_CHECKPOINT))
        )
        .drop(_CHECKPOINT)
    )
    replayed = (
        old.join(joins.build_side(checkpoints, slow_rows, old_rows), pk, "inner")
        .filter(col(START) == col(_CHECKPOINT))
        .select(
            *cols([*pk, *a.data_columns]),
            F.lit("INSERT").alias(OP),
            F.lit(REPLAY_SEQ).cast("long").alias(SEQ),
            col(START).alias(TS),
        )
    )
    # Versions before a checkpoint are not refolded: they stay where they are, as they are.
    from_checkpoint = (
        old.join(joins.build_side(checkpoints, slow_rows, old_rows), pk, "left")
        .filter(col(_CHECKPOINT).isNull() | (col(START) >= col(_CHECKPOINT)))
        .drop(_CHECKPOINT)
    )
    events = logged.unionByName(replayed, allowMissingColumns=True)
    return events, log_read, checkpoints, from_checkpoint


def _read_closed(a: _Attempt, s: _Split, files: Sequence[delta.DataFile]) -> DataFrame:
    """The slow keys' rows in closed history ``files``: a filter when their values are held."""
    if s.slow_values is not None:
        return a.read_history(files, joins.in_keys(a.pk, s.slow_values))
    return a.read_history(files).join(
        joins.build_side(s.slow_keys, s.slow_count), a.pk, "left_semi"
    )


def _as_utc(t: datetime) -> datetime:
    """A Delta statistic as an aware time (delta-rs gives UTC, naive or not)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


# Below this (one second after 0001-01-01) no time bound is used: subtracting from it overflows.
_EARLIEST_CUT_US = unix_micros(datetime(1, 1, 1, 0, 0, 1, tzinfo=UTC))


def unchanged_before(earliest_late: int | None) -> datetime | None:
    """The time before which no version of a recomputed key can change.

    A late event at millisecond m refolds steps from m on; a version ending before m - 1 ms was
    closed by a step before m (a new version at its end + 1 ms, or a delete at its end) and
    every step inside it is earlier too, so it comes out as it was. Versions ending at or after
    the cut are read and compared; the closed files that end before it are not opened.
    """
    if earliest_late is None or earliest_late <= _EARLIEST_CUT_US:
        return None  # at the dawn of time (an adopted soft delete): no cut
    return from_unix_micros(earliest_late) - timedelta(milliseconds=1)


def _may_reach(f: delta.DataFile, column: str, bound: datetime | None) -> bool:
    """Whether a file may hold a ``column`` value at or after ``bound``, by its statistics: a
    closed history file a version ending then (``END``), a change-log file an event (``TS``)."""
    last = f.max_values.get(column)
    if bound is None or not isinstance(last, datetime):
        return True  # no bound, or no usable statistic: it may hold anything
    return _as_utc(last) >= bound - timedelta(milliseconds=1)  # statistics may be truncated


def _files_maybe_holding(
    files: Sequence[delta.DataFile], pk: list[str], values: list[Any] | None
) -> list[delta.DataFile]:
    """``files`` but those whose min/max statistics of the key exclude every value."""
    if values is None:
        return list(files)
    kept = []
    for f in files:
        lo, hi = f.min_values.get(pk[0]), f.max_values.get(pk[0])
        if lo is None or hi is None or type(lo) is not type(values[0]):
            kept.append(f)  # no usable bounds: it may hold any key
            continue
        i = bisect.bisect_left(values, lo)
        if i < len(values) and values[i] <= hi:
            kept.append(f)
    return kept


@contextmanager
def _cached(df: DataFrame, small: bool = False) -> Iterator[DataFrame]:
    """Keep a DataFrame that several Spark jobs reuse in memory (spilling) for the block;
    a ``small`` one (a small run's: a few keys' rows) as a local checkpoint."""
    if small:
        # Its plan is cut too: the plans built on it stay small, and Spark's driver analyses
        # and optimizes each DataFrame step (two thirds of a small hour's fold was planning).
        # Computed by the first job that needs it, kept by the executors (MEMORY_AND_DISK)
        # until the driver no longer references it: ``unpersist`` does not apply.
        yield df.localCheckpoint(eager=False)
        return
    with persisted(df) as kept:
        yield kept


def _read_history(
    spark: SparkSession,
    history: Table,
    files: Sequence[delta.DataFile],
    where: Column | None = None,
) -> DataFrame:
    """Rows of ``files`` (those ``where`` keeps, filtered before the file name is computed:
    it is worked out per row) with the (table-relative) file each came from, in ``_FILE``."""
    from pyspark.sql import functions as F

    if not files:
        empty = spark.createDataFrame([], history.spark_schema)
        return empty.withColumn(_FILE, F.lit(None).cast("string"))
    rows = history.read(spark, files, where=where)
    return rows.withColumn(_FILE, table_relative(F.input_file_name(), history.location))


def table_relative(file_url: Column, table: Location) -> Column:
    """The table-relative path (what the Delta log knows) of a file URL as Spark gives it
    (``input_file_name()``: ``file:///wh/t/data/x.parquet``, ``s3a://bucket/wh/t/data/...``)."""
    from pyspark.sql import functions as F

    path = F.url_decode(F.parse_url(file_url, F.lit("PATH")))
    return path.substr(F.lit(len(table.url_path) + 2), F.length(path))  # after "<prefix>/"


def _classify(
    touched: DataFrame,
    current: DataFrame,
    unversioned: DataFrame,
    pk: list[str],
    slow_everything: bool,
    rows: tuple[int | None, int | None] = (None, None),
    tiny: int | None = None,
) -> DataFrame:
    """Each touched key with ``_SLOW``: must it be recomputed from all its events?

    Fast means every pending event is later than anything the key received before, so its
    current row (or its delete-only record) is all the past the fold needs. A retracted key
    (``_FORCED``) is slow: its current row may stand for events that are gone. ``rows`` bounds
    the rows of ``current`` and ``unversioned`` (``lib.joins``: broadcast only when small),
    ``tiny`` those of all three when a small run read them by key (then they are shuffled).
    """
    from pyspark.sql import functions as F

    if slow_everything:
        return touched.select(
            *cols([*pk, _MIN_MS, _FORCED, _MARKED]),
            F.lit(True).alias(_SLOW),
            F.lit(False).alias(_DELETE_ONLY),
        )
    last = current.select(*cols(pk), col(LAST_EVENT_AT).alias(internal("last")))
    ghost_last = unversioned.select(*cols(pk), col(LAST_EVENT_AT).alias(internal("ghost_last")))
    joined = touched.join(joins.build_side(last, rows[0], tiny), pk, "left").join(
        joins.build_side(ghost_last, rows[1], tiny), pk, "left"
    )
    # A key with no current row and no delete-only record never had an event: fast.
    slow = col(_MIN_MS) <= F.coalesce(col(internal("last")), col(internal("ghost_last")))
    return joined.select(
        *cols([*pk, _MIN_MS, _FORCED, _MARKED]),
        (col(_FORCED) | F.coalesce(slow, F.lit(False))).alias(_SLOW),
        col(internal("ghost_last")).isNotNull().alias(_DELETE_ONLY),
    )


def _state_events(current: DataFrame, pk: list[str], data_columns: list[str]) -> DataFrame:
    """Events that replay a key's current row: the fold then continues from exactly there.

    A live row becomes an insert at its start (plus a no-op update at its last event, so the
    fold still knows when the key last changed); a deleted key's row becomes an insert at its
    start and a delete at its end (rule 5's start = end included: the delete sorts after).
    Every real pending event of a fast key is later, so these never interleave with them.
    """
    from pyspark.sql import functions as F

    def event(rows: DataFrame, op: str, at: Column, seq: int) -> DataFrame:
        image = cols(data_columns) if op != "DELETE" else []  # a delete carries only its key
        return rows.select(
            *cols(pk), *image, F.lit(op).alias(OP), F.lit(seq).cast("long").alias(SEQ), at.alias(TS)
        )

    live, dead = current.filter(col(ACTIVE)), current.filter(~col(ACTIVE))
    return (
        event(current, "INSERT", col(START), 0)
        .unionByName(
            event(live.filter(col(LAST_EVENT_AT) > col(START)), "UPDATE", col(LAST_EVENT_AT), 1)
        )
        .unionByName(event(dead, "DELETE", col(END), 1), allowMissingColumns=True)
        .unionByName(
            event(dead.filter(col(LAST_EVENT_AT) > col(END)), "DELETE", col(LAST_EVENT_AT), 2),
            allowMissingColumns=True,
        )
    )


def _ghost_events(unversioned: DataFrame, pk: list[str]) -> DataFrame:
    """A delete-only key's past, for the fold: one delete at its last event."""
    from pyspark.sql import functions as F

    return unversioned.select(
        *cols(pk),
        F.lit("DELETE").alias(OP),
        F.lit(0).cast("long").alias(SEQ),
        col(LAST_EVENT_AT).alias(TS),
    )


def _compare(
    versions: DataFrame,
    old: DataFrame,
    pk: list[str],
    data_columns: list[str],
    synced_at: datetime,
    cut: datetime | None = None,
) -> DataFrame:
    """The new versions, each with the old row at the same ``(key, start)`` if it is identical.

    ``versions`` carries ``_SLOW`` (was its key recomputed from its events?) and
    ``_CHECKPOINT`` (from which version on, see ``_slow_events``); both are dropped.
    A recomputed version ending before ``cut`` (see ``unchanged_before``) is the old one, in a
    file this run did not read unless ``old`` has it: it is left out, not written again.

    A version whose image, end and active flag are as before keeps its ``_fivetran_synced``
    (only its state columns may have moved, say after a no-op update); any other gets this
    run's. A row identical in every column may stay where it is: ``_OLD_FILE`` names its file.
    ``_OLD_ACTIVE`` feeds the run's counts.
    """
    from pyspark.sql import functions as F

    compared_columns = [*data_columns, END, ACTIVE, *STATE_COLUMNS]
    renamed = {c: internal(f"old_{i}") for i, c in enumerate(compared_columns)}
    prior = old.select(
        *cols(pk),
        START,
        *[F.expr(f"{quote(c)} AS {quote(a)}") for c, a in renamed.items()],
        col(SYNCED).alias(_OLD_SYNCED),
        col(_FILE).alias(internal("prior_file")),
    )
    joined = versions.join(prior, [*pk, START], "left")
    existed = col(internal("prior_file")).isNotNull()
    if cut is not None:
        slow = F.coalesce(col(_SLOW), F.lit(False))
        joined = joined.filter(~slow | existed | (col(END) >= timestamp_lit(cut)))
    # The fold gives no changed columns to the first version it folds of a key (it saw no
    # predecessor). For a fast key that is the replayed current row: its changed columns are
    # the stored ones. For a slow key (``_SLOW``) it is the key's first version: null, even
    # where that version was not the first before (an un-apply removed the earlier ones).
    # A slow key refolded from a checkpoint (``_slow_events``) has the same gap at the
    # checkpoint's version: that version is unchanged, its stored changed columns stand.
    from_first = col(_SLOW) & ~F.coalesce(col(START) == col(_CHECKPOINT), F.lit(False))
    joined = joined.withColumn(
        CHANGED,
        F.when(from_first, col(CHANGED)).otherwise(F.coalesce(col(CHANGED), col(renamed[CHANGED]))),
    ).drop(_SLOW, _CHECKPOINT)
    # SQL text, names quoted: one call into the JVM, where Column objects made a few a column.
    existed_sql = f"{quote(internal('prior_file'))} IS NOT NULL"
    as_before = [f"{quote(c)} <=> {quote(renamed[c])}" for c in compared_columns]
    same_version = F.expr(" AND ".join([existed_sql, *as_before[: len(data_columns) + 2]]))
    same_row = F.expr(" AND ".join([existed_sql, *as_before]))
    synced = F.when(same_version, col(_OLD_SYNCED)).otherwise(timestamp_lit(synced_at))
    return (
        joined.withColumn(SYNCED, synced)
        .withColumn(_OLD_FILE, F.when(same_row, col(internal("prior_file"))))
        .withColumn(_OLD_ACTIVE, F.when(existed, col(renamed[ACTIVE])))
        .drop(*renamed.values(), _OLD_SYNCED, internal("prior_file"))
    )


@dataclass(frozen=True)
class _Changes:
    rewritten: set[str]  # files holding an old row that is not kept as it is
    vanished: int  # active old rows with no version at their start any more
    opened: int  # versions that start where none started before
    closed: int  # versions active before and not any more
    keys: int  # keys with a version at all


def _changes(
    compared: DataFrame,
    old: DataFrame | None,
    pk: list[str],
    compared_rows: int | None = None,
    old_rows: int | None = None,
) -> _Changes:
    """What the run changes, in one Spark job: the files to rewrite (an old row not kept as it
    is) and the counts of the run's result. A vanished row was active and has no version at the
    same start any more (a late event moved the key's history). ``compared_rows`` and
    ``old_rows`` bound the rows of each side (``lib.joins``); ``old`` None: there are none
    (nothing to rewrite, nothing vanished: the versions are not shuffled to meet them)."""
    from pyspark.sql import functions as F

    of_new = compared.agg(
        F.sum(col(_OLD_ACTIVE).isNull().cast("long")).alias("opened"),
        F.sum((col(_OLD_ACTIVE) & ~col(ACTIVE)).cast("long")).alias("closed"),
        F.count_distinct(*cols(pk)).alias("keys"),
    )
    if old is not None:
        new = compared.select(
            *cols([*pk, START]),
            col(_OLD_FILE).isNotNull().alias(internal("kept")),
            F.lit(True).alias(internal("exists")),
        )
        joined = old.join(joins.build_side(new, compared_rows, old_rows), [*pk, START], "left")
        kept = F.coalesce(col(internal("kept")), F.lit(False))
        of_old = joined.agg(
            F.collect_set(F.when(~kept, col(_FILE))).alias("files"),
            F.sum((col(ACTIVE) & col(internal("exists")).isNull()).cast("long")).alias("vanished"),
        )
        of_new = of_old.unionByName(of_new, allowMissingColumns=True)
    rows = of_new.collect()  # one row per aggregate
    got = {k: v for r in rows for k, v in r.asDict().items() if v is not None}
    return _Changes(
        rewritten=set(got.get("files") or []),
        vanished=int(got.get("vanished") or 0),
        opened=int(got.get("opened") or 0),
        closed=int(got.get("closed") or 0),
        keys=int(got.get("keys") or 0),
    )


def write_segments(
    out: DataFrame,
    into: Commit,
    pk: list[str],
    expected_rows: int,
    data_change: bool = True,
) -> list[AddAction]:
    """Write rows so that each file holds one segment (live, deleted or closed), sorted by key.

    Live and deleted files split the key range. Closed files split the time range of their
    versions' ends: a late event only changes versions ending after it (``unchanged_before``),
    so it rewrites the closed files of the recent past, not one in every key range of all time.
    """
    from pyspark.sql import functions as F

    segment = (
        F.when(col(ACTIVE), F.lit("live"))
        .when(col(CURRENT), F.lit("deleted"))
        .otherwise(F.lit("closed"))
    )
    n = delta.file_count_for(expected_rows, HISTORY_ROWS_PER_FILE)
    shaped = out.withColumn(_SEGMENT, segment)
    closed_end = F.when(col(_SEGMENT) == "closed", col(END))
    shaped = (
        shaped.repartitionByRange(n, col(_SEGMENT), closed_end, *cols(pk))
        if n > 1
        else shaped.coalesce(1)
    )
    return into.write(
        shaped.sortWithinPartitions(*cols([*pk, START])),
        partition_by=_SEGMENT,
        data_change=data_change,
    )


# -- keys whose every event is a delete ---------------------------------------------------------


def _delete_only_schema(log_schema: StructType, pk: list[str]) -> StructType:
    from pyspark.sql.types import StructField, StructType, TimestampType

    return StructType([*(log_schema[c] for c in pk), StructField(LAST_EVENT_AT, TimestampType())])


def _read_delete_only_keys(
    spark: SparkSession, pk: list[str], snap: _Snapshot
) -> tuple[DataFrame, int | None]:
    """The delete-only keys as of the history table's watermark, and a bound on their rows
    (from Delta statistics; None if unknown).

    The side table is committed right after the history table, with the same watermark. If
    a crash came in between (watermarks differ), it is recomputed from the change log: every
    logged key that has no version in the history table.
    """
    from pyspark.sql import functions as F

    log_arrow = snap.changelog.arrow_schema
    keys_schema = _delete_only_schema(snap.changelog.spark_schema, pk)
    side = snap.delete_only_keys
    if not snap.delete_only_keys_stale:
        return side.read(spark, schema=keys_schema), joins.records(side.files)
    # Stale, or missing while the history table has applied events: recompute.
    assert snap.applied is not None and snap.history.exists
    logged = snap.changelog.at(snap.applied)
    # That version's files have that version's types (a widening since rewrote the log): read
    # them so, then cast the key up as the widening did.
    events = delta.arrow_cast(
        logged.read(spark).select(*cols([*pk, TS])),
        pa.schema([log_arrow.field(c) for c in [*pk, TS]]),
    )
    versioned = snap.history.read(spark).select(*cols(pk))
    unversioned = (
        events.groupBy(*cols(pk))
        .agg(F.max(F.date_trunc("millisecond", col(TS))).alias(LAST_EVENT_AT))
        .join(joins.build_side(versioned, joins.records(snap.history.files)), pk, "left_anti")
    )
    return unversioned, joins.records(logged.files)


def stamp_delete_only_keys(paths: TablePaths, log_version: int, previous: int | None) -> None:
    """Move the side table's watermark from ``previous`` to ``log_version`` without changing
    its rows (a commit with no files). A side table not at ``previous`` is stale (a crash came
    between two commits): it is left alone, so that the next run recomputes it."""
    side = Table.open(paths.delete_only_keys)
    if not side.exists:
        return  # then it is recomputed on the next run, as after a crash
    if side.watermark(APP_ID) != previous:
        return
    with side.committing() as stamp:
        stamp.commit(app_transaction=(APP_ID, log_version))


def _store_delete_only_keys(side: Table, keys: DataFrame | None, log_version: int) -> None:
    """Stamp the side table with the history table's watermark, replacing its rows if given.

    ``None`` means unchanged: only the watermark moves (a commit with no files).
    """
    if keys is not None:
        side = side.ensure(
            delta.arrow_schema_of(keys), "cdc_platform keys whose events are all deletes"
        )
    with side.committing() as store:
        removes = []
        if keys is not None:
            store.write(keys.coalesce(1))
            removes = delta.removes_for(side.files)
        store.commit(removes, app_transaction=(APP_ID, log_version))


# -- keys whose events an un-apply removed -------------------------------------------------------


def _pending_retractions(
    spark: SparkSession, snap: _Snapshot, log_version: int
) -> tuple[DataFrame | None, int | None]:
    """Retracted keys the history table has not caught up with: the removal followed change-log
    version ``v`` (committed as ``v + 1``, strictly), and the table reflects ``v`` or earlier.
    Rows with ``v`` at the log's current version belong to a removal that never committed.
    With a bound on their rows (Delta statistics of the files read; None if unknown).
    """
    side = snap.retracted_keys
    low = -1 if snap.applied is None else snap.applied
    # Each file holds the keys of one removal: one AFTER_LOG_VERSION value, in its statistics.
    files = [
        f
        for f in side.files
        if f.max_values.get(AFTER_LOG_VERSION, low) >= low
        and f.min_values.get(AFTER_LOG_VERSION, -1) < log_version
    ]
    if not files:
        return None, 0
    after = col(AFTER_LOG_VERSION)
    pending = side.read(spark, files, where=(after >= low) & (after < log_version))
    return pending.drop(AFTER_LOG_VERSION), joins.records(files)


def record_retracted_keys(
    paths: TablePaths, keys: DataFrame, after_log_version: int, applied: int | None
) -> None:
    """Add the keys an un-apply is about to take events from, before it commits the removal
    (a crash in between only costs a recomputation). Files whose keys the history table has
    caught up with (the table reflects a version past theirs) are dropped in the same commit."""
    from pyspark.sql import functions as F

    rows = keys.distinct().withColumn(AFTER_LOG_VERSION, F.lit(after_log_version).cast("long"))
    side = Table.open(paths.retracted_keys).ensure(
        delta.arrow_schema_of(rows), "cdc_platform keys an un-apply recomputes"
    )
    done = [
        f
        for f in side.files
        if applied is not None and f.max_values.get(AFTER_LOG_VERSION, applied) < applied
    ]
    with side.committing() as record:
        record.write(rows.coalesce(1))
        record.commit(delta.removes_for(done))
