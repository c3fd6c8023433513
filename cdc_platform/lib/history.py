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
from datetime import UTC, datetime
from functools import reduce
from typing import TYPE_CHECKING

from cdc_platform.lib.reading import OP, SEQ, SOURCE_FILE, SOURCE_ROW, TS, UNMODIFIED

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

START = "_fivetran_start"
END = "_fivetran_end"
ACTIVE = "_fivetran_active"
SYNCED = "_fivetran_synced"
SYSTEM_COLUMNS = (START, END, ACTIVE, SYNCED)
TMAX = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
INGESTED_AT = "_cdc_ingested_at"


def tmax_literal() -> Column:
    from pyspark.sql import functions as F

    return F.lit("9999-12-31 23:59:59.999").cast("timestamp")


def dedupe_events(events: DataFrame, primary_key: Sequence[str]) -> DataFrame:
    """Count each (key, cdc_change_seq) once; the first copy to land wins, deterministically."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = [
        F.col(c).asc_nulls_last()
        for c in (INGESTED_AT, SOURCE_FILE, SOURCE_ROW)
        if c in events.columns
    ]
    w = (
        Window.partitionBy(*primary_key, SEQ).orderBy(*order)
        if order
        else Window.partitionBy(*primary_key, SEQ).orderBy(SEQ)
    )
    return events.withColumn("_rn", F.row_number().over(w)).filter("_rn = 1").drop("_rn")


def build_versions(
    events: DataFrame, primary_key: Sequence[str], data_columns: Sequence[str]
) -> DataFrame:
    """Every version of every key in ``events``: key, data columns, start, end, active.

    ``events`` must hold *all* events of the keys it covers (order does not matter).
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pk = list(primary_key)
    ev = dedupe_events(events, pk).select(
        *pk,
        *data_columns,
        F.col(SEQ).alias("_seq"),
        F.date_trunc("millisecond", F.col(TS)).alias("_ms"),
        (F.upper(F.col(OP)) == F.lit("DELETE")).alias("_del"),
        F.coalesce(F.col(UNMODIFIED), F.array().cast("array<string>")).alias("_unmod"),
    )

    # Rule 1: resolve unmodified cells against the key's last image (deletes carry no image).
    w_events = (
        Window.partitionBy(*pk)
        .orderBy("_ms", "_seq")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    resolved = []
    for c in data_columns:
        known = F.when(
            ~F.col("_del") & ~F.array_contains("_unmod", c), F.struct(F.col(c).alias("v"))
        )
        resolved.append(F.last(known, ignorenulls=True).over(w_events).getField("v").alias(c))
    image = F.struct(*resolved) if data_columns else F.struct(F.lit(True).alias("_"))
    ev = ev.select(*pk, "_seq", "_ms", "_del", image.alias("_img"))

    # One step per (key, millisecond).
    steps = ev.groupBy(*pk, "_ms").agg(
        F.max(~F.col("_del")).alias("_has_image"),
        F.max_by("_del", "_seq").alias("_ends_deleted"),
        F.max_by("_img", F.when(~F.col("_del"), F.col("_seq"))).alias("_img"),
    )

    w_steps = Window.partitionBy(*pk).orderBy("_ms")
    live_after = F.col("_has_image") & ~F.col("_ends_deleted")
    steps = steps.withColumn(
        "_live_before", F.coalesce(F.lag(live_after).over(w_steps), F.lit(False))
    )
    steps = steps.withColumn("_prev_img", F.lag("_img").over(w_steps))
    same_image = _images_equal(F.col("_img"), F.col("_prev_img"), data_columns)
    steps = steps.withColumn("_opens", F.col("_has_image") & ~(F.col("_live_before") & same_image))

    one_ms = F.expr("INTERVAL 1 MILLISECOND")
    closes_previous_at = F.when(F.col("_opens"), F.col("_ms") - one_ms).when(
        F.col("_ends_deleted"), F.col("_ms")
    )
    w_after = w_steps.rowsBetween(1, Window.unboundedFollowing)
    steps = steps.withColumn(
        "_next_close", F.first(closes_previous_at, ignorenulls=True).over(w_after)
    )

    end = (
        F.when(F.col("_ends_deleted"), F.col("_ms"))
        .when(F.col("_next_close").isNotNull(), F.col("_next_close"))
        .otherwise(tmax_literal())
    )
    versions = steps.filter("_opens").select(
        *pk,
        *[F.col("_img").getField(c).alias(c) for c in data_columns],
        F.col("_ms").alias(START),
        end.alias(END),
    )
    return versions.withColumn(ACTIVE, F.col(END) == tmax_literal())


def _images_equal(a: Column, b: Column, data_columns: Sequence[str]) -> Column:
    """NULL-safe equality of two images, column by column (``<=>``, never ``=``)."""

    if not data_columns:
        return b.isNotNull()
    return reduce(
        lambda x, y: x & y, [a.getField(c).eqNullSafe(b.getField(c)) for c in data_columns]
    )
