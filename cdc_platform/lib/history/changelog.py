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


def append(
    spark: SparkSession,
    path: Where,
    events: DataFrame,
    primary_key: Sequence[str],
    seq_range: tuple[int, int],
    expected_rows: int,
    ingested_at: datetime,
    revoked: Callable[[], set[str]] | None = None,
    forgotten: Where | None = None,
    before_commit: Callable[[], None] | None = None,
    fence: Fence | None = None,
    properties: Mapping[str, str] | None = None,
    erased: Callable[[], ErasedKeys | None] | None = None,
) -> AppendResult:
    """Add the events not already logged; one Spark job, one Delta commit (or none).

    ``before_commit`` runs once the events were read and written, before the commit: if it
    raises (the files Spark read by path changed meanwhile, ``native.NativeGuard``), what was
    written is discarded and nothing is committed.

    ``revoked`` gives the landing files un-applied so far; it is asked again on every commit
    attempt, so a file revoked while this append raced an un-apply is never logged again.
    ``forgotten`` is the ledger of events a hard truncate or a re-sync removed (``forget``):
    a materialization passes it, so those ``(key, seq)`` are never logged again when an hour
    is read again; an operation a user runs (truncate, adopt, re-sync) logs what it is asked.
    ``properties``: what a change log this append creates records (``protected_columns``).
    ``erased`` gives the keys a data subject's request erased (``ledgers.erased_keys``); asked
    again on every attempt, as ``revoked`` is: no event of theirs is ever logged, whoever asks.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = list(primary_key)
    w = Window.partitionBy(*cols(pk), col(SEQ)).orderBy(col(SOURCE_FILE), col(SOURCE_ROW))
    events = events.withColumn(INGESTED_AT, timestamp_lit(ingested_at))
    schema = delta.arrow_schema_of(events)
    lo, hi = seq_range

    def attempt() -> AppendResult:
        log = Table.open(path).ensure(schema, "cdc_platform change log", properties)
        log = log.widened(spark, schema)  # a column the batch widened
        if fence is not None and log.version != fence.version:
            # Moved since the decision (or this batch changed its schema: a commit of its own,
            # after which the caller decides again on the new version).
            raise CommitFailedError(
                f"{path}: the change log is at version {log.version}, not {fence.version} "
                "as when the operation decided"
            )
        # Revoked files go before the duplicates are resolved, so that a kept file's copy of
        # an event a revoked file also delivered is the one logged.
        gone = revoked() if revoked is not None else set()
        kept = events.filter(~col(SOURCE_FILE).isin(sorted(gone))) if gone else events
        batch = kept.withColumn(_RN, F.row_number().over(w)).filter(col(_RN) == 1).drop(_RN)
        # Only files whose seq range overlaps this batch can hold a duplicate of its events.
        candidates = _overlapping(log.files, lo, hi)
        new = batch
        if candidates:
            logged = log.read(spark, candidates).select(*cols([*pk, SEQ]))
            # Broadcast only when the statistics say few rows (``lib.history.joins``): re-reading a
            # bulk hour checks its events against millions logged.
            logged = joins.build_side(logged, joins.records(candidates))
            new = new.join(logged, [*pk, SEQ], "left_anti")
        ledger = Table.open(forgotten) if forgotten is not None else None
        gone = _overlapping(ledger.files, lo, hi) if ledger is not None else []
        gone = [f for f in gone if removal_committed(path, f)]
        if ledger is not None and gone:
            key = ledger_key(ledger, pk)
            forgot = ledger.read(spark, gone).select(*cols([*key, SEQ]))
            # A column of the ledger's key this batch's files lack is null in every event.
            absent = {
                c: F.lit(None).cast(forgot.schema[c].dataType) for c in key if c not in new.columns
            }
            new = (
                new.withColumns(absent)
                .join(joins.build_side(forgot, joins.records(gone)), [*key, SEQ], "left_anti")
                .drop(*absent)
            )
        # The table's columns and types: a column the table widened after this batch was read
        # (a concurrent append) is cast up, as the widening cast the rows already there.
        table_schema = log.arrow_schema
        known = set(new.columns)
        new = delta.arrow_cast(
            new.select(
                *[
                    col(f.name) if f.name in known else F.lit(None).cast(f.dataType).alias(f.name)
                    for f in spark_schema(table_schema).fields
                ]
            ),
            table_schema,
        )
        erasures = erased() if erased is not None else None
        if erasures is not None:  # hashed in the table's types, as the erasure hashed them
            new = erasures.drop(new, pk)
        # A big append (a backfill) is split by commit time, so that a late key, refolded from
        # its recent past (``merge.gather``), skips the files of earlier times.
        n = delta.file_count_for(expected_rows, LOG_ROWS_PER_FILE)
        shaped = new.repartitionByRange(n, col(TS), *cols(pk)) if n > 1 else new.coalesce(1)
        with log.committing() as append:
            adds = append.write(shaped)
            if before_commit is not None:
                before_commit()
            if not adds:
                return AppendResult(0, log.version)
            count = sum(delta.num_records(a) for a in adds)
            # strict: if another writer logged events meanwhile, dedupe against them again
            version = append.commit(metadata={"cdc_platform.new_events": count}, strict=True)
        return AppendResult(count, version)

    if fence is not None:
        return attempt()
    return delta.with_commit_retries(attempt, f"change log append to {path}")[0]


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
