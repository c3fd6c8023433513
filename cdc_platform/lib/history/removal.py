"""Taking events out of the change log: the one way an operator removes what was logged
(un-apply, erasure, a hard truncate, a re-sync replacing a key's past), through
``HistoryTable.change`` (docs/HISTORY_MODE.md: the history table stays a fold of its log).

The keys that lose events are recorded first (``record_retracted_keys``), so the merge
recomputes them even with no event left; the rewrite is one strict commit on the version the
removal decided on.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from deltalake.exceptions import CommitFailedError

from cdc_platform.lib.columns import col, cols, internal
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import APP_ID, record_retracted_keys
from cdc_platform.lib.history.merge import table_relative as _table_relative
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# The column ``remove_events``' callers set on each change-log event: true if it goes.
GONE = internal("gone")


def remove_events(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    log: Table,
    files: Sequence[delta.DataFile],
    mark: Callable[[DataFrame], DataFrame],
    metadata_key: str,
    fence: bool = False,
    forget: bool = False,
) -> tuple[int, int, int]:
    """Take the events ``mark`` flags (its boolean column ``GONE``) out of ``files`` of the
    change-log snapshot ``log``: record their keys as retracted, then rewrite the files holding
    them in one strict commit. Returns (events removed, keys, files rewritten); with ``fence``
    an empty commit is made even when nothing is removed (see ``_remove_events``). With
    ``forget`` the events are recorded as forgotten first: no append logs them again (an
    un-apply needs no such record: its files are never read again).

    ``mark`` must flag each event from the event alone (a column test, a join with keys
    decided beforehand): it runs again over the rewritten files only, so a flag that looked
    at a key's other events (a window) would see part of them there."""
    from pyspark.sql import functions as F

    pk = list(primary_key)
    version = log.version
    assert version is not None  # the caller read this snapshot of an existing log
    if not files:
        return _fenced(log, fence, metadata_key)
    file_col = "_cdc_tmp_log_file"
    events = mark(
        log.read(spark, files).withColumn(
            file_col, _table_relative(F.input_file_name(), log.location)
        )
    )
    row = (
        events.filter(col(GONE))
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.collect_set(file_col).alias("files"),
            F.count_distinct(*cols(pk)).alias("keys"),
        )
        .collect()[0]
    )
    removed = int(row["n"])
    if not removed:
        return _fenced(log, fence, metadata_key)
    holding = set(row["files"])
    rewritten = [f for f in files if f.path in holding]
    applied = Table.open(paths.history).watermark(APP_ID)
    # Tied to this commit (``changelog.removal_committed``): if it loses its race, the retry
    # decides again and may keep some of these events, which must not stay forgotten.
    removal = uuid.uuid4().hex if forget else None
    if removal is not None:
        changelog.forget(paths.forgotten_events, events.filter(col(GONE)), pk, version, removal)
    # Tied to the version too: a removal that never committed only costs a recomputation.
    record_retracted_keys(paths, events.filter(col(GONE)).select(*cols(pk)), version, applied)
    kept_rows = sum(f.num_records or 0 for f in rewritten) - removed
    kept = mark(log.read(spark, rewritten)).filter(~col(GONE)).drop(GONE)
    try:
        with log.committing() as rewrite:
            rewrite.write(kept.coalesce(delta.file_count_for(kept_rows)))
            rewrite.commit(
                delta.removes_for(rewritten),
                metadata={
                    metadata_key: removed,
                    **({changelog.REMOVAL_KEY: removal} if removal else {}),
                },
                strict=True,
            )
    except CommitFailedError:
        if removal is not None:  # surely not committed
            changelog.unforget(paths.forgotten_events, removal)
        raise
    return removed, int(row["keys"]), len(rewritten)


def _fenced(log: Table, fence: bool, metadata_key: str) -> tuple[int, int, int]:
    """Nothing to remove: commit an empty version if asked to fence off racing appends."""
    if fence:
        with log.committing() as empty:
            empty.commit(metadata={metadata_key: 0}, strict=True)
    return 0, 0, 0


def marked_by(keys: DataFrame, primary_key: Sequence[str]) -> Callable[[DataFrame], DataFrame]:
    """A ``mark`` flagging every event of ``keys`` (the key columns and ``GONE``, decided
    beforehand: a flag from the event alone, as ``remove_events`` needs)."""
    from pyspark.sql import functions as F

    pk = list(primary_key)

    def mark(events: DataFrame) -> DataFrame:
        return events.join(keys, pk, "left").select(
            *cols(events.columns), F.coalesce(col(GONE), F.lit(False)).alias(GONE)
        )

    return mark
