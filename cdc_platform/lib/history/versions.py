"""The history-mode fold (docs/HISTORY_MODE.md section 3) as Spark window functions.

The rules read like a per-key state machine, but their state never reaches back further than
one step, which is what lets this run as window functions instead of a Python loop:

* a *step* is one (key, millisecond); its image is the last non-delete event's image, where
  unmodified cells take the key's last known value (a running ``last(..., ignorenulls)``);
* the key is live after a step iff the step has a non-delete and does not end with a delete,
  so "live before this step" and "current image" are just ``lag`` of the previous step;
* a step opens a version unless it has no non-delete or its image equals the live image;
* a version ends at the first later step that opens a version (end = that ms - 1 ms) or ends
  in a delete (end = that ms); a version whose own step ends in a delete has start = end.

With selective history (``HistoryColumns``), only the tracked columns decide whether a step
opens a version; a step that changes untracked columns only is folded into the live version,
which takes the image of its last step (its values are updated in place).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGED,
    CURRENT,
    END,
    INGESTED_AT,
    LAST_EVENT_AT,
    OP,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    START,
    SYNCED,
    TMAX,
    TMAX_SQL,
    TS,
    UNMODIFIED,
    HistoryColumns,
    col,
    cols,
    internal,
    map_columns,
    quote,
    same_sql,
    string_sql,
    window_sql,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = [  # the column names are re-exported for existing callers; their home is columns.py
    "ACTIVE",
    "END",
    "INGESTED_AT",
    "START",
    "SYNCED",
    "TMAX",
    "HistoryColumns",
    "build_versions",
    "dedupe_events",
    "event_images",
    "fold_order",
    "millisecond_steps",
    "openings",
    "tmax_literal",
]

# The fold's working columns: under the internal prefix, so never a source column's name.
_FIRST = internal("first")
_SEQ = internal("seq")
_MS = internal("ms")
_DEL = internal("del")
_UNMOD = internal("unmod")
_IMG = internal("img")
_HAS_IMAGE = internal("has_image")
_ENDS_DELETED = internal("ends_deleted")
_LIVE_BEFORE = internal("live_before")
_PREV_IMG = internal("prev_img")
_OPENS = internal("opens")
_NEXT_CLOSE = internal("next_close")
_VERSION_NO = internal("version_no")

TRACK_ALL = HistoryColumns()


def tmax_literal() -> Column:
    from pyspark.sql import functions as F

    return F.lit(TMAX_SQL).cast("timestamp")


def dedupe_events(events: DataFrame, primary_key: Sequence[str]) -> DataFrame:
    """Count each (key, cdc_change_seq) once; the first copy to land wins, deterministically.

    A window over the key alone (a copy is kept when it is the key's first row, in seq and
    landing order, or the row before it has another seq, null-safe): the rows come out
    partitioned by key, which is all the fold, the classification and the keys' last events
    need, so none of them shuffles the events again.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = cols(list(primary_key))
    order = [
        col(c).asc_nulls_last()
        for c in (INGESTED_AT, SOURCE_FILE, SOURCE_ROW)
        if c in events.columns
    ]
    w = Window.partitionBy(*pk).orderBy(col(SEQ), *order)
    first = (F.row_number().over(w) == 1) | ~F.lag(col(SEQ)).over(w).eqNullSafe(col(SEQ))
    return events.withColumn(_FIRST, first).filter(col(_FIRST)).drop(_FIRST)


RUNNING = "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW"


def resolved_cell_sql(column: str, deleted: str, unmodified: str, window: str) -> str:
    """Rule 1 as SQL text: ``column``'s value in the key's latest event up to this one (in
    ``window``, a running frame) that is not a delete and does not list it in ``unmodified``.
    The writer's fold and the reconciliation check share it. Every name is quoted, and the
    column's name is a hex literal (``columns.string_sql``): one JVM call per column."""
    return (
        f"(last(CASE WHEN NOT {quote(deleted)} AND NOT array_contains({quote(unmodified)}, "
        f"{string_sql(column)}) THEN struct({quote(column)} AS v) END, true) OVER ({window})).v"
    )


def build_versions(
    events: DataFrame,
    primary_key: Sequence[str],
    data_columns: Sequence[str],
    deduplicated: bool = False,
    history_columns: HistoryColumns = TRACK_ALL,
    with_state: bool = False,
    resolve_unmodified: bool = True,
) -> DataFrame:
    """Every version of every key in ``events``: key, data columns, start, end, active, and
    ``_cdc_changed_columns`` (the tracked data columns whose value differs, ``<=>``, from the
    key's previous version; null for the first version of a key in ``events``).
    ``with_state`` adds the state columns ``_cdc_current`` (the key's latest version) and
    ``_cdc_last_event_at`` (on it: the key's last event millisecond), from the same window
    pass (a join with the keys' last events would shuffle every version again).
    ``resolve_unmodified`` False: no event carries an unmodified marker, so each image is the
    event's own cells (rule 1 has nothing to resolve; its running window is skipped).

    ``events`` must hold *all* events of the keys it covers (order does not matter). Column
    names are used verbatim (quoted), and the working columns live under the internal prefix,
    so a source column called ``_seq``, ``a.b`` or ``a`b`` is just data. Images are compared
    with ``<=>``, a map by its entries sorted by key (``columns.same_sql``).
    ``deduplicated`` says each ``(key, cdc_change_seq)`` is there once already.
    ``history_columns`` says which columns open versions (the others update in place).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = list(primary_key)
    pkc = cols(pk)
    maps = map_columns(events.schema)
    tracked = history_columns.tracked(data_columns)
    steps = (
        (events if deduplicated else events.transform(dedupe_events, pk))
        .transform(fold_order, pk, data_columns)
        .transform(event_images, pk, data_columns, resolve_unmodified)
        .transform(millisecond_steps, pk)
        .transform(openings, pk, data_columns, history_columns, maps)
    )

    w_steps = Window.partitionBy(*pkc).orderBy(col(_MS))
    one_ms = F.expr("INTERVAL 1 MILLISECOND")
    closes_previous_at = F.when(col(_OPENS), col(_MS) - one_ms).when(col(_ENDS_DELETED), col(_MS))
    w_after = w_steps.rowsBetween(1, Window.unboundedFollowing)
    steps = steps.withColumn(
        _NEXT_CLOSE, F.first(closes_previous_at, ignorenulls=True).over(w_after)
    )

    end = (
        F.when(col(_ENDS_DELETED), col(_MS))
        .when(col(_NEXT_CLOSE).isNotNull(), col(_NEXT_CLOSE))
        .otherwise(tmax_literal())
    )
    if with_state:
        whole_key = w_steps.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
        last_opening = F.max(F.when(col(_OPENS), col(_MS))).over(whole_key)
        steps = steps.withColumn(CURRENT, col(_OPENS) & (col(_MS) == last_opening))
        steps = steps.withColumn(
            LAST_EVENT_AT, F.when(col(CURRENT), F.max(col(_MS)).over(whole_key))
        )
    opened = steps.filter(col(_OPENS))
    versions = opened.select(
        *pkc,
        *[F.expr(f"{quote(_IMG)}.{quote(c)} AS {quote(c)}") for c in data_columns],
        col(_MS).alias(START),
        end.alias(END),
        _changed_columns(pk, tracked, maps).alias(CHANGED),
        *([col(CURRENT), col(LAST_EVENT_AT)] if with_state else []),
    )
    return versions.withColumn(ACTIVE, col(END) == tmax_literal())


def fold_order(
    events: DataFrame, primary_key: Sequence[str], data_columns: Sequence[str]
) -> DataFrame:
    """Each event as the fold reads it (docs/HISTORY_MODE.md section 3): its key and data
    cells, what orders a key's events (its commit time truncated to the millisecond, then its
    ``cdc_change_seq``), whether it is a delete, and the columns it leaves unmodified (none
    when null). Every later step orders by these two, never by arrival."""
    from pyspark.sql import functions as F

    return events.select(
        *cols(list(primary_key)),
        *cols(list(data_columns)),
        col(SEQ).alias(_SEQ),
        F.date_trunc("millisecond", col(TS)).alias(_MS),
        (F.upper(col(OP)) == F.lit("DELETE")).alias(_DEL),
        F.coalesce(col(UNMODIFIED), F.array().cast("array<string>")).alias(_UNMOD),
    )


def event_images(
    events: DataFrame,
    primary_key: Sequence[str],
    data_columns: Sequence[str],
    resolve_unmodified: bool = True,
) -> DataFrame:
    """Rule 1 per event (``fold_order``'s rows): its image, a struct of its cells, where a
    cell it leaves unmodified takes the key's latest image before it in (millisecond, seq)
    order (``resolved_cell_sql``); ``resolve_unmodified`` False: the event's own cells."""
    from pyspark.sql import functions as F

    pk = list(primary_key)
    so_far = window_sql(pk, [_MS, _SEQ], RUNNING)
    resolved = [
        f"{resolved_cell_sql(c, _DEL, _UNMOD, so_far) if resolve_unmodified else quote(c)} "
        f"AS {quote(c)}"
        for c in data_columns
    ]
    image = F.expr(f"struct({', '.join(resolved)})" if data_columns else "struct(true AS _)")
    return events.select(*cols(pk), col(_SEQ), col(_MS), col(_DEL), image.alias(_IMG))


def millisecond_steps(events: DataFrame, primary_key: Sequence[str]) -> DataFrame:
    """One step per (key, millisecond) of ``event_images``' rows (rule 1): whether it has a
    non-delete event, whether its last event by seq is a delete (rules 4, 5), and the image
    of its last non-delete event by seq."""
    from pyspark.sql import functions as F

    return events.groupBy(*cols(list(primary_key)), col(_MS)).agg(
        F.max(~col(_DEL)).alias(_HAS_IMAGE),
        F.max_by(col(_DEL), col(_SEQ)).alias(_ENDS_DELETED),
        F.max_by(col(_IMG), F.when(~col(_DEL), col(_SEQ))).alias(_IMG),
    )


def openings(
    steps: DataFrame,
    primary_key: Sequence[str],
    data_columns: Sequence[str],
    history_columns: HistoryColumns = TRACK_ALL,
    maps: frozenset[str] = frozenset(),
) -> DataFrame:
    """Which steps open a version (rules 2, 3), in the key's millisecond order: one with an
    image opens one unless the key was live before it with the same image (in the tracked
    columns; ``maps`` are compared by their sorted entries). With untracked columns, a step
    that opens none belongs to the live version, which takes its last such step's image."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pkc = cols(list(primary_key))
    w_steps = Window.partitionBy(*pkc).orderBy(col(_MS))
    live_after = col(_HAS_IMAGE) & ~col(_ENDS_DELETED)
    steps = steps.withColumn(
        _LIVE_BEFORE, F.coalesce(F.lag(live_after).over(w_steps), F.lit(False))
    )
    steps = steps.withColumn(_PREV_IMG, F.lag(col(_IMG)).over(w_steps))
    tracked = history_columns.tracked(data_columns)
    same_image = _images_equal(quote(_IMG), quote(_PREV_IMG), tracked, maps)
    steps = steps.withColumn(_OPENS, col(_HAS_IMAGE) & ~(col(_LIVE_BEFORE) & same_image))
    if not history_columns.untracked(data_columns):
        return steps
    steps = steps.withColumn(
        _VERSION_NO,
        F.sum(col(_OPENS).cast("int")).over(
            w_steps.rowsBetween(Window.unboundedPreceding, Window.currentRow)
        ),
    )
    in_version = Window.partitionBy(*pkc, col(_VERSION_NO)).orderBy(col(_MS))
    return steps.withColumn(
        _IMG,
        F.last(F.when(col(_HAS_IMAGE), col(_IMG)), ignorenulls=True).over(
            in_version.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
        ),
    )


def _changed_columns(pk: list[str], tracked: Sequence[str], maps: frozenset[str]) -> Column:
    """The tracked columns a version changed from the key's previous one it folds (null for
    the first), as one SQL expression over the opening steps."""
    from pyspark.sql import functions as F

    previous = f"(lag({quote(_IMG)}) OVER ({window_sql(pk, [_MS])}))"
    differing = [
        f"CASE WHEN NOT ({same_sql(f'{quote(_IMG)}.{quote(c)}', f'{previous}.{quote(c)}', c in maps)}) "
        f"THEN {string_sql(c)} END"
        for c in tracked
    ]
    names = (
        f"filter(array({', '.join(differing)}), `_cdc_x` -> `_cdc_x` IS NOT NULL)"
        if differing
        else "CAST(array() AS array<string>)"
    )
    return F.expr(f"CASE WHEN {previous} IS NOT NULL THEN {names} END")


def _images_equal(
    a: str, b: str, data_columns: Sequence[str], maps: frozenset[str] = frozenset()
) -> Column:
    """NULL-safe equality of two images (quoted names of struct columns), column by column
    (``<=>``, never ``=``; ``maps`` by their sorted entries, ``same_sql``), as one SQL
    expression."""
    from pyspark.sql import functions as F

    if not data_columns:
        return F.expr(f"{b} IS NOT NULL")
    return F.expr(
        " AND ".join(
            same_sql(f"{a}.{quote(c)}", f"{b}.{quote(c)}", c in maps) for c in data_columns
        )
    )
