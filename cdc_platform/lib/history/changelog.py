"""The change log: every valid event that ever landed, each ``(key, cdc_change_seq)`` once.

It is what makes the history table a function of the *set* of events: a late event is added
here and its key's history is recomputed from all of the key's events, wherever they landed.
It is a Delta table too (append-only), so its versions are the watermark the history table
records: "I contain every changelog file up to version N".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake.exceptions import CommitFailedError, TableNotFoundError

from cdc_platform.lib.columns import (
    CHANGELOG_SYSTEM_COLUMNS,
    INGESTED_AT,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    TS,
    col,
    cols,
    internal,
    timestamp_lit,
)
from cdc_platform.lib.history import joins
from cdc_platform.lib.ledgers.erased_keys import ErasedKeys
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.schema import normalize_type, spark_schema
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.table import Table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SYSTEM = set(CHANGELOG_SYSTEM_COLUMNS)
# Events per change-log file of a big append (a backfill): a quarter of a full-size file, so a
# late key's refold reads the recent files only.
LOG_ROWS_PER_FILE = delta.ROWS_PER_FILE // 4
_RN = internal("rn")
# The forgotten-events ledger ties each row to the removal that forgot it: the change-log
# version the removal decided on (it commits strictly as the next one) and a token that commit
# carries in its commit info. A row counts only once that commit happened (``removal_committed``).
AFTER_LOG_VERSION = "_cdc_after_log_version"
REMOVAL = "_cdc_removal"
REMOVAL_KEY = "cdc_platform.removal"
_COMMITTED: set[tuple[str, int, str]] = set()  # removals seen committed (they stay committed)


@dataclass(frozen=True)
class Fence:
    """The change-log version an operator decided on (None: no change log yet). An append
    fenced on it commits only on exactly that version, in one attempt: if the log moved since
    the decision it raises ``CommitFailedError``, so the caller's retry decides again from a
    fresh read (``delta.with_commit_retries``) and no event logged meanwhile goes unseen."""

    version: int | None


@dataclass(frozen=True)
class AppendResult:
    new_events: int
    version: int | None


def key_and_data_fields(log: Table) -> pa.Schema | None:
    """The change log's key and data columns so far (None before its first event)."""
    return key_and_data_of(log.arrow_schema) if log.exists else None


def key_and_data_of(log_schema: pa.Schema) -> pa.Schema:
    """The key and data columns of a change-log schema (its system columns left out)."""
    return pa.schema(
        [pa.field(f.name, normalize_type(f.type)) for f in log_schema if f.name not in SYSTEM]
    )


@dataclass(frozen=True)
class Batch:
    """The events an append logs and what is known of them: the table's key, the range of
    their ``cdc_change_seq`` (only change-log files overlapping it can hold one of them), the
    rows read (which size the files written) and the time they are logged."""

    events: DataFrame
    key: Sequence[str]
    seq_range: tuple[int, int]
    rows: int
    ingested_at: datetime


@dataclass(frozen=True)
class Guards:
    """What keeps events out of the change log, or an append from committing.

    ``revoked`` gives the landing files un-applied so far, ``erased`` the keys a data
    subject's request erased (``ledgers.erased_keys``): both are asked again on every commit
    attempt, so a file revoked or a key erased while the append raced them is never logged.
    ``forgotten`` is the ledger of events a hard truncate or a re-sync removed (``forget``):
    a materialization passes it, so those ``(key, seq)`` are never logged again when an hour
    is read again; an operation a user runs (truncate, adopt, re-sync) logs what it is asked.
    ``fence``: commit only on the version an operator decided on (``Fence``), in one attempt.
    ``before_commit`` runs once the events were read and written, before the commit: if it
    raises (the files Spark read by path changed meanwhile, ``native.NativeGuard``), what was
    written is discarded and nothing is committed.
    """

    revoked: Callable[[], set[str]] | None = None
    forgotten: Where | None = None
    erased: Callable[[], ErasedKeys | None] | None = None
    fence: Fence | None = None
    before_commit: Callable[[], None] | None = None


def append(
    spark: SparkSession,
    path: Where,
    batch: Batch,
    guards: Guards | None = None,
    properties: Mapping[str, str] | None = None,
) -> AppendResult:
    """Add the batch's events not already logged; one Spark job, one Delta commit (or none).

    Each commit attempt reads the guards and the change log afresh (``Guards``).
    ``properties``: what a change log this append creates records (``protected_columns``).
    """
    g = guards or Guards()
    events = batch.events.transform(stamped, batch.ingested_at)
    schema = delta.arrow_schema_of(events)

    def attempt() -> AppendResult:
        log = _opened(spark, path, schema, properties, g.fence)
        # Revoked files go before the duplicates are resolved, so that a kept file's copy of
        # an event a revoked file also delivered is the one logged.
        new = (
            events.transform(without_files, g.revoked() if g.revoked is not None else set())
            .transform(first_copies, batch.key)
            .transform(without_events, _logged(spark, log, batch))
            .transform(without_events, _forgotten(spark, path, g.forgotten, batch))
            .transform(in_schema, log.arrow_schema)
            .transform(without_erased, g.erased() if g.erased is not None else None, batch.key)
            .transform(into_files, batch.rows, batch.key)
        )
        return _commit(log, new, g.before_commit)

    if g.fence is not None:
        return attempt()
    return delta.with_commit_retries(attempt, f"change log append to {path}")[0]


def stamped(events: DataFrame, ingested_at: datetime) -> DataFrame:
    """``events`` with the time they are logged (``_cdc_ingested_at``): the fold's first tie
    break between copies of one ``(key, seq)`` (``versions.dedupe_events``)."""
    return events.withColumn(INGESTED_AT, timestamp_lit(ingested_at))


def without_files(events: DataFrame, names: set[str]) -> DataFrame:
    """``events`` without those of the landing files ``names`` (the revoked ones)."""
    return events.filter(~col(SOURCE_FILE).isin(sorted(names))) if names else events


def first_copies(events: DataFrame, key: Sequence[str]) -> DataFrame:
    """Each ``(key, cdc_change_seq)`` of a batch once: the copy of the first file, by name,
    and its first row (docs/HISTORY_MODE.md section 3: each seq counts once, the same copy on
    every re-read)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(*cols(list(key)), col(SEQ)).orderBy(col(SOURCE_FILE), col(SOURCE_ROW))
    return events.withColumn(_RN, F.row_number().over(w)).filter(col(_RN) == 1).drop(_RN)


def without_events(events: DataFrame, gone: DataFrame | None) -> DataFrame:
    """``events`` without those ``gone`` names by its columns (a key and ``cdc_change_seq``):
    the events logged already, or forgotten. A column of ``gone`` the events lack (a key
    column of the forgotten-events ledger this batch's files do not have) is null in each."""
    if gone is None:
        return events
    from pyspark.sql import functions as F

    have = set(events.columns)
    absent = {c: F.lit(None).cast(gone.schema[c].dataType) for c in gone.columns if c not in have}
    if not absent:
        return events.join(gone, gone.columns, "left_anti")
    return events.withColumns(absent).join(gone, gone.columns, "left_anti").drop(*absent)


def in_schema(events: DataFrame, schema: pa.Schema) -> DataFrame:
    """``events`` as the change log's columns and types: a column missing is null, and one the
    table widened after this batch was read (a concurrent append) is cast up, as the widening
    cast the rows already there (``delta.arrow_cast``)."""
    from pyspark.sql import functions as F

    known = set(events.columns)
    return delta.arrow_cast(
        events.select(
            *[
                col(f.name) if f.name in known else F.lit(None).cast(f.dataType).alias(f.name)
                for f in spark_schema(schema).fields
            ]
        ),
        schema,
    )


def without_erased(events: DataFrame, erasures: ErasedKeys | None, key: Sequence[str]) -> DataFrame:
    """``events`` without the erased keys' (hashed in the table's types, as the erasure hashed
    them: so after ``in_schema``)."""
    return events if erasures is None else erasures.drop(events, key)


def into_files(events: DataFrame, rows: int, key: Sequence[str]) -> DataFrame:
    """``events`` in the partitions of the files to write: a big append (a backfill) is split
    by commit time, so that a late key, refolded from its recent past (``merge.gather``),
    skips the files of earlier times."""
    n = delta.file_count_for(rows, LOG_ROWS_PER_FILE)
    return events.repartitionByRange(n, col(TS), *cols(list(key))) if n > 1 else events.coalesce(1)


def _opened(
    spark: SparkSession,
    path: Where,
    schema: pa.Schema,
    properties: Mapping[str, str] | None,
    fence: Fence | None,
) -> Table:
    """The change log, created or widened for ``schema``, at the fence's version if fenced."""
    log = Table.open(path).ensure(schema, "cdc_platform change log", properties)
    log = log.widened(spark, schema)  # a column the batch widened
    if fence is not None and log.version != fence.version:
        # Moved since the decision (or this batch changed its schema: a commit of its own,
        # after which the caller decides again on the new version).
        raise CommitFailedError(
            f"{path}: the change log is at version {log.version}, not {fence.version} "
            "as when the operation decided"
        )
    return log


def _logged(spark: SparkSession, log: Table, batch: Batch) -> DataFrame | None:
    """The ``(key, seq)`` logged already that the batch may repeat: only files whose seq range
    overlaps the batch's can hold one (None: no file does)."""
    candidates = _overlapping(log.files, *batch.seq_range)
    if not candidates:
        return None
    logged = log.read(spark, candidates).select(*cols([*batch.key, SEQ]))
    # Broadcast only when the statistics say few rows (``lib.history.joins``): re-reading a
    # bulk hour checks its events against millions logged.
    return joins.build_side(logged, joins.records(candidates))


def _forgotten(
    spark: SparkSession, path: Where, ledger_path: Where | None, batch: Batch
) -> DataFrame | None:
    """The forgotten ``(ledger key, seq)`` the batch may repeat, from the ledger's files of an
    overlapping seq range whose removal committed (None: no such file, or no ledger)."""
    if ledger_path is None:
        return None
    ledger = Table.open(ledger_path)
    files = [f for f in _overlapping(ledger.files, *batch.seq_range) if removal_committed(path, f)]
    if not files:
        return None
    forgot = ledger.read(spark, files).select(*cols([*ledger_key(ledger, batch.key), SEQ]))
    return joins.build_side(forgot, joins.records(files))


def _commit(log: Table, new: DataFrame, before_commit: Callable[[], None] | None) -> AppendResult:
    """Write ``new`` and commit it strictly: if another writer logged events meanwhile, the
    retry dedupes against them again."""
    with log.committing() as append:
        adds = append.write(new)
        if before_commit is not None:
            before_commit()
        if not adds:
            return AppendResult(0, log.version)
        count = sum(delta.num_records(a) for a in adds)
        version = append.commit(metadata={"cdc_platform.new_events": count}, strict=True)
    return AppendResult(count, version)


def _overlapping(files: Sequence[delta.DataFile], lo: int, hi: int) -> list[delta.DataFile]:
    """The files whose ``cdc_change_seq`` statistics overlap ``[lo, hi]`` (or are unknown)."""
    return [
        f
        for f in files
        if f.min_values.get(SEQ) is None or not (f.min_values[SEQ] > hi or f.max_values[SEQ] < lo)
    ]


def forget(
    path: Where,
    events: DataFrame,
    primary_key: Sequence[str],
    after_log_version: int | None = None,
    removal: str | None = None,
) -> None:
    """Add ``events``' ``(key, cdc_change_seq)`` to the ledger at ``path``: no materialization
    logs them again (a hard truncate or a re-sync removed them; an hour read again, say for a
    late file, must not bring them back). One commit, written before the change log loses them
    (a crash in between leaves no removed event unforgotten), tied to that removal: the
    change-log version it decided on and its token (``removal_committed``), so the rows of a
    removal that lost its race, and was decided again, never count."""
    from pyspark.sql import functions as F

    ledger = Table.open(path)
    rows = events.select(*cols([*ledger_key(ledger, primary_key), SEQ])).distinct()
    if removal is not None:
        rows = rows.withColumns(
            {
                AFTER_LOG_VERSION: F.lit(after_log_version).cast("long"),
                REMOVAL: F.lit(removal).cast("string"),
            }
        )
    schema = delta.arrow_schema_of(rows)
    ledger = ledger.ensure(schema, "cdc_platform events removed for good")
    ledger = ledger.widened(rows.sparkSession, schema)
    with ledger.committing() as add:
        add.write(rows.repartitionByRange(1, col(SEQ)))
        add.commit()


def ledger_key(ledger: Table, primary_key: Sequence[str]) -> list[str]:
    """The key columns of the forgotten-events ledger: the table's key when the ledger was
    created. A ``rekey_table`` run leaves the ledger as it is: each column of the old key is
    still a column of every event (a key column, or data), so the rows still name the events
    they forgot, under any later key (``rekey`` refuses the one case where not)."""
    if not ledger.exists:
        return list(primary_key)
    return [n for n in ledger.arrow_schema.names if n not in (SEQ, AFTER_LOG_VERSION, REMOVAL)]


def unforget(path: Where, removal: str) -> None:
    """Drop the ledger rows of a removal whose commit lost its race (it decides again)."""
    ledger = Table.open(path)
    if ledger.dt is not None:
        ledger.dt.delete(delta.in_predicate(REMOVAL, [removal]))


def removal_committed(log: Where, ledger_file: delta.DataFile) -> bool:
    """Whether the removal that wrote ``ledger_file`` of the forgotten-events ledger committed
    its change-log rewrite: the commit after the version it decided on carries its token. Rows
    written before removals were tied to their commit (no token) count, as before."""
    token = ledger_file.min_values.get(REMOVAL)
    after = ledger_file.min_values.get(AFTER_LOG_VERSION)
    if not isinstance(token, str) or ledger_file.max_values.get(REMOVAL) != token:
        return True
    if not isinstance(after, int):
        return True
    loc = Location.of(log)
    key = (loc.uri, after + 1, token)
    if key in _COMMITTED:
        return True
    try:
        with loc.filesystem().open_input_stream(f"_delta_log/{after + 1:020d}.json") as fh:
            lines = fh.read().decode().splitlines()
    except OSError:  # not committed yet, or its log entry expired long after it committed
        current = delta.version_or_none(loc)
        return current is not None and after + 1 <= current
    for line in lines:
        info = json.loads(line).get("commitInfo") if line.strip() else None
        if info is not None:
            if info.get(REMOVAL_KEY) == token:
                _COMMITTED.add(key)
                return True
            return False
    return False


def files_since(log: Table, applied_version: int | None) -> list[delta.DataFile]:
    """Files of the snapshot ``log`` that were added after ``applied_version`` (all if None)."""
    if applied_version is None:
        return log.files
    if log.version is None or applied_version >= log.version:
        return []
    try:
        before = log.at(applied_version)
    except TableNotFoundError:  # "no files in log segment": that version's log was cleaned up
        return log.files  # so recompute every key; any other error is raised
    seen = {f.path for f in before.files}
    return [f for f in log.files if f.path not in seen]
