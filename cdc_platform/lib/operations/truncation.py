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
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import (
    ACTIVE,
    CURRENT,
    INGESTED_AT,
    OP,
    SEQ,
    SOURCE_FILE,
    SYNCED,
    TS,
    HistoryColumns,
    col,
    cols,
    internal,
    timestamp_lit,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import MergeResult, apply_pending, caught_up, is_closed_file
from cdc_platform.lib.ledgers import revoked_files
from cdc_platform.lib.operations.revocation import GONE, remove_events
from cdc_platform.lib.pipeline import to_ms
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SOURCE_PREFIX = "truncate:before="
_OLD = internal("written_before")
_LOGGED = internal("last_logged")


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
    before: datetime | None = None,
    soft: bool = True,
    now: datetime | None = None,
) -> TruncateResult:
    """Truncate ``table`` before ``before`` (see the module docstring).

    Without ``before``, T is the millisecond after the catch-up merge: every row written so far
    counts as written before it, the ones that merge just wrote included. A ``before`` later
    than ``now`` is refused: it would close or remove what events logged later still write.
    """
    now = to_ms(now or datetime.now(UTC))
    if before is None:
        before = now + timedelta(milliseconds=1)
    if before.tzinfo is None:
        raise ValueError(f"truncate before {before.isoformat()}: give a time zone (or Z for UTC)")
    if before.year < 1971:
        raise ValueError(f"truncate before {before.isoformat()}: a time after 1970 is expected")
    before = to_ms(before)
    if before > now + timedelta(milliseconds=1):
        raise ValueError(
            f"truncate before {before.isoformat()}: that is in the future (now is "
            f"{now.isoformat()}); give a time that has passed, or none for now"
        )
    paths = TablePaths.of(warehouse_root, table.name)
    pk = list(table.key)
    if not Table.open(paths.changelog).exists:
        return TruncateResult(before, soft, 0, 0, 0, MergeResult(), table_existed=False)
    if soft:
        # A re-run after its events were un-applied logs them again (the user asks for it).
        revoked_files.remove(paths.revoked_files, [source_name(before)])

        def attempt() -> tuple[int, int]:
            # Decided on the version the table has caught up with (a crash may have left
            # events logged but not merged), and appended on exactly that version.
            log = caught_up(spark, paths, pk, now, table.history_columns)
            latest = _latest_rows(spark, paths)
            closing = (
                None
                if latest is None
                else latest.filter(col(ACTIVE) & (col(SYNCED) < timestamp_lit(before)))
            )
            fence = changelog.Fence(log.version if log is not None else None)
            return _log_deletes(spark, paths, pk, closing, before, now, fence)

        (keys, logged), _ = delta.with_commit_retries(attempt, f"soft truncate of {paths.history}")
        removed = 0
    else:
        logged = 0
        removed, keys = _remove_keys(spark, paths, pk, before, now, table.history_columns)
    merge = apply_pending(spark, paths, pk, now, table.history_columns)
    return TruncateResult(before, soft, keys, logged, removed, merge, table_existed=True)


def _latest_rows(spark: SparkSession, paths: TablePaths) -> DataFrame | None:
    """Each key's latest version (live or deleted), read from the live and deleted files only;
    None when the table has no history yet."""
    history = Table.open(paths.history)
    files = [f for f in history.files if not is_closed_file(f)]
    if not files:
        return None
    return history.read(spark, files, where=col(CURRENT))


def _log_deletes(
    spark: SparkSession,
    paths: TablePaths,
    pk: Sequence[str],
    rows: DataFrame | None,
    before: datetime,
    now: datetime,
    fence: changelog.Fence,
) -> tuple[int, int]:
    """Append a delete at ``before`` for the key of each of ``rows``, on the change-log version
    ``fence`` the keys were decided on; returns (keys, events new to the log). The events have
    every change-log column (null where a delete has no value)."""
    from pyspark.sql import functions as F

    count = 0 if rows is None else rows.count()
    if rows is None or not count:
        return 0, 0
    seq = truncate_seq(before)
    given = {
        OP: F.lit("DELETE"),
        SEQ: F.lit(seq),
        TS: timestamp_lit(before),
        SOURCE_FILE: F.lit(source_name(before)),
    }
    log_schema = Table.open(paths.changelog).spark_schema
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
        changelog.Batch(events, pk, (seq, seq), count, now),
        changelog.Guards(
            revoked=lambda: revoked_files.revoked_names(paths.revoked_files), fence=fence
        ),
    )
    return count, appended.new_events


def _remove_keys(
    spark: SparkSession,
    paths: TablePaths,
    pk: Sequence[str],
    before: datetime,
    now: datetime,
    history_columns: HistoryColumns,
) -> tuple[int, int]:
    """Take out of the change log every event of the keys a hard truncate removes: those whose
    latest version was written before ``before``, and delete-only keys (no version) whose events
    were all logged before it. Returns (events removed, keys).

    Each attempt decides on a change log the history table has caught up with, and commits
    strictly on it: an event logged meanwhile (a key this attempt never saw) makes the commit
    fail and the attempt start again, so it is never removed (nor forgotten) unseen."""
    from pyspark.sql import functions as F

    key_cols = cols(list(pk))
    cut = timestamp_lit(before)

    def keys_going(log: Table, latest: DataFrame | None) -> DataFrame:
        """The keys that go, decided once over every change-log file: a key's events may lie in
        files that are not all rewritten, so a flag computed again over the rewritten ones
        would see part of them (and drop an event it neither counts nor forgets)."""
        last = log.read(spark).groupBy(*key_cols).agg(F.max(col(INGESTED_AT)).alias(_LOGGED))
        # A key with no version: its events were all logged before T (null: an old log).
        unversioned_gone = F.coalesce(col(_LOGGED) < cut, F.lit(True))
        if latest is None:
            flagged = last.select(*key_cols, unversioned_gone.alias(GONE))
        else:
            versioned = latest.select(*key_cols, (col(SYNCED) < cut).alias(_OLD))
            flagged = last.join(versioned, list(pk), "left").select(
                *key_cols,
                F.when(col(_OLD).isNull(), unversioned_gone).otherwise(col(_OLD)).alias(GONE),
            )
        return flagged.filter(col(GONE))

    def attempt() -> tuple[int, int, int]:
        log = caught_up(spark, paths, pk, now, history_columns)
        assert log is not None  # the caller checked that the change log exists
        going = keys_going(log, _latest_rows(spark, paths)).cache()
        try:

            def mark(events: DataFrame) -> DataFrame:
                return events.join(going, list(pk), "left").select(
                    *cols(events.columns), F.coalesce(col(GONE), F.lit(False)).alias(GONE)
                )

            return remove_events(
                spark,
                paths,
                pk,
                log,
                log.files,
                mark,
                "cdc_platform.truncated_events",
                forget=True,
            )
        finally:
            going.unpersist()

    (removed, keys, _), _ = delta.with_commit_retries(
        attempt, f"change log rewrite of {paths.changelog}"
    )
    return removed, keys
