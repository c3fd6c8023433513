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
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGED,
    END,
    INGESTED_AT,
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
    col,
    cols,
    internal,
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
    "build_versions",
    "dedupe_events",
    "tmax_literal",
]

# The fold's working columns: under the internal prefix, so never a source column's name.
_RN = internal("rn")
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


def tmax_literal() -> Column:
    from pyspark.sql import functions as F

    return F.lit(TMAX_SQL).cast("timestamp")


def dedupe_events(events: DataFrame, primary_key: Sequence[str]) -> DataFrame:
    """Count each (key, cdc_change_seq) once; the first copy to land wins, deterministically."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = cols(list(primary_key))
    order = [
        col(c).asc_nulls_last()
        for c in (INGESTED_AT, SOURCE_FILE, SOURCE_ROW)
        if c in events.columns
    ]
    w = Window.partitionBy(*pk, col(SEQ)).orderBy(*(order or [col(SEQ)]))
    return events.withColumn(_RN, F.row_number().over(w)).filter(col(_RN) == 1).drop(_RN)


def build_versions(
    events: DataFrame,
    primary_key: Sequence[str],
    data_columns: Sequence[str],
    deduplicated: bool = False,
) -> DataFrame:
    """Every version of every key in ``events``: key, data columns, start, end, active, and
    ``_cdc_changed_columns`` (the data columns whose value differs, ``<=>``, from the key's
    previous version; null for the first version of a key in ``events``).

    ``events`` must hold *all* events of the keys it covers (order does not matter). Column
    names are used verbatim (quoted), and the working columns live under the internal prefix,
    so a source column called ``_seq``, ``a.b`` or ``a`b`` is just data. Images are compared
    with ``<=>``, which every supported column type allows (maps are set aside on reading).
    ``deduplicated`` says each ``(key, cdc_change_seq)`` is there once already.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = list(primary_key)
    pkc = cols(pk)
    ev = (events if deduplicated else dedupe_events(events, pk)).select(
        *pkc,
        *cols(list(data_columns)),
        col(SEQ).alias(_SEQ),
        F.date_trunc("millisecond", col(TS)).alias(_MS),
        (F.upper(col(OP)) == F.lit("DELETE")).alias(_DEL),
        F.coalesce(col(UNMODIFIED), F.array().cast("array<string>")).alias(_UNMOD),
    )

    # Rule 1: resolve unmodified cells against the key's last image (deletes carry no image).
    w_events = (
        Window.partitionBy(*pkc)
        .orderBy(col(_MS), col(_SEQ))
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    resolved = []
    for c in data_columns:
        known = F.when(
            ~col(_DEL) & ~F.array_contains(col(_UNMOD), F.lit(c)), F.struct(col(c).alias("v"))
        )
        resolved.append(F.last(known, ignorenulls=True).over(w_events).getField("v").alias(c))
    image = F.struct(*resolved) if data_columns else F.struct(F.lit(True).alias("_"))
    ev = ev.select(*pkc, col(_SEQ), col(_MS), col(_DEL), image.alias(_IMG))

    # One step per (key, millisecond).
    steps = ev.groupBy(*pkc, col(_MS)).agg(
        F.max(~col(_DEL)).alias(_HAS_IMAGE),
        F.max_by(col(_DEL), col(_SEQ)).alias(_ENDS_DELETED),
        F.max_by(col(_IMG), F.when(~col(_DEL), col(_SEQ))).alias(_IMG),
    )

    w_steps = Window.partitionBy(*pkc).orderBy(col(_MS))
    live_after = col(_HAS_IMAGE) & ~col(_ENDS_DELETED)
    steps = steps.withColumn(
        _LIVE_BEFORE, F.coalesce(F.lag(live_after).over(w_steps), F.lit(False))
    )
    steps = steps.withColumn(_PREV_IMG, F.lag(col(_IMG)).over(w_steps))
    same_image = _images_equal(col(_IMG), col(_PREV_IMG), data_columns)
    steps = steps.withColumn(_OPENS, col(_HAS_IMAGE) & ~(col(_LIVE_BEFORE) & same_image))

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
    opened = steps.filter(col(_OPENS))
    # Which columns differ from the key's previous version (null for the first one it folds).
    previous = F.lag(col(_IMG)).over(Window.partitionBy(*pkc).orderBy(col(_MS)))
    differing = [
        F.when(~col(_IMG).getField(c).eqNullSafe(previous.getField(c)), F.lit(c))
        for c in data_columns
    ]
    changed = F.when(
        previous.isNotNull(),
        F.filter(F.array(*differing), lambda name: name.isNotNull())
        if differing
        else F.array().cast("array<string>"),
    )
    versions = opened.select(
        *pkc,
        *[col(_IMG).getField(c).alias(c) for c in data_columns],
        col(_MS).alias(START),
        end.alias(END),
        changed.alias(CHANGED),
    )
    return versions.withColumn(ACTIVE, col(END) == tmax_literal())


def _images_equal(a: Column, b: Column, data_columns: Sequence[str]) -> Column:
    """NULL-safe equality of two images, column by column (``<=>``, never ``=``)."""

    if not data_columns:
        return b.isNotNull()
    return reduce(
        lambda x, y: x & y, [a.getField(c).eqNullSafe(b.getField(c)) for c in data_columns]
    )
