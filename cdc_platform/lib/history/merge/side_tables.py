"""The merge's two side tables: keys whose every event is a delete (``delete_only_keys``,
so a new key can be told from one whose only events were deletes) and keys an un-apply took
events from (``retracted_keys``, recomputed until the history table caught up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from cdc_platform.lib.columns import LAST_EVENT_AT, TS, col, cols
from cdc_platform.lib.history import joins
from cdc_platform.lib.history.merge.columns import AFTER_LOG_VERSION, APP_ID
from cdc_platform.lib.history.merge.snapshot import Snapshot
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType


def _delete_only_schema(log_schema: StructType, pk: list[str]) -> StructType:
    from pyspark.sql.types import StructField, StructType, TimestampType

    return StructType([*(log_schema[c] for c in pk), StructField(LAST_EVENT_AT, TimestampType())])


def read_delete_only_keys(
    spark: SparkSession, pk: list[str], snap: Snapshot
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
    assert snap.history.exists
    # The change log as the history table reflects it (a rebuild reflects none: all of it).
    logged = snap.changelog if snap.applied is None else snap.changelog.at(snap.applied)
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


def stamp_delete_only_keys(side: Table, log_version: int, previous: int | None) -> None:
    """Move the side table's watermark from ``previous`` to ``log_version`` without changing
    its rows (a commit with no files). A side table not at ``previous`` is stale (a crash came
    between two commits): it is left alone, so that the next run recomputes it."""
    if not side.exists:
        return  # then it is recomputed on the next run, as after a crash
    if side.watermark(APP_ID) != previous:
        return
    with side.committing() as stamp:
        stamp.commit(app_transaction=(APP_ID, log_version))


def store_delete_only_keys(side: Table, keys: DataFrame | None, log_version: int) -> None:
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


def pending_retractions(
    spark: SparkSession, snap: Snapshot, log_version: int
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
    side: Table, keys: DataFrame, after_log_version: int, applied: int | None
) -> None:
    """Add the keys an un-apply is about to take events from, before it commits the removal
    (a crash in between only costs a recomputation). Files whose keys the history table has
    caught up with (the table reflects a version past theirs) are dropped in the same commit."""
    from pyspark.sql import functions as F

    rows = keys.distinct().withColumn(AFTER_LOG_VERSION, F.lit(after_log_version).cast("long"))
    side = side.ensure(delta.arrow_schema_of(rows), "cdc_platform keys an un-apply recomputes")
    with side.committing() as record:
        written = record.write(rows.coalesce(1))
        # The keys are in the clear (an erasure's too): the Delta log keeps no bound of theirs.
        record.adds[:] = delta.stats_only_for(written, [AFTER_LOG_VERSION])
        record.commit(delta.removes_for(_caught_up(side, applied)))


def drop_caught_up_retractions(side: Table, history: Table) -> int:
    """Remove the retracted keys (``side``) the history table has caught up with, in one
    commit (an erasure's: they name its key in the clear); returns how many files went."""
    done = _caught_up(side, history.watermark(APP_ID))
    if done:
        with side.committing() as drop:
            drop.commit(delta.removes_for(done))
    return len(done)


def _caught_up(side: Table, applied: int | None) -> list[delta.DataFile]:
    """The side table's files whose removals the history table (at ``applied``) reflects."""
    return [
        f
        for f in side.files
        if applied is not None and f.max_values.get(AFTER_LOG_VERSION, applied) < applied
    ]
