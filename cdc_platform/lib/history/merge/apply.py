"""The merge, stage by stage, retried when another writer commits first: the package's
entry points.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import HISTORY_COLUMNS_PROPERTY, HistoryColumns
from cdc_platform.lib.history import table_key
from cdc_platform.lib.history.merge.classify import split_keys, touch_keys
from cdc_platform.lib.history.merge.fold import changes_of, fold_versions
from cdc_platform.lib.history.merge.gather import gather_rows
from cdc_platform.lib.history.merge.open import open_attempt
from cdc_platform.lib.history.merge.snapshot import MergeResult, Opener, history_properties
from cdc_platform.lib.history.merge.write import (
    commit_history,
    rewritten_files,
    store_side_tables,
    write_files,
)
from cdc_platform.lib.history.table_key import PRIMARY_KEY_PROPERTY
from cdc_platform.lib.spark.run_cost import lap
from cdc_platform.lib.spark.session import interpreted
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def apply_pending(tables: Opener, synced_at: datetime, list_keys: bool = False) -> MergeResult:
    """Recompute the keys with pending change-log events; retry if another writer commits first.

    A table built with another ``history_columns`` setting is recomputed whole, once: its
    versions were cut by other columns. The setting is then recorded on the table.
    ``list_keys``: a small run names its keys in its commit, for the checks that follow
    (``TOUCHED_KEYS``; never for an encrypted table: its keys are decrypted data). Each
    attempt opens its tables through ``tables`` (the run's handle), as they are then.
    """
    spark, paths, primary_key = tables.spark, tables.paths, list(tables.config.key)
    history_columns = tables.config.history_columns
    result, attempts = delta.with_commit_retries(
        lambda: _apply_once(
            tables, spark, paths, primary_key, synced_at, history_columns, list_keys
        ),
        f"history commit for {paths.history}",
    )
    version = result.history_version
    # The snapshot the merge read says whether the settings are recorded (a data commit
    # changes no property): only a table missing them is read again to record them.
    if version is not None and _to_record(
        tables.table(paths.history), primary_key, history_columns
    ):
        history = tables.fresh(paths.history)
        if record_settings(history, primary_key, history_columns, version):
            version += 1  # the table as this run leaves it: the settings' commit came after
    return replace(result, attempts=attempts, history_version=version)


def record_settings(
    history: Table,
    primary_key: Sequence[str],
    history_columns: HistoryColumns,
    data_version: int,
) -> bool:
    """Record the key and the selective-history setting the versions now follow (table
    properties, ``table_key``): a metadata-only commit right after the data commit
    ``data_version``, and strict. If any other commit came in between (a run with the old
    setting may have merged some keys its way), nothing is recorded: the table still says the
    old setting, so the next run recomputes it whole again. A crash in between has the same
    effect. (A new table is created with both: this records them on tables from before.)
    ``history`` is the table as it is after that commit. Returns whether anything was recorded
    now."""
    from deltalake.exceptions import CommitFailedError

    dt = history.dt
    assert dt is not None  # it has just committed ``data_version``
    wanted = _to_record(history, primary_key, history_columns)
    if not wanted or dt.version() != data_version:
        return False
    try:
        history.set_properties(wanted)
    except CommitFailedError:
        return False
    return True


def _to_record(
    history: Table, primary_key: Sequence[str], history_columns: HistoryColumns
) -> dict[str, str]:
    """The settings ``history`` does not record yet (none: both are)."""
    if history.dt is None:
        return history_properties(primary_key, history_columns)
    recorded = {
        # A key it records is the same key: the merge checked it.
        PRIMARY_KEY_PROPERTY: table_key.recorded_key(history) is not None,
        HISTORY_COLUMNS_PROPERTY: HistoryColumns.of_table(history.dt).same_as(history_columns),
    }
    settings = history_properties(primary_key, history_columns)
    return {k: v for k, v in settings.items() if not recorded[k]}


def _apply_once(
    tables: Opener,
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
        a = open_attempt(tables, spark, paths, list(primary_key), history_columns, stack)
        if isinstance(a, MergeResult):
            return a
        if a.small:
            stack.enter_context(interpreted(spark))
        lap("merge_classify")
        touched = touch_keys(a)
        split = split_keys(a, touched)
        lap("merge_fold_compare")
        gathered = gather_rows(a, touched, split)
        compared, last_events = fold_versions(a, split, gathered, synced_at)
        old_rows = gathered.old_rows if touched.tiny else None
        old = gathered.old if gathered.old_rows != 0 else None  # a first load has no old rows
        change = changes_of(compared, old, a.pk, gathered.version_rows, old_rows)
        rewritten = rewritten_files(a, change)
        lap("merge_write")
        with a.history.committing() as commit:
            adds = write_files(a, commit, gathered, compared, rewritten)
            lap("merge_commit")
            version = commit_history(a, commit, touched, split.affected, rewritten, list_keys)
        lap("merge_side_tables")
        store_side_tables(a, touched, split, compared, last_events, change, gathered)
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
        restated=change.restated,
    )
