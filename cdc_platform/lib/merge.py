"""Bringing the history table up to date with the change log, as one atomic Delta commit.

The history table records, in each commit, the change-log version it reflects (a Delta app
transaction). Whatever was logged after that version is *pending*: its keys are recomputed
from all their events, the history files holding those keys are rewritten (copy-on-write),
and removes plus adds are committed together with the new watermark. A crash at any point
leaves the previous version intact, and the next run finds the same pending work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import pyarrow as pa

from cdc_platform.lib import changelog, delta
from cdc_platform.lib.columns import (
    ACTIVE,
    END,
    HISTORY_SYSTEM_COLUMNS,
    START,
    SYNCED,
    col,
    cols,
    internal,
)
from cdc_platform.lib.history import build_versions
from cdc_platform.lib.warehouse import TablePaths

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

APP_ID = "cdc_platform/changelog"
COMMIT_ATTEMPTS = delta.COMMIT_ATTEMPTS
FAULT_ENV = "CDC_PLATFORM_FAULT"
# Working columns, under the internal prefix (never a source column's name).
_FILE = internal("file")
_OPENED = internal("opened")
_CLOSED = internal("closed")


@dataclass(frozen=True)
class MergeResult:
    keys_affected: int = 0
    versions_opened: int = 0
    versions_closed: int = 0
    rows_written: int = 0
    files_removed: int = 0
    files_added: int = 0
    history_version: int | None = None
    changelog_version: int | None = None
    attempts: int = 0


def fault_point(name: str) -> None:
    """Crash the process here when ``CDC_PLATFORM_FAULT`` names this point (crash-safety tests)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), 9)


def applied_changelog_version(paths: TablePaths) -> int | None:
    if not delta.exists(paths.history):
        return None
    return delta.open_table(paths.history).transaction_version(APP_ID)


def history_schema(primary_key: Sequence[str], key_and_data: pa.Schema) -> pa.Schema:
    ts = pa.timestamp("us", tz="UTC")
    keys = [key_and_data.field(k) for k in primary_key]
    data = [f for f in key_and_data if f.name not in primary_key]
    system = [
        pa.field(START, ts),
        pa.field(END, ts),
        pa.field(ACTIVE, pa.bool_()),
        pa.field(SYNCED, ts),
    ]
    return pa.schema([f.with_nullable(True) for f in (*keys, *data, *system)])


def apply_pending(
    spark: SparkSession, paths: TablePaths, primary_key: Sequence[str], synced_at: datetime
) -> MergeResult:
    """Recompute the keys with pending change-log events; retry if another writer commits first."""
    result, attempts = delta.with_commit_retries(
        lambda: _apply_once(spark, paths, primary_key, synced_at),
        f"history commit for {paths.history}",
    )
    return MergeResult(**{**result.__dict__, "attempts": attempts})


def _apply_once(
    spark: SparkSession, paths: TablePaths, primary_key: Sequence[str], synced_at: datetime
) -> MergeResult:
    pk = list(primary_key)
    applied = applied_changelog_version(paths)
    pending, changelog_version = changelog.pending_files(paths.changelog, applied)
    if not pending:
        return MergeResult(
            history_version=delta.version_or_none(paths.history),
            changelog_version=changelog_version,
        )

    key_and_data = changelog.key_and_data_fields(paths.changelog)
    assert key_and_data is not None
    schema = history_schema(pk, key_and_data)
    data_columns = [
        f.name for f in schema if f.name not in pk and f.name not in HISTORY_SYSTEM_COLUMNS
    ]
    dt = delta.ensure_table(paths.history, schema, description="cdc_platform history-mode table")
    hist_schema = changelog.spark_schema(delta.table_arrow_schema(dt))
    columns = [f.name for f in hist_schema.fields]

    pending_events = changelog.read(spark, paths.changelog, pending)
    assert pending_events is not None
    with _cached(pending_events.select(*cols(pk)).distinct()) as affected:
        keys_affected = affected.count()
        touched = _files_holding(spark, paths.history, dt, hist_schema, affected, pk)
        events = changelog.read(spark, paths.changelog)
        assert events is not None
        versions = build_versions(events.join(affected, pk, "left_semi"), pk, data_columns)

        if touched:
            old = spark.read.schema(hist_schema).parquet(
                *delta.absolute_paths(paths.history, touched)
            )
        else:
            old = spark.createDataFrame([], hist_schema)
        old_affected = old.join(affected, pk, "left_semi")
        prior = _compare_with_prior(versions, old_affected, pk, data_columns, synced_at)
        with _cached(prior) as compared:
            untouched = old.join(affected, pk, "left_anti").select(*cols(columns))
            out = untouched.unionByName(compared.select(*cols(columns)))
            expected = sum(f.num_records or 0 for f in touched) + sum(
                f.num_records or 0 for f in pending
            )
            out = out.repartition(delta.file_count_for(expected), *cols(pk))
            adds = delta.write_files(out.sortWithinPartitions(*cols([*pk, START])), paths.history)
            try:
                opened, closed = _count_changes(compared, old_affected, pk)
                fault_point("before_history_commit")
                version = delta.commit(
                    dt,
                    adds,
                    delta.removes_for(touched),
                    delta.table_arrow_schema(dt),
                    app_transaction=(APP_ID, changelog_version),
                    metadata={
                        "cdc_platform.keys_affected": keys_affected,
                        "cdc_platform.changelog_version": changelog_version,
                    },
                    strict=True,
                )
            except BaseException:
                delta.discard(paths.history, adds)
                raise
    return MergeResult(
        keys_affected=keys_affected,
        versions_opened=opened,
        versions_closed=closed,
        rows_written=sum(delta.num_records(a) for a in adds),
        files_removed=len(touched),
        files_added=len(adds),
        history_version=version,
        changelog_version=changelog_version,
    )


@contextmanager
def _cached(df: DataFrame) -> Iterator[DataFrame]:
    """Keep a DataFrame that several Spark jobs reuse in memory (spilling) for the block."""
    from pyspark import StorageLevel

    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        yield df
    finally:
        df.unpersist()


def _files_holding(
    spark: SparkSession,
    table_path: Path,
    dt: DeltaTable,
    schema: StructType,
    keys: DataFrame,
    pk: list[str],
) -> list[delta.DataFile]:
    """The history files that hold any of ``keys``: only the key columns are scanned."""
    from pyspark.sql import functions as F

    files = delta.snapshot_files(dt)
    if not files:
        return []
    by_path = {
        os.path.normpath(p): f
        for p, f in zip(delta.absolute_paths(table_path, files), files, strict=True)
    }
    scan = (
        spark.read.schema(schema)
        .parquet(*by_path)
        .select(*cols(pk), F.input_file_name().alias(_FILE))
    )
    hits = scan.join(keys, pk, "left_semi").select(col(_FILE)).distinct().collect()
    return [by_path[os.path.normpath(unquote(urlparse(r[_FILE]).path))] for r in hits]


def _compare_with_prior(
    versions: DataFrame, old: DataFrame, pk: list[str], data_columns: list[str], synced_at: datetime
) -> DataFrame:
    """The new versions, each compared with the version at the same ``(key, start)`` before.

    A version exactly as before keeps its ``_fivetran_synced``; others get this run's. Two flags
    feed the run's metadata: ``_OPENED`` (no version started there before) and ``_CLOSED``
    (active before, not any more).
    """
    from pyspark.sql import functions as F

    renamed = {c: internal(f"old_{i}") for i, c in enumerate([*data_columns, END, ACTIVE, SYNCED])}
    prior = old.select(*cols([*pk, START]), *[col(c).alias(a) for c, a in renamed.items()])
    joined = versions.join(prior, [*pk, START], "left")
    existed = col(renamed[SYNCED]).isNotNull()
    unchanged: Column = existed
    for c in [*data_columns, END, ACTIVE]:
        unchanged = unchanged & col(c).eqNullSafe(col(renamed[c]))
    synced = F.when(unchanged, col(renamed[SYNCED])).otherwise(F.lit(synced_at).cast("timestamp"))
    return (
        joined.withColumn(SYNCED, synced)
        .withColumn(_OPENED, ~existed)
        .withColumn(_CLOSED, existed & col(renamed[ACTIVE]) & ~col(ACTIVE))
        .drop(*renamed.values())
    )


def _count_changes(compared: DataFrame, old: DataFrame, pk: list[str]) -> tuple[int, int]:
    """Versions opened and closed; an active version that vanished (a late event moved the
    key's history) counts as closed too."""
    from pyspark.sql import functions as F

    row = compared.agg(
        F.sum(col(_OPENED).cast("int")).alias("opened"),
        F.sum(col(_CLOSED).cast("int")).alias("closed"),
    ).first()
    vanished = (
        old.filter(col(ACTIVE))
        .select(*cols([*pk, START]))
        .join(compared.select(*cols([*pk, START])), [*pk, START], "left_anti")
        .count()
    )
    return int(row["opened"] or 0), int(row["closed"] or 0) + vanished
