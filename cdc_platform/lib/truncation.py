"""Truncating a history table, as Fivetran's ``Truncate`` does (``before`` T, soft or hard).

The history table stays a fold of its change log, so a truncate is written there:

* **soft** closes every live version written before T (``_fivetran_synced < T``) at T. Each
  such key gets a synthetic ``DELETE`` event at T in the change log, and the merge applies it
  like any delete (rule 4: ``_fivetran_end`` = T, ``_fivetran_active`` = false). The events name
  their origin in ``_cdc_source_file`` (``truncate:before=<T>``) and carry
  ``cdc_change_seq`` = -T in epoch milliseconds: a real event of the same millisecond sorts
  after the truncate and wins, and the same truncate run twice logs nothing new. A later event
  of a closed key re-opens it; a late event older than T lands before the delete.
* **hard** removes every key whose latest version (live or deleted) was written before T, with
  all its versions, and its events from the change log, as an un-apply does: the removal is
  recorded, then the merge recomputes those keys and finds nothing left. Keys with no version
  (every event a delete) go too. Delta time travel keeps the rows that were there.

The table is brought up to date with its change log first, so T is compared with what every
logged event made of it. A table that does not exist yet is not an error: nothing happens.
Each step is one Delta commit that a crash leaves whole or absent; the next run (or the same
truncate again) finishes the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cdc_platform.lib import changelog, delta, revoked_files
from cdc_platform.lib.columns import (
    ACTIVE,
    CURRENT,
    OP,
    SEQ,
    SOURCE_FILE,
    SYNCED,
    TS,
    col,
    cols,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.merge import MergeResult, apply_pending, is_closed_file
from cdc_platform.lib.pipeline import to_ms
from cdc_platform.lib.revocation import GONE, remove_events
from cdc_platform.lib.storage import Where
from cdc_platform.lib.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SOURCE_PREFIX = "truncate:before="


@dataclass(frozen=True)
class TruncateResult:
    before: datetime
    soft: bool
    keys: int  # keys closed (soft) or removed (hard) by this call; 0 on a replay
    events_logged: int  # soft: synthetic deletes added to the change log
    events_removed: int  # hard: events taken out of the change log
    merge: MergeResult
    table_existed: bool


def source_name(before: datetime) -> str:
    """What ``_cdc_source_file`` says of a soft truncate's events (un-apply accepts it)."""
    return SOURCE_PREFIX + to_ms(before).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def truncate_seq(before: datetime) -> int:
    """The ``cdc_change_seq`` of a soft truncate's deletes: below every real seq of its ms."""
    return -int(to_ms(before).timestamp() * 1000)


def truncate(
    spark: SparkSession,
    table: TableConfig,
    warehouse_root: Where,
    before: datetime,
    soft: bool = True,
    now: datetime | None = None,
) -> TruncateResult:
    """Truncate ``table`` before ``before`` (see the module docstring)."""
    if before.tzinfo is None:
        raise ValueError(f"truncate before {before.isoformat()}: give a time zone (or Z for UTC)")
    if before.year < 1971:
        raise ValueError(f"truncate before {before.isoformat()}: a time after 1970 is expected")
    before = to_ms(before)
    now = to_ms(now or datetime.now(UTC))
    paths = TablePaths.of(warehouse_root, table.name)
    pk = list(table.primary_key)
    if not delta.exists(paths.changelog):
        return TruncateResult(before, soft, 0, 0, 0, MergeResult(), table_existed=False)
    # Catch up first: a crash may have left events logged but not merged.
    apply_pending(spark, paths, pk, now, table.history_columns)
    if soft:
        latest = _latest_rows(spark, paths)
        closing = None if latest is None else latest.filter(col(ACTIVE) & (col(SYNCED) < before))
        keys, logged = _log_deletes(spark, paths, pk, closing, before, now)
        removed = 0
    else:
        logged = 0
        removed, keys = _remove_keys(spark, paths, pk, before)
    merge = apply_pending(spark, paths, pk, now, table.history_columns)
    return TruncateResult(before, soft, keys, logged, removed, merge, table_existed=True)


def _latest_rows(spark: SparkSession, paths: TablePaths) -> DataFrame | None:
    """Each key's latest version (live or deleted), read from the live and deleted files only;
    None when the table has no history yet."""
    if not delta.exists(paths.history):
        return None
    dt = delta.open_table(paths.history)
    files = [f for f in delta.snapshot_files(dt) if not is_closed_file(f)]
    if not files:
        return None
    schema = changelog.spark_schema(delta.table_arrow_schema(dt))
    rows = spark.read.schema(schema).parquet(*delta.absolute_paths(paths.history, files))
    return rows.filter(col(CURRENT))


def _log_deletes(
    spark: SparkSession,
    paths: TablePaths,
    pk: Sequence[str],
    rows: DataFrame | None,
    before: datetime,
    now: datetime,
) -> tuple[int, int]:
    """Append a delete at ``before`` for the key of each of ``rows``; returns (keys, events new
    to the log). The events have every change-log column (null where a delete has no value)."""
    from pyspark.sql import functions as F

    count = 0 if rows is None else rows.count()
    if rows is None or not count:
        return 0, 0
    seq = truncate_seq(before)
    given = {
        OP: F.lit("DELETE"),
        SEQ: F.lit(seq),
        TS: F.lit(before),
        SOURCE_FILE: F.lit(source_name(before)),
    }
    log_schema = changelog.spark_schema(delta.table_arrow_schema(delta.open_table(paths.changelog)))
    events = rows.select(
        *[
            (col(f.name) if f.name in pk else given.get(f.name, F.lit(None)))
            .cast(f.dataType)
            .alias(f.name)
            for f in log_schema.fields
        ]
    )
    appended = changelog.append(
        spark,
        paths.changelog,
        events,
        pk,
        (seq, seq),
        count,
        now,
        revoked=lambda: revoked_files.revoked_names(paths.revoked_files),
    )
    return count, appended.new_events


def _remove_keys(
    spark: SparkSession, paths: TablePaths, pk: Sequence[str], before: datetime
) -> tuple[int, int]:
    """Take out of the change log every event of the keys a hard truncate removes: each logged
    key but those whose latest version was written at or after ``before``. Returns (events
    removed, keys)."""
    from pyspark.sql import functions as F

    latest = _latest_rows(spark, paths)
    kept = (
        None
        if latest is None
        else latest.filter(col(SYNCED) >= before).select(*cols(list(pk))).distinct()
    )

    def mark(events: DataFrame) -> DataFrame:
        if kept is None:  # no version at all: every logged key goes
            return events.withColumn(GONE, F.lit(True))
        flagged = kept.withColumn(GONE, F.lit(False))
        return events.join(flagged, list(pk), "left").select(
            *cols(events.columns), F.coalesce(col(GONE), F.lit(True)).alias(GONE)
        )

    def attempt() -> tuple[int, int, int]:
        dt = delta.open_table(paths.changelog)
        return remove_events(
            spark,
            paths,
            pk,
            dt,
            delta.snapshot_files(dt),
            mark,
            "cdc_platform.truncated_events",
            forget=True,
        )

    (removed, keys, _), _ = delta.with_commit_retries(
        attempt, f"change log rewrite of {paths.changelog}"
    )
    return removed, keys
