"""Stage 4, fold and compare: the keys' versions (rules 1-3) against their old rows, so
that only rows that change are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGED,
    END,
    LAST_EVENT_AT,
    START,
    STATE_COLUMNS,
    SYNCED,
    TS,
    col,
    cols,
    internal,
    map_columns,
    quote,
    same_sql,
    timestamp_lit,
)
from cdc_platform.lib.history import joins
from cdc_platform.lib.history.merge.classify import Split
from cdc_platform.lib.history.merge.columns import (
    CHECKPOINT,
    FILE,
    OLD_ACTIVE,
    OLD_FILE,
    OLD_SYNCED,
    RESTATED_CLOSED,
    RESTATED_FROM,
    RESTATED_TO,
    SLOW,
)
from cdc_platform.lib.history.merge.gather import Gathered
from cdc_platform.lib.history.merge.snapshot import Attempt, Restated
from cdc_platform.lib.history.versions import build_versions

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def fold_versions(
    a: Attempt, s: Split, g: Gathered, synced_at: datetime
) -> tuple[DataFrame, DataFrame]:
    """The keys' versions (rules 3-7: ``history.build_versions``), each marked current or not,
    compared with the old rows (``_compare``); and each key's last event time, which the
    delete-only side table needs after the commit (computed then, from ``g.events``)."""
    from pyspark.sql import functions as F

    pk = a.pk
    last_events = g.events.groupBy(*cols(pk)).agg(
        F.max(F.date_trunc("millisecond", col(TS))).alias(LAST_EVENT_AT)
    )
    versions = build_versions(
        g.events,
        pk,
        a.data_columns,
        deduplicated=True,
        history_columns=a.history_columns,
        with_state=True,
        resolve_unmodified=s.resolve_unmodified,
    )
    # One row per key (``current`` may hold more than one row of a key when file statistics
    # cannot tell closed files apart, so ``keys`` may repeat a key).
    if s.slow_count:
        slow_of = s.keys.groupBy(*cols(pk)).agg(F.max(col(SLOW)).alias(SLOW))
        if g.checkpoints is not None:
            slow_of = slow_of.join(
                joins.build_side(g.checkpoints, s.slow_count, g.probe), pk, "left"
            )
        else:
            slow_of = slow_of.withColumn(CHECKPOINT, F.lit(None).cast("timestamp"))
        versions = versions.join(joins.build_side(slow_of, s.affected, g.probe), pk, "left")
    else:  # every key fast: nothing to join
        versions = versions.select(
            "*", F.lit(False).alias(SLOW), F.lit(None).cast("timestamp").alias(CHECKPOINT)
        )
    compared = _compare(
        versions,
        joins.build_side(g.old, g.old_rows, g.probe),
        pk,
        a.data_columns,
        synced_at,
        s.cut,
    )
    return a.keep(compared), last_events


def _compare(
    versions: DataFrame,
    old: DataFrame,
    pk: list[str],
    data_columns: list[str],
    synced_at: datetime,
    cut: datetime | None = None,
) -> DataFrame:
    """The new versions, each with the old row at the same ``(key, start)`` if it is identical.

    ``versions`` carries ``SLOW`` (was its key recomputed from its events?) and
    ``CHECKPOINT`` (from which version on, see ``_slow_events``); both are dropped.
    A recomputed version ending before ``cut`` (see ``unchanged_before``) is the old one, in a
    file this run did not read unless ``old`` has it: it is left out, not written again.

    A version whose image, end and active flag are as before keeps its ``_fivetran_synced``
    (only its state columns may have moved, say after a no-op update); any other gets this
    run's. A row identical in every column may stay where it is: ``OLD_FILE`` names its file.
    ``OLD_ACTIVE`` feeds the run's counts.
    """
    from pyspark.sql import functions as F

    compared_columns = [*data_columns, END, ACTIVE, *STATE_COLUMNS]
    renamed = {c: internal(f"old_{i}") for i, c in enumerate(compared_columns)}
    prior = old.select(
        *cols(pk),
        START,
        *[F.expr(f"{quote(c)} AS {quote(a)}") for c, a in renamed.items()],
        col(SYNCED).alias(OLD_SYNCED),
        col(FILE).alias(internal("prior_file")),
    )
    joined = versions.join(prior, [*pk, START], "left")
    existed = col(internal("prior_file")).isNotNull()
    if cut is not None:
        slow = F.coalesce(col(SLOW), F.lit(False))
        joined = joined.filter(~slow | existed | (col(END) >= timestamp_lit(cut)))
    # The fold gives no changed columns to the first version it folds of a key (it saw no
    # predecessor). For a fast key that is the replayed current row: its changed columns are
    # the stored ones. For a slow key (``SLOW``) it is the key's first version: null, even
    # where that version was not the first before (an un-apply removed the earlier ones).
    # A slow key refolded from a checkpoint (``_slow_events``) has the same gap at the
    # checkpoint's version: that version is unchanged, its stored changed columns stand.
    from_first = col(SLOW) & ~F.coalesce(col(START) == col(CHECKPOINT), F.lit(False))
    joined = joined.withColumn(
        CHANGED,
        F.when(from_first, col(CHANGED)).otherwise(F.coalesce(col(CHANGED), col(renamed[CHANGED]))),
    ).drop(SLOW, CHECKPOINT)
    # SQL text, names quoted: one call into the JVM, where Column objects made a few a column.
    existed_sql = f"{quote(internal('prior_file'))} IS NOT NULL"
    maps = map_columns(versions.schema)
    as_before = [same_sql(quote(c), quote(renamed[c]), c in maps) for c in compared_columns]
    same_version = F.expr(" AND ".join([existed_sql, *as_before[: len(data_columns) + 2]]))
    same_row = F.expr(" AND ".join([existed_sql, *as_before]))
    synced = F.when(same_version, col(OLD_SYNCED)).otherwise(timestamp_lit(synced_at))
    same_image = F.expr(" AND ".join([existed_sql, *as_before[: len(data_columns)]]))
    return (
        joined.withColumn(SYNCED, synced)
        .withColumn(OLD_FILE, F.when(same_row, col(internal("prior_file"))))
        .withColumn(OLD_ACTIVE, F.when(existed, col(renamed[ACTIVE])))
        .withColumns(_restated(existed, same_version, same_image, renamed))
        .drop(*renamed.values(), OLD_SYNCED, internal("prior_file"))
    )


def _restated(
    existed: Column, same_version: Column, same_image: Column, old: dict[str, str]
) -> dict[str, Column]:
    """The valid time over which a version's row image changed (null where it did not): a new
    version's whole span; a version that only ends elsewhere, between its old and new end (an
    update closing the live version restates from the update on, not from the version's
    start); and whether it had closed before (a late event rewrote the past)."""
    from pyspark.sql import functions as F

    changed, old_end = ~same_version, col(old[END])
    moved_end = existed & same_image & (col(END) != old_end)
    # Ends are inclusive and in milliseconds: the first instant that changed is one after.
    moved = F.least(col(END), old_end) + F.expr("INTERVAL 1 MILLISECOND")
    start = F.when(moved_end, moved).otherwise(col(START))
    end = F.when(existed, F.greatest(col(END), old_end)).otherwise(col(END))
    return {
        RESTATED_FROM: F.when(changed, start),
        RESTATED_TO: F.when(changed, end),
        RESTATED_CLOSED: changed & existed & ~col(old[ACTIVE]),
    }


@dataclass(frozen=True)
class Changes:
    rewritten: set[str]  # files holding an old row that is not kept as it is
    vanished: int  # active old rows with no version at their start any more
    opened: int  # versions that start where none started before
    closed: int  # versions active before and not any more
    keys: int  # keys with a version at all
    restated: Restated | None = None  # the valid time whose rows changed; None: none did


def changes_of(
    compared: DataFrame,
    old: DataFrame | None,
    pk: list[str],
    compared_rows: int | None = None,
    old_rows: int | None = None,
) -> Changes:
    """What the run changes, in one Spark job: the files to rewrite (an old row not kept as it
    is) and the counts of the run's result. A vanished row was active and has no version at the
    same start any more (a late event moved the key's history). ``compared_rows`` and
    ``old_rows`` bound the rows of each side (``lib.history.joins``); ``old`` None: there are none
    (nothing to rewrite, nothing vanished: the versions are not shuffled to meet them)."""
    from pyspark.sql import functions as F

    of_new = compared.agg(
        F.sum(col(OLD_ACTIVE).isNull().cast("long")).alias("opened"),
        F.sum((col(OLD_ACTIVE) & ~col(ACTIVE)).cast("long")).alias("closed"),
        F.count_distinct(*cols(pk)).alias("keys"),
        *_span(col(RESTATED_FROM), col(RESTATED_TO), col(RESTATED_CLOSED)),
    )
    if old is not None:
        new = compared.select(
            *cols([*pk, START]),
            col(OLD_FILE).isNotNull().alias(internal("kept")),
            F.lit(True).alias(internal("exists")),
        )
        joined = old.join(joins.build_side(new, compared_rows, old_rows), [*pk, START], "left")
        kept = F.coalesce(col(internal("kept")), F.lit(False))
        gone = col(internal("exists")).isNull()
        of_old = joined.agg(
            F.collect_set(F.when(~kept, col(FILE))).alias("files"),
            F.sum((col(ACTIVE) & gone).cast("long")).alias("vanished"),
            *_span(F.when(gone, col(START)), F.when(gone, col(END)), gone & ~col(ACTIVE), "old_"),
        )
        of_new = of_old.unionByName(of_new, allowMissingColumns=True)
    rows = of_new.collect()  # one row per aggregate
    got = {k: v for r in rows for k, v in r.asDict().items() if v is not None}
    return Changes(
        rewritten=set(got.get("files") or []),
        vanished=int(got.get("vanished") or 0),
        opened=int(got.get("opened") or 0),
        closed=int(got.get("closed") or 0),
        keys=int(got.get("keys") or 0),
        restated=Restated.union(Restated.of(got, ""), Restated.of(got, "old_")),
    )


def _span(start: Column, end: Column, closed: Column, prefix: str = "") -> list[Column]:
    """The aggregates ``Restated.of`` reads: the earliest start, the latest end, any closed."""
    from pyspark.sql import functions as F

    return [
        F.min(F.unix_micros(start)).alias(f"{prefix}restated_from"),
        F.max(F.unix_micros(end)).alias(f"{prefix}restated_to"),
        F.max(closed.cast("int")).alias(f"{prefix}restated_closed"),
    ]
