"""Changing a table's key: ``rekey_table`` (docs/HISTORY_MODE.md, "Changing the key").

The change log holds every event that ever landed, so the history under another key is the
fold of the same events under it: rules 1-7 per new key, as a table configured so from its
first file would have. The run goes in four steps, each a commit:

1. the history table records the new key and a rekey under way (properties only): from here
   until step 4 every run, materialization or operator job is refused (``table_key.check_key``),
   so nothing folds events under either key in between;
2. a switch between keyed and keyless rewrites the change log with (or without) each event's
   ``_fivetran_id``, computed as the reader computes it for a new file (``landing.rows.row_id``);
3. the history is replaced by the fold under the new key: one strict overwrite commit with its
   new schema and the change-log version it reflects. The old rows stay readable by time
   travel, at the version the table records (``Rekey.from_version``);
4. the delete-only and retracted-keys side tables follow, and the table records the rekey done.

A crash anywhere leaves the table refused until ``rekey_table`` runs again, which starts again
from step 2 (each step is idempotent). A version that was already in the table, or in the table
as it was before the last rekey (a rekey back), keeps its ``_fivetran_synced``: a rekey and its
way back give the identical table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake.exceptions import TableNotFoundError

from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGELOG_SYSTEM_COLUMNS,
    END,
    LAST_EVENT_AT,
    ROW_ID,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    START,
    SYNCED,
    TS,
    UNMODIFIED,
    col,
    cols,
    comparable_sql,
    from_unix_micros,
    internal,
    map_columns,
    quote,
    timestamp_lit,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge.columns import AFTER_LOG_VERSION, APP_ID, SYSTEM_COLUMNS
from cdc_platform.lib.history.merge.snapshot import history_properties, history_schema
from cdc_platform.lib.history.merge.write import write_segments
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.table_key import (
    REKEY_JOB,
    REKEY_PROPERTY,
    Rekey,
    named,
    recorded_key,
    recorded_rekey,
    same_key,
)
from cdc_platform.lib.history.versions import build_versions
from cdc_platform.lib.landing.rows.row_id import row_ids
from cdc_platform.lib.ledgers import erased_keys
from cdc_platform.lib.operations.operation import Request, hour_start
from cdc_platform.lib.spark.session import persisted
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pyspark.sql import DataFrame, SparkSession

_OLD, _NEW, _N = internal("old_key"), internal("new_key"), internal("n")
_PRIOR_SYNCED = internal("prior_synced")
_KEPT = internal("synced_kept")


class RekeyError(Refusal):
    """The table cannot be rebuilt under the config's key as it is; nothing was written."""


@dataclass(frozen=True)
class KeyCounts:
    """How the change log's events regroup under the new key."""

    events: int
    keys_before: int
    keys_after: int
    merged: int  # new keys holding the events of more than one old key
    split: int  # old keys whose events went to more than one new key
    counted_once: int  # events sharing their new key and seq with another (rule 2)
    last_event_at: datetime | None


@dataclass(frozen=True)
class RekeyRequest(Request):
    """A rekey asks nothing but its time: the key is the config's."""


@dataclass(frozen=True)
class RekeyResult:
    old_key: tuple[str, ...]
    new_key: tuple[str, ...]
    changed: bool  # False: the table already follows the config's key
    counts: KeyCounts | None = None
    versions: int = 0
    synced_kept: int = 0  # versions that kept their _fivetran_synced
    changelog_rewritten: bool = False
    from_version: int | None = None  # the history version holding the old key's rows
    history_version: int | None = None
    last_event_at: datetime | None = None

    def summary(self) -> str:
        c = self.counts
        if not self.changed or c is None:
            return (
                f"the table is already folded under {named(self.new_key)} (or has no history "
                "yet): nothing to do"
            )
        return (
            f"history rebuilt under {named(self.new_key)} (was {named(self.old_key)}): "
            f"{c.keys_before} key(s) became {c.keys_after}, {c.merged} merged and {c.split} "
            f"split; {self.versions} version(s); the old rows are version {self.from_version}"
        )

    def metadata(self) -> dict[str, Any]:
        c = self.counts or KeyCounts(0, 0, 0, 0, 0, 0, None)
        return {
            "operation": REKEY_JOB,
            "old_key": named(self.old_key),
            "new_key": named(self.new_key),
            "events": c.events,
            "keys_before": c.keys_before,
            "keys_after": c.keys_after,
            "keys_merged": c.merged,
            "keys_split": c.split,
            "events_counted_once": c.counted_once,
            "versions": self.versions,
            "versions_synced_kept": self.synced_kept,
            "changelog_rewritten": self.changelog_rewritten,
            "old_rows_at_version": self.from_version,
            "delta_version": self.history_version,
        }

    @property
    def hours(self) -> tuple[datetime, ...]:
        """The hour of the table's last event: the rebuild concerns its whole history."""
        return (hour_start(self.last_event_at),) if self.last_event_at else ()


def rekey(t: HistoryTable, request: RekeyRequest) -> RekeyResult:
    """Rebuild the table's history under the key its config names, from the change log. Every
    refusal comes before the first commit (a rekey under way stays so until a run completes)."""
    table, paths, history = t.config, t.paths, t.history
    new = tuple(table.key)
    state = recorded_rekey(history)
    old = recorded_key(history)
    if not history.exists or old is None:
        if history.exists:
            raise RekeyError(
                f"{paths.history}: the table does not record its key yet (it predates the"
                " property): materialize it once under its current key, then rekey it"
            )
        return RekeyResult(new, new, changed=False)
    pending = state is not None and state.pending
    if same_key(old, new) and not pending:
        return RekeyResult(tuple(old), new, changed=False)
    assert history.version is not None
    from_version = history.version
    if state is not None and pending:
        if state.job != REKEY_JOB:
            raise RekeyError(
                f"{paths.history}: a {state.job} run did not finish; launch {state.job} for the"
                " table again before changing its key. Nothing was written."
            )
        old, from_version = list(state.from_key), state.from_version
    _refuse(t, old, from_version, history.version)
    state = Rekey(from_version, pending, tuple(old))
    return rebuild_table(t, state, request.now, partial(_keyed_log, t.spark, table))


def rebuild_table(
    t: HistoryTable, state: Rekey, synced_at: datetime, rewrite_log: Callable[[Table], Table]
) -> RekeyResult:
    """Steps 1 to 4 (the module docstring), ``rewrite_log`` being step 2: the history rebuilt
    under ``table``'s key from the change log as ``rewrite_log`` leaves it (it returns the log
    as it is when there is nothing to rewrite, as after a crash that came later). ``state``
    pending: step 1 was done by a run that did not finish. Also ``protect_columns``' rebuild."""
    table, paths = t.config, t.paths
    if not state.pending:
        _mark(t.refresh().history, table, replace(state, pending=True))
    result, _ = delta.with_commit_retries(
        lambda: _rebuild(t, state, synced_at, rewrite_log),
        f"rebuild of {paths.history}",
    )
    _mark(t.refresh().history, table, replace(state, pending=False))
    t.refresh()
    return result


def _keyed_log(spark: SparkSession, table: TableConfig, log: Table) -> Table:
    """Step 2 of a rekey: the change log with each event's ``_fivetran_id`` (a table becoming
    keyless) or without it (becoming keyed); as it is when it already is so."""
    if table.keyless == (ROW_ID in log.arrow_schema.names):
        return log
    events = log.read(spark)
    if table.keyless:
        events = with_row_ids(events, log.arrow_schema)
    names = [n for n in events.columns if table.keyless or n != ROW_ID]
    fields = {f.name: f for f in log.arrow_schema}
    schema = pa.schema([fields.get(n, pa.field(ROW_ID, pa.string())) for n in names])
    return rewrite_changelog(
        log, events, schema, table.key, {"cdc_platform.rekeyed_to": list(table.key)}
    )


def _refuse(t: HistoryTable, old: Sequence[str], from_version: int, latest: int) -> None:
    """Everything that stops a rekey, checked before its first commit: a table property that
    does not hold together, a history-column list naming no column, a ledger the new key cannot
    keep, and events the new key cannot take (``_refuse_events``)."""
    paths, log, table = t.paths, t.changelog, t.config
    if not log.exists:
        raise RekeyError(f"{paths.changelog}: the table has no change log to rebuild from")
    names = set(log.arrow_schema.names) | {ROW_ID}  # a keyless log's ids may be computed
    if not 0 <= from_version <= latest or not set(old) <= names:
        raise RekeyError(
            f"{paths.history}: the table property {REKEY_PROPERTY} names a version or key the"
            " table does not have; it was not written by cdc_platform. Nothing was written."
        )
    check_history_columns(paths, log, table)
    _refuse_forgotten_ledger(t, old)
    refuse_erased_keys(paths, RekeyError, "a rekey")
    _refuse_events(log, log.read(t.spark), table)


def refuse_erased_keys(paths: TablePaths, error: type[Exception], what: str) -> None:
    """Erased keys are recorded by the hash of their key (``ledgers.erased_keys``), whose values
    are gone: a change of the key, or of a keyless table's ids, would let them be logged again."""
    if erased_keys.recorded(paths.erased_keys):
        raise error(
            f"{paths.erased_keys}: keys of this table were erased, and are recognised by the hash"
            f" of their key as it is now; {what} would change it and let them back. Nothing was"
            " written."
        )


def check_history_columns(
    paths: TablePaths, log: Table, table: TableConfig, dropped: Sequence[str] = ()
) -> None:
    """Refuse a history-column list naming a column the rebuilt table will not have (the log's
    data columns but ``dropped``): the rebuild would record it."""
    data = [
        n
        for n in changelog.key_and_data_of(log.arrow_schema).names
        if n not in table.key and n != ROW_ID and n not in dropped
    ]
    unknown = table.history_columns.unknown(data)
    if unknown:
        raise RekeyError(
            f"{paths.history}: the config's track_history_columns / ignore_history_columns name"
            f" {unknown}, which the table does not have. Nothing was written."
        )


def _mark(history: Table, table: TableConfig, state: Rekey) -> None:
    """Record the new key, the selective-history setting the rebuild follows and the rekey's
    state on the history table: a strict metadata commit."""
    history.set_properties(
        {**history_properties(table.key, table.history_columns), REKEY_PROPERTY: state.to_json()}
    )


def _refuse_forgotten_ledger(t: HistoryTable, old: Sequence[str]) -> None:
    """The forgotten-events ledger names events by the key it was created with
    (``changelog.ledger_key``); after a rekey each of its columns must still be a column of
    every event, which fails only for a keyless table becoming keyed (its ``_fivetran_id``
    goes) while the ledger holds rows (an empty one takes the new key: ``_reset_empty_ledger``)."""
    paths, ledger = t.paths, t.table(t.paths.forgotten_events)
    if not ledger.files or t.config.keyless:
        return
    if ROW_ID in changelog.ledger_key(ledger, old):
        raise RekeyError(
            f"{paths.forgotten_events}: a hard truncate or a re-sync removed events of this"
            " keyless table for good, and the ledger that keeps them from being logged again"
            f" names them by {ROW_ID}, which a keyed table's events do not have. Nothing was"
            " written: a keyless table with forgotten events cannot be given a key."
        )


def _reset_empty_ledger(t: HistoryTable, log_schema: pa.Schema, key: Sequence[str]) -> None:
    """An empty forgotten-events ledger (its rows all dropped again, ``changelog.unforget``)
    takes the new key's columns: its old ones may not be columns of the events any more."""
    ledger = t.fresh(t.paths.forgotten_events)
    if not ledger.exists or ledger.files:
        return
    have = ledger.arrow_schema
    system = [f for f in have if f.name in (SEQ, changelog.AFTER_LOG_VERSION, changelog.REMOVAL)]
    schema = pa.schema([*(log_schema.field(k) for k in key), *system])
    if schema.names != have.names:
        with ledger.committing() as empty:
            empty.commit(schema=schema, strict=True, overwrite=True)


def _rebuild(
    t: HistoryTable, state: Rekey, synced_at: datetime, rewrite_log: Callable[[Table], Table]
) -> RekeyResult:
    """Steps 2 to 4, decided on the change log as it now is. Each step is idempotent: after a
    crash, a run finds the change log already rewritten, say."""
    spark, table = t.spark, t.config
    new, old, from_version = tuple(table.key), state.from_key, state.from_version
    before = t.fresh(t.paths.changelog)
    log = rewrite_log(before)
    rewritten = log.version != before.version
    events = log.read(spark)
    # A keyless table's old key is each event's id: computed again once a rewrite dropped it.
    if ROW_ID in old and ROW_ID not in events.columns:
        counts = _key_counts(with_row_ids(events, log.arrow_schema), old, new)
    else:
        counts = _key_counts(events, old, new)
    log_version = log.version
    assert log_version is not None
    schema = history_schema(new, changelog.key_and_data_of(log.arrow_schema))
    data = [f.name for f in schema if f.name not in new and f.name not in SYSTEM_COLUMNS]
    versions = build_versions(
        events, new, data, history_columns=table.history_columns, with_state=True
    )
    history = t.fresh(t.paths.history)
    compared = [*new, START, *data, END, ACTIVE]
    priors = _priors(spark, history, from_version, schema, compared)
    with persisted(_with_synced(versions, priors, compared, synced_at)) as out:
        rows, kept = _count_kept(out)
        with history.committing() as rebuilt:
            write_segments(out.select(*cols(schema.names)), rebuilt, list(new), rows)
            version = rebuilt.commit(
                schema=schema,
                app_transaction=(APP_ID, log_version),
                metadata={
                    "cdc_platform.rebuilt_from_key": list(old),
                    "cdc_platform.rebuilt_under_key": list(new),
                    "cdc_platform.keys_merged": counts.merged,
                    "cdc_platform.keys_split": counts.split,
                },
                strict=True,
                overwrite=True,
            )
        _replace_side_tables(t, events, out, list(new), log_version)
    _reset_empty_ledger(t, log.arrow_schema, new)
    return RekeyResult(
        old_key=old,
        new_key=new,
        changed=True,
        counts=counts,
        versions=rows,
        synced_kept=kept,
        changelog_rewritten=rewritten,
        from_version=from_version,
        history_version=version,
        last_event_at=counts.last_event_at,
    )


def _refuse_events(log: Table, events: DataFrame, table: TableConfig) -> None:
    """Events the new key cannot take, named by their file and row (never a value): for a
    keyed table, a key cell that is null or a key column the log lacks; for a keyless one, an
    event marking cells unmodified (its id would be of a partial image)."""
    from pyspark.sql import functions as F

    if table.keyless:
        if UNMODIFIED not in log.arrow_schema.names:
            return
        bad = F.coalesce(F.size(col(UNMODIFIED)) > 0, F.lit(False))
        why = "marks cells unmodified, which a keyless table cannot take (its id is its image)"
    else:
        missing = [k for k in table.key if k not in log.arrow_schema.names]
        if missing:
            raise RekeyError(
                f"{log}: the new key's column(s) {missing} are in no event of the change log."
                " Nothing was written."
            )
        bad = F.lit(False)
        for k in table.key:
            bad = bad | col(k).isNull()
        why = "has no value in a column of the new key"
    found = events.agg(
        F.sum(bad.cast("long")).alias("n"),
        F.min(F.when(bad, F.struct(col(SOURCE_FILE), col(SOURCE_ROW)))).alias("first"),
    ).collect()[0]
    if found["n"]:
        first = found["first"]
        raise RekeyError(
            f"{log}: {found['n']} logged event(s) cannot be keyed by {list(table.key)}: the"
            f" first, row {first[1]} of {first[0]}, {why}. Nothing was written."
        )


def with_row_ids(events: DataFrame, log_schema: pa.Schema) -> DataFrame:
    """The events with their ``_fivetran_id`` first, computed from their data cells as the
    reader computes a new file's (``LandingReader.read_conformed``), in a Spark task."""
    from pyspark.sql.pandas.types import from_arrow_schema

    data = [f.name for f in log_schema if f.name not in CHANGELOG_SYSTEM_COLUMNS]
    out = pa.schema([pa.field(ROW_ID, pa.string()), *log_schema])

    def with_ids(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            ids = row_ids({n: batch.column(n) for n in data}, batch.num_rows)
            yield pa.RecordBatch.from_arrays([ids, *batch.columns], schema=out)

    return events.select(*cols(log_schema.names)).mapInArrow(with_ids, from_arrow_schema(out))


def _key_counts(events: DataFrame, old: Sequence[str], new: Sequence[str]) -> KeyCounts:
    """How the events regroup: (old key, new key) pairs, counted from each side."""
    from pyspark.sql import functions as F

    pairs = events.select(
        F.struct(*cols(list(old))).alias(_OLD), F.struct(*cols(list(new))).alias(_NEW)
    ).distinct()
    ones = F.count(F.lit(1)).alias(_N)
    before = pairs.groupBy(_OLD).agg(ones).agg(F.count(F.lit(1)), F.sum((col(_N) > 1).cast("long")))
    after = pairs.groupBy(_NEW).agg(ones).agg(F.count(F.lit(1)), F.sum((col(_N) > 1).cast("long")))
    shared = events.groupBy(*cols([*new, SEQ])).agg(ones).agg(F.sum(col(_N) - 1))
    at = events.agg(F.count(F.lit(1)), F.max(F.unix_micros(col(TS))))
    (keys_before, split), (keys_after, merged) = _one(before), _one(after)
    (counted_once,), (n, last) = _one(shared), _one(at)
    return KeyCounts(
        events=int(n),
        keys_before=int(keys_before),
        keys_after=int(keys_after),
        merged=int(merged or 0),
        split=int(split or 0),
        counted_once=int(counted_once or 0),
        last_event_at=None if last is None else from_unix_micros(last),
    )


def _one(aggregate: DataFrame) -> tuple:
    """The one row of a global aggregate."""
    row = aggregate.first()
    assert row is not None
    return tuple(row)


def rewrite_changelog(
    log: Table,
    events: DataFrame,
    schema: pa.Schema,
    key: Sequence[str],
    metadata: dict[str, object],
) -> Table:
    """The change log replaced by ``events`` as ``schema``: one strict overwrite commit (the
    table's properties kept), laid out as an append lays it out."""
    rows = sum(f.num_records or 0 for f in log.files)
    n = delta.file_count_for(rows, changelog.LOG_ROWS_PER_FILE)
    shaped = events.select(*cols(schema.names))
    shaped = (
        shaped.repartitionByRange(n, col(TS), *cols(list(key))) if n > 1 else shaped.coalesce(1)
    )
    with log.committing() as rewrite:
        rewrite.write(delta.arrow_cast(shaped, schema))
        rewrite.commit(schema=schema, metadata=metadata, strict=True, overwrite=True)
    return log.reopened()


def _priors(
    spark: SparkSession,
    history: Table,
    from_version: int,
    schema: pa.Schema,
    compared: Sequence[str],
) -> list[DataFrame]:
    """The rows whose ``_fivetran_synced`` a rebuilt version may keep: the table's now, before
    this rekey, and before the rekey before it (a rekey back finds its own versions there), each
    when it holds every compared column in the new types and its files are still stored (not
    vacuumed)."""
    wanted = [schema.field(c) for c in [*compared, SYNCED]]
    before = _at(history, from_version)
    earlier = recorded_rekey(before) if before is not None else None
    snapshots: dict[int | None, Table | None] = {
        t.version: t for t in (history, before) if t is not None
    }
    if earlier is not None and earlier.from_version not in snapshots:
        snapshots[earlier.from_version] = _at(history, earlier.from_version)
    found = []
    for t in snapshots.values():
        if t is None:
            continue
        have = {f.name: f.type for f in t.arrow_schema}
        if all(have.get(f.name) == f.type for f in wanted) and t.stored():
            found.append(t.read(spark).select(*cols([f.name for f in wanted])))
    return found


def _at(history: Table, version: int) -> Table | None:
    """The table at ``version``; None once its log entries were cleaned up."""
    try:
        return history.at(version)
    except (TableNotFoundError, OSError):
        return None


def _with_synced(
    versions: DataFrame, priors: Sequence[DataFrame], compared: Sequence[str], at: datetime
) -> DataFrame:
    """Each version's ``_fivetran_synced``: that of a prior row equal to it in every compared
    column (``<=>``, a map by its sorted entries; the earliest such), else ``at``; ``_KEPT``
    says which."""
    from pyspark.sql import functions as F

    if not priors:
        return versions.withColumns({SYNCED: timestamp_lit(at), _KEPT: F.lit(False)})
    renamed = {c: internal(f"prior_{i}") for i, c in enumerate(compared)}
    maps = map_columns(versions.schema)
    union = priors[0]
    for p in priors[1:]:
        union = union.unionByName(p)
    canonical = [F.expr(comparable_sql(quote(c), c in maps)).alias(r) for c, r in renamed.items()]
    prior = union.groupBy(*canonical).agg(F.min(col(SYNCED)).alias(_PRIOR_SYNCED))
    same = F.expr(
        " AND ".join(
            f"{comparable_sql(quote(c), c in maps)} <=> {quote(r)}" for c, r in renamed.items()
        )
    )
    joined = versions.join(prior, same, "left")
    return joined.withColumns(
        {
            SYNCED: F.coalesce(col(_PRIOR_SYNCED), timestamp_lit(at)),
            _KEPT: col(_PRIOR_SYNCED).isNotNull(),
        }
    ).drop(*renamed.values(), _PRIOR_SYNCED)


def _count_kept(out: DataFrame) -> tuple[int, int]:
    from pyspark.sql import functions as F

    rows, kept = _one(out.agg(F.count(F.lit(1)), F.sum(col(_KEPT).cast("long"))))
    return int(rows), int(kept or 0)


def _replace_side_tables(
    t: HistoryTable, events: DataFrame, versions: DataFrame, key: list[str], log_version: int
) -> None:
    """The delete-only keys under the new key (those whose events made no version), at the
    change-log version the history now reflects; no retracted key is left to recompute (the
    whole table was). Each in one overwrite commit with its new schema."""
    from pyspark.sql import functions as F

    last = events.groupBy(*cols(key)).agg(
        F.max(F.date_trunc("millisecond", col(TS))).alias(LAST_EVENT_AT)
    )
    unversioned = last.join(versions.select(*cols(key)).distinct(), key, "left_anti")
    _overwrite(t.fresh(t.paths.delete_only_keys), unversioned, (APP_ID, log_version))
    retracted = t.fresh(t.paths.retracted_keys)
    if retracted.exists:
        fields = [
            *delta.arrow_schema_of(last.select(*cols(key))),
            pa.field(AFTER_LOG_VERSION, pa.int64()),
        ]
        with retracted.committing() as empty:
            empty.commit(schema=pa.schema(fields), strict=True, overwrite=True)


def _overwrite(side: Table, rows: DataFrame, app: tuple[str, int]) -> None:
    schema = delta.arrow_schema_of(rows)
    if not side.exists:
        side = side.ensure(schema, "cdc_platform keys whose events are all deletes")
    with side.committing() as store:
        store.write(delta.arrow_cast(rows, schema).coalesce(1))
        store.commit(schema=schema, app_transaction=app, strict=True, overwrite=True)
