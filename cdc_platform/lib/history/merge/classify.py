"""Stage 2, classify: the keys with pending events, each to the fast path (folded from
its current row) or the slow path (a late event: refolded from the change log; rule 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import (
    CURRENT,
    LAST_EVENT_AT,
    TS,
    UNMODIFIED,
    col,
    cols,
    from_unix_micros,
    internal,
    unix_micros,
)
from cdc_platform.lib.history import joins
from cdc_platform.lib.history.merge.columns import DELETE_ONLY, FORCED, MARKED, MIN_MS, SLOW
from cdc_platform.lib.history.merge.side_tables import read_delete_only_keys
from cdc_platform.lib.history.merge.snapshot import Attempt
from cdc_platform.lib.history.versions import dedupe_events

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class Touched:
    """The keys with pending events (or retracted), and the rows the fast path folds from."""

    events: DataFrame  # the pending events, deduplicated (rule 2)
    keys: DataFrame  # each key with its earliest pending millisecond and whether it is forced
    values: list[Any] | None  # the keys, held on the driver (a small run's)
    current: DataFrame  # their current rows, with ``FILE``
    current_rows: int | None
    unversioned: DataFrame  # every delete-only key
    unversioned_rows: int | None
    unversioned_touched: DataFrame  # the run's delete-only keys
    side_stale: bool  # the delete-only side table missed the last commit (a crash)
    tiny: int | None  # bound on the key rows when they are held: joins among them shuffle


@dataclass(frozen=True)
class Split:
    """The run's keys split into the fast path and the slow path (``_classify``)."""

    keys: DataFrame  # every touched key with ``SLOW`` and ``DELETE_ONLY`` (may repeat one)
    affected: int
    slow_count: int
    delete_only_touched: int
    cut: datetime | None  # versions ending before it cannot change (``unchanged_before``)
    slow_keys: DataFrame
    fast_keys: DataFrame
    slow_values: list[Any] | None
    fast_values: list[Any] | None
    resolve_unmodified: bool  # may an event to fold carry an unmodified marker (rule 1)?

    @property
    def fast_count(self) -> int:
        return self.affected - self.slow_count


def touch_keys(a: Attempt) -> Touched:
    """The keys this run recomputes (those with pending events, and retracted keys whatever
    their events say) and their current rows and delete-only records. A small run holds its
    keys on the driver (one Spark job): each read by key is then a filter, and the joins
    between what those reads give are shuffles inside one job."""
    from pyspark.sql import functions as F

    pk = a.pk
    events = dedupe_events(a.log.read(a.spark, a.pending), pk)
    if not a.small:  # read and sorted once for the keys, their last events and the fold
        events = a.keep(events)
    ms = F.date_trunc("millisecond", col(TS))
    marked = F.coalesce(F.size(col(UNMODIFIED)) > 0, F.lit(False))
    keys = events.select(
        *cols(pk), ms.alias(MIN_MS), F.lit(False).alias(FORCED), marked.alias(MARKED)
    )
    if a.retracted is not None:
        no_time = F.lit(None).cast("timestamp").alias(MIN_MS)
        keys = keys.unionByName(
            a.retracted.select(
                *cols(pk), no_time, F.lit(True).alias(FORCED), F.lit(False).alias(MARKED)
            )
        )
    keys = a.keep(
        keys.groupBy(*cols(pk)).agg(
            F.min(MIN_MS).alias(MIN_MS),
            F.max(FORCED).alias(FORCED),
            F.max(MARKED).alias(MARKED),
        )
    )
    touched_rows = a.touched_rows
    values = joins.key_values(keys, pk, touched_rows)
    # The live and deleted segments hold one row per key: at most one per touched key.
    one_per_key = all(f.min_values.get(CURRENT) is True for f in a.current_files)
    current_rows = joins.smallest(
        joins.records(a.current_files), touched_rows if one_per_key else None
    )
    if values is not None:
        current = a.read_history(a.current_files, joins.in_keys(pk, values))
    else:
        current = a.read_history(a.current_files).join(
            joins.build_side(keys.select(*cols(pk)), touched_rows), pk, "left_semi"
        )
    side_stale = a.snap.delete_only_keys_stale
    unversioned, unversioned_rows = read_delete_only_keys(a.spark, pk, a.snap)
    return Touched(
        events=events,
        keys=keys,
        values=values,
        current=a.keep(current),
        current_rows=current_rows,
        unversioned=unversioned,
        unversioned_rows=unversioned_rows,
        unversioned_touched=unversioned
        if values is None
        else unversioned.filter(joins.in_keys(pk, values)),
        side_stale=side_stale,
        tiny=touched_rows if values is not None else None,
    )


def split_keys(a: Attempt, t: Touched) -> Split:
    """Classify the keys fast or slow and count them, in one Spark job; the earliest late
    event gives the time before which nothing changes (``unchanged_before``)."""
    from pyspark.sql import functions as F

    pk = a.pk
    keys = a.keep(
        _classify(
            t.keys,
            t.current,
            t.unversioned_touched,
            pk,
            slow_everything=a.snap.rebuild,
            rows=(t.current_rows, t.unversioned_rows),
            tiny=t.tiny,
        )
    )
    slow_set = (
        [F.collect_set(F.when(col(SLOW), col(pk[0]))).alias("slow_values")]
        if t.values is not None
        else []
    )
    counts = keys.agg(
        F.count(F.lit(1)).alias("n"),
        F.sum(col(SLOW).cast("int")).alias("slow"),
        F.sum(col(DELETE_ONLY).cast("int")).alias("delete_only"),
        F.min(F.when(col(SLOW), F.unix_micros(col(MIN_MS)))).alias("earliest_late"),
        F.max((col(SLOW) & (col(FORCED) | col(MIN_MS).isNull())).cast("int")).alias("unbounded"),
        F.max(col(MARKED).cast("int")).alias("marked"),
        *slow_set,
    ).collect()[0]  # a global aggregate: exactly one row
    affected, slow_count = int(counts["n"]), int(counts["slow"] or 0)
    slow_keys = keys.filter(col(SLOW)).select(*cols(pk))
    slow_values = fast_values = None
    if t.values is not None:  # held: the classification's own collect
        slow_values = sorted(counts["slow_values"])
        fast_values = sorted(set(t.values) - set(slow_values))
    elif slow_count:
        slow_values = joins.key_values(slow_keys, pk, slow_count)
    return Split(
        keys=keys,
        affected=affected,
        slow_count=slow_count,
        delete_only_touched=int(counts["delete_only"] or 0),
        cut=None
        if a.snap.rebuild or counts["unbounded"]
        else unchanged_before(counts["earliest_late"]),
        slow_keys=slow_keys,
        # A key that repeats in ``keys`` is slow if any of its rows is.
        fast_keys=keys.groupBy(*cols(pk))
        .agg(F.max(col(SLOW)).alias(SLOW))
        .filter(~col(SLOW))
        .select(*cols(pk)),
        slow_values=slow_values,
        fast_values=fast_values,
        # A slow key is refolded from logged events, which may carry markers.
        resolve_unmodified=bool(slow_count or counts["marked"]),
    )


# Below this (one second after 0001-01-01) no time bound is used: subtracting from it overflows.
EARLIEST_CUT_US = unix_micros(datetime(1, 1, 1, 0, 0, 1, tzinfo=UTC))


def unchanged_before(earliest_late: int | None) -> datetime | None:
    """The time before which no version of a recomputed key can change.

    A late event at millisecond m refolds steps from m on; a version ending before m - 1 ms was
    closed by a step before m (a new version at its end + 1 ms, or a delete at its end) and
    every step inside it is earlier too, so it comes out as it was. Versions ending at or after
    the cut are read and compared; the closed files that end before it are not opened.
    """
    if earliest_late is None or earliest_late <= EARLIEST_CUT_US:
        return None  # at the dawn of time (an adopted soft delete): no cut
    return from_unix_micros(earliest_late) - timedelta(milliseconds=1)


def _classify(
    touched: DataFrame,
    current: DataFrame,
    unversioned: DataFrame,
    pk: list[str],
    slow_everything: bool,
    rows: tuple[int | None, int | None] = (None, None),
    tiny: int | None = None,
) -> DataFrame:
    """Each touched key with ``SLOW``: must it be recomputed from all its events?

    Fast means every pending event is later than anything the key received before, so its
    current row (or its delete-only record) is all the past the fold needs. A retracted key
    (``FORCED``) is slow: its current row may stand for events that are gone. ``rows`` bounds
    the rows of ``current`` and ``unversioned`` (``lib.history.joins``: broadcast only when small),
    ``tiny`` those of all three when a small run read them by key (then they are shuffled).
    """
    from pyspark.sql import functions as F

    if slow_everything:
        return touched.select(
            *cols([*pk, MIN_MS, FORCED, MARKED]),
            F.lit(True).alias(SLOW),
            F.lit(False).alias(DELETE_ONLY),
        )
    last = current.select(*cols(pk), col(LAST_EVENT_AT).alias(internal("last")))
    ghost_last = unversioned.select(*cols(pk), col(LAST_EVENT_AT).alias(internal("ghost_last")))
    joined = touched.join(joins.build_side(last, rows[0], tiny), pk, "left").join(
        joins.build_side(ghost_last, rows[1], tiny), pk, "left"
    )
    # A key with no current row and no delete-only record never had an event: fast.
    slow = col(MIN_MS) <= F.coalesce(col(internal("last")), col(internal("ghost_last")))
    return joined.select(
        *cols([*pk, MIN_MS, FORCED, MARKED]),
        (col(FORCED) | F.coalesce(slow, F.lit(False))).alias(SLOW),
        col(internal("ghost_last")).isNotNull().alias(DELETE_ONLY),
    )
