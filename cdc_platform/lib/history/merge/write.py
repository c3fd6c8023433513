"""Stage 5, write and commit: the changed files rewritten (copy-on-write), committed with
the new watermark in one strict commit, then the side tables.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import ACTIVE, CURRENT, END, START, col, cols
from cdc_platform.lib.history import joins
from cdc_platform.lib.history.merge.classify import Split, Touched
from cdc_platform.lib.history.merge.columns import (
    APP_ID,
    HISTORY_ROWS_PER_FILE,
    MAX_TOUCHED_KEYS_BYTES,
    OLD_FILE,
    SEGMENT,
    TOUCHED_KEYS,
)
from cdc_platform.lib.history.merge.fold import Changes
from cdc_platform.lib.history.merge.gather import Gathered
from cdc_platform.lib.history.merge.side_tables import store_delete_only_keys
from cdc_platform.lib.history.merge.snapshot import Attempt, fault_point
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Commit

if TYPE_CHECKING:
    from deltalake.transaction import AddAction
    from pyspark.sql import DataFrame


def rewritten_files(a: Attempt, change: Changes) -> list[delta.DataFile]:
    """The files to remove. Each name comes from a row's file URL (``table_relative``); one
    that is not a file of the snapshot would leave its rows in place beside their new copies,
    so the run stops before writing anything."""
    rewritten = [f for f in a.files if f.path in change.rewritten]
    unknown = change.rewritten - {f.path for f in rewritten}
    if unknown:
        raise RuntimeError(
            f"{a.history}: rows came from files the table's snapshot does not list "
            f"({sorted(unknown)[:3]}); nothing was written"
        )
    return rewritten


def write_files(
    a: Attempt,
    commit: Commit,
    g: Gathered,
    compared: DataFrame,
    rewritten: list[delta.DataFile],
) -> list[AddAction]:
    """Write the new files (copy-on-write): the new and changed rows, and the rows of the
    rewritten files that this run did not recompute, carried as they are."""
    pk = a.pk
    carried = (
        a.read_history(rewritten)
        .join(
            joins.build_side(g.old.select(*cols([*pk, START])), g.old_rows),
            [*pk, START],
            "left_anti",
        )
        .select(*cols(a.columns))
    )
    names = sorted(f.path for f in rewritten)
    fresh = compared.filter(col(OLD_FILE).isNull() | col(OLD_FILE).isin(names))
    expected = sum(f.num_records or 0 for f in (*rewritten, *a.pending))
    return write_segments(
        carried.unionByName(fresh.select(*cols(a.columns))), commit, a.pk, expected
    )


def commit_history(
    a: Attempt,
    commit: Commit,
    t: Touched,
    keys_affected: int,
    rewritten: list[delta.DataFile],
    list_keys: bool,
) -> int:
    """Removes, adds and the change-log version now reflected, in one strict commit: a crash
    or a lost race leaves the table as it was (``Table.committing`` discards the files)."""
    fault_point("before_history_commit")
    return commit.commit(
        delta.removes_for(rewritten),
        app_transaction=(APP_ID, a.log_version),
        metadata={
            "cdc_platform.keys_affected": keys_affected,
            "cdc_platform.changelog_version": a.log_version,
            # A rebuild may change other keys' rows: no list.
            **touched_keys_metadata(t.values if list_keys and not a.snap.rebuild else None),
        },
        strict=True,
    )


def store_side_tables(
    a: Attempt,
    t: Touched,
    s: Split,
    compared: DataFrame,
    last_events: DataFrame,
    change: Changes,
    g: Gathered,
) -> None:
    """The delete-only keys after this run: keys whose events (all of them, or the state the
    fast path replayed) made no version; untouched delete-only keys stay. Rewritten only when
    it changed, or missed a commit."""
    pk = a.pk
    now_unversioned = last_events.join(
        joins.build_side(
            compared.select(*cols(pk)), g.version_rows, s.affected if t.tiny else None
        ),
        pk,
        "left_anti",
    )
    kept_unversioned = joins.restrict(t.unversioned, s.keys, pk, s.affected, t.values, "left_anti")
    changed = bool(s.delete_only_touched or s.affected > change.keys)
    side = a.snap.delete_only_keys
    rewrite = changed or t.side_stale or a.snap.rebuild or not side.exists
    store_delete_only_keys(
        side,
        kept_unversioned.unionByName(now_unversioned) if rewrite else None,
        a.log_version,
    )


def touched_keys_metadata(values: list[Any] | None) -> dict[str, str]:
    """The commit metadata naming the keys a run recomputed, when they are held and few (every
    row the commit changes is one of theirs: the others' rows are carried as they were)."""
    if values is None:
        return {}
    listed = json.dumps(values, ensure_ascii=True, separators=(",", ":"))
    return {TOUCHED_KEYS: listed} if len(listed) <= MAX_TOUCHED_KEYS_BYTES else {}


def write_segments(
    out: DataFrame,
    into: Commit,
    pk: list[str],
    expected_rows: int,
    data_change: bool = True,
) -> list[AddAction]:
    """Write rows so that each file holds one segment (live, deleted or closed), sorted by key.

    Live and deleted files split the key range. Closed files split the time range of their
    versions' ends: a late event only changes versions ending after it (``unchanged_before``),
    so it rewrites the closed files of the recent past, not one in every key range of all time.
    """
    from pyspark.sql import functions as F

    segment = (
        F.when(col(ACTIVE), F.lit("live"))
        .when(col(CURRENT), F.lit("deleted"))
        .otherwise(F.lit("closed"))
    )
    n = delta.file_count_for(expected_rows, HISTORY_ROWS_PER_FILE)
    shaped = out.withColumn(SEGMENT, segment)
    closed_end = F.when(col(SEGMENT) == "closed", col(END))
    shaped = (
        shaped.repartitionByRange(n, col(SEGMENT), closed_end, *cols(pk))
        if n > 1
        else shaped.coalesce(1)
    )
    return into.write(
        shaped.sortWithinPartitions(*cols([*pk, START])),
        partition_by=SEGMENT,
        data_change=data_change,
    )
