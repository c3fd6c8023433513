"""Stage 1, open: the snapshot, widened to the change log's types, and the pending
change-log files (docs/HISTORY_MODE.md, rule 4: a column only widens).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import HistoryColumns
from cdc_platform.lib.history import changelog, joins
from cdc_platform.lib.history.merge.columns import SYSTEM_COLUMNS
from cdc_platform.lib.history.merge.side_tables import (
    pending_retractions,
    read_delete_only_keys,
    store_delete_only_keys,
)
from cdc_platform.lib.history.merge.snapshot import (
    Attempt,
    HistoryColumnsError,
    MergeResult,
    Opener,
    Snapshot,
    history_properties,
    history_schema,
)
from cdc_platform.lib.history.table_key import check_key
from cdc_platform.lib.spark.session import ADAPTIVE
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def widen_to_changelog(spark: SparkSession, snap: Snapshot) -> bool:
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


def open_attempt(
    tables: Opener,
    spark: SparkSession,
    paths: TablePaths,
    pk: list[str],
    history_columns: HistoryColumns,
    stack: ExitStack,
) -> Attempt | MergeResult:
    """Open every table once and find the pending change-log files; with none (and no
    retracted key), the result as it stands. The history table is created on the first run,
    with the change log's key and data columns and the system columns (rule 1)."""
    snap = Snapshot.open(tables, paths, history_columns)
    if snap is None:
        return MergeResult(history_version=delta.version_or_none(paths.history))
    check_key(snap.history, pk)  # every caller checked it already: this guards the merge
    while widen_to_changelog(spark, snap):  # types only widen: it ends
        snap = Snapshot.open(tables, paths, history_columns)
        assert snap is not None
    log_version = snap.changelog.version
    assert log_version is not None
    pending = changelog.files_since(snap.changelog, snap.applied)
    retracted, retracted_rows = pending_retractions(spark, snap, log_version)
    if not pending and retracted is None:
        if snap.history.exists and snap.delete_only_keys_stale:
            # A crash came between the last history commit and its side-table commit.
            unversioned, _ = read_delete_only_keys(spark, pk, snap)
            assert snap.applied is not None
            store_delete_only_keys(snap.delete_only_keys, unversioned, snap.applied)
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
    history = snap.history.ensure(
        schema, "cdc_platform history-mode table", history_properties(pk, history_columns)
    )
    return Attempt(
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
