"""Stage 3, gather: the events each key is folded from and the old rows it is compared
against, reading only the files that may hold them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import (
    ACTIVE,
    END,
    LAST_EVENT_AT,
    OP,
    SEQ,
    START,
    TS,
    col,
    cols,
    from_unix_micros,
)
from cdc_platform.lib.history import joins
from cdc_platform.lib.history.merge.classify import EARLIEST_CUT_US, Split, Touched
from cdc_platform.lib.history.merge.columns import (
    CHECKPOINT,
    FILE,
    FORCED,
    MIN_MS,
    REPLAY_SEQ,
    SLOW,
)
from cdc_platform.lib.history.merge.snapshot import Attempt
from cdc_platform.lib.history.versions import dedupe_events
from cdc_platform.lib.storage import delta

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


@dataclass(frozen=True)
class Gathered:
    """What the fold reads: the events of every key and the old rows it compares against."""

    events: DataFrame
    old: DataFrame  # the old rows that may change, with ``FILE``
    old_rows: int | None
    closed_read: list[delta.DataFile]
    log_read: list[delta.DataFile]
    checkpoints: DataFrame | None  # each slow key's ``CHECKPOINT`` (``_slow_events``)
    version_rows: int | None  # bound on the versions the fold makes
    probe: int | None  # ``version_rows`` when the run's rows are tiny (joins among them shuffle)


def gather_rows(a: Attempt, t: Touched, s: Split) -> Gathered:
    """The events to fold and the old rows to compare with. A fast key's events are its
    pending ones after its current row (or delete-only record) replayed (``_state_events``);
    a slow key's are read back from the change log (``_slow_events``), with its closed rows
    that may change (those ending at or after the cut) among the old rows."""
    pk = a.pk

    def fast(df: DataFrame) -> DataFrame:
        return joins.restrict(df, s.fast_keys, pk, s.fast_count, s.fast_values)

    # With no slow key (a first load, an hour of new keys) the touched keys' events and
    # current rows are all the fast path's: no join to restrict them.
    fast_events, fast_current = (
        (fast(t.events), fast(t.current)) if s.slow_count else (t.events, t.current)
    )
    events = fast_events.unionByName(
        _state_events(fast_current, pk, a.data_columns), allowMissingColumns=True
    ).unionByName(_ghost_events(fast(t.unversioned_touched), pk), allowMissingColumns=True)
    old = t.current.select(*cols([*a.columns, FILE]))
    closed_read: list[delta.DataFile] = []
    if s.slow_count:
        closed_read = [
            f
            for f in _files_maybe_holding(a.closed_files, pk, s.slow_values)
            if _may_reach(f, END, s.cut)
        ]
    if closed_read:  # read once: checkpoints, comparison and carried rows use it
        closed = _read_closed(a, s, closed_read).select(*cols([*a.columns, FILE]))
        old = a.keep(old.unionByName(closed))
    old_rows = joins.add(t.current_rows, joins.records(closed_read))
    log_read: list[delta.DataFile] = []
    checkpoints = None
    if s.slow_count:
        held = old_rows if t.tiny is not None else None
        slow_events, log_read, checkpoints, old = _slow_events(a, s, old, held)
        events = events.unionByName(slow_events, allowMissingColumns=True)
    # Versions come from events: the pending ones, up to two replayed per current row and one
    # per delete-only key, the change-log events and old rows of slow keys.
    version_rows = joins.add(
        joins.records(a.pending),
        t.current_rows,
        t.current_rows,
        s.affected,
        joins.records(log_read),
        old_rows,
    )
    if a.small or s.slow_count:
        # Read twice (the keys' versions, and their last events for the side table): computed
        # once. A large run without slow keys recomputes only a union over its kept events.
        events = a.keep(events)
    return Gathered(
        events=events,
        old=old,
        old_rows=old_rows,
        closed_read=closed_read,
        log_read=log_read,
        checkpoints=checkpoints,
        version_rows=version_rows,
        probe=version_rows if t.tiny is not None else None,
    )


def _slow_events(
    a: Attempt, s: Split, old: DataFrame, old_rows: int | None
) -> tuple[DataFrame, list[delta.DataFile], DataFrame, DataFrame]:
    """The events the slow keys are refolded from, the change-log files read for them, each
    slow key's ``CHECKPOINT`` (null: refolded from its first event) and ``old`` without the
    versions before the checkpoints.

    A slow key is refolded from its checkpoint: the latest version this run read (``old``:
    the current row and the closed rows ending at or after ``cut``) that started before the
    key's earliest pending event (the version that event falls in, or the deleted version
    before it). The versions before it cannot change (``unchanged_before``); the version itself,
    replayed as an insert sorting before every event of its millisecond, stands for the key's
    past; the events logged from its start on do the rest (the start's own events are folded
    again, they give the same image). So a late key reads the change log back to its
    checkpoint, not to its first event, and change-log files whose events all came earlier
    are skipped. Retracted keys, a table recomputed whole, keys without such
    a version and tables with untracked columns (a version's stored image is that of its last
    step, so it cannot stand for its first) are refolded from all their events.

    ``old_rows`` bounds ``old``'s when a small run read it by key (joins of two tiny sides are
    shuffles), as the Delta statistics of the change-log files read bound the events'; the
    slow keys' count bounds theirs (``lib.history.joins``: broadcast only when small).
    """
    from pyspark.sql import functions as F

    pk, slow_values, slow_rows = a.pk, s.slow_values, s.slow_count
    checkpoints, since = _checkpoints(a, s, old, old_rows)
    # Key statistics skip files holding no slow key (compacted files are key-sorted), time
    # statistics those logged entirely before every checkpoint.
    log_read = [
        f for f in _files_maybe_holding(a.log.files, pk, slow_values) if _may_reach(f, TS, since)
    ]
    log = a.log.read(a.spark, log_read)
    if slow_values is not None:  # held: the events of other keys never reach the join
        log = log.filter(joins.in_keys(pk, slow_values))
    logged = (
        dedupe_events(log, pk)
        .join(
            joins.build_side(
                checkpoints, slow_rows, joins.records(log_read) if old_rows is not None else None
            ),
            pk,
            "inner",
        )
        .filter(
            col(CHECKPOINT).isNull() | (F.date_trunc("millisecond", col(TS)) >= col(CHECKPOINT))
        )
        .drop(CHECKPOINT)
    )
    replayed = (
        old.join(joins.build_side(checkpoints, slow_rows, old_rows), pk, "inner")
        .filter(col(START) == col(CHECKPOINT))
        .select(
            *cols([*pk, *a.data_columns]),
            F.lit("INSERT").alias(OP),
            F.lit(REPLAY_SEQ).cast("long").alias(SEQ),
            col(START).alias(TS),
        )
    )
    # Versions before a checkpoint are not refolded: they stay where they are, as they are.
    from_checkpoint = (
        old.join(joins.build_side(checkpoints, slow_rows, old_rows), pk, "left")
        .filter(col(CHECKPOINT).isNull() | (col(START) >= col(CHECKPOINT)))
        .drop(CHECKPOINT)
    )
    events = logged.unionByName(replayed, allowMissingColumns=True)
    return events, log_read, checkpoints, from_checkpoint


def _checkpoints(
    a: Attempt, s: Split, old: DataFrame, old_rows: int | None
) -> tuple[DataFrame, datetime | None]:
    """Each slow key's ``CHECKPOINT`` (``_slow_events``), and the earliest of them when every
    key has one (None: some key is refolded from its first event), which bounds the change-log
    files read by time."""
    from pyspark.sql import functions as F

    pk, keys, cut, slow_rows = a.pk, s.keys, s.cut, s.slow_count
    untracked = bool(a.history_columns.untracked(a.data_columns))

    slow = (
        keys.filter(col(SLOW))
        .groupBy(*cols(pk))
        .agg(F.min(col(MIN_MS)).alias(MIN_MS), F.max(col(FORCED)).alias(FORCED))
    )
    since: datetime | None = None
    if cut is None:
        checkpoints = slow.select(*cols(pk), F.lit(None).cast("timestamp").alias(CHECKPOINT))
    else:
        last_before = (
            old.join(
                joins.build_side(slow.select(*cols([*pk, MIN_MS])), slow_rows, old_rows),
                pk,
                "inner",
            )
            .groupBy(*cols(pk))
            .agg(F.max(F.when(col(START) < col(MIN_MS), col(START))).alias(CHECKPOINT))
        )
        usable = ~col(FORCED)
        if untracked:  # the stored image is the version's last step's, not its first's
            usable = F.lit(False)
        checkpoints = slow.join(
            joins.build_side(last_before, slow_rows, slow_rows if old_rows else None), pk, "left"
        ).select(*cols(pk), F.when(usable, col(CHECKPOINT)).alias(CHECKPOINT))
        bounds = checkpoints.agg(
            F.min(F.unix_micros(col(CHECKPOINT))).alias("since"),
            F.max(col(CHECKPOINT).isNull().cast("int")).alias("from_first"),
        ).collect()[0]
        if not bounds["from_first"] and bounds["since"] > EARLIEST_CUT_US:
            since = from_unix_micros(bounds["since"])
    return checkpoints, since


def _read_closed(a: Attempt, s: Split, files: Sequence[delta.DataFile]) -> DataFrame:
    """The slow keys' rows in closed history ``files``: a filter when their values are held."""
    if s.slow_values is not None:
        return a.read_history(files, joins.in_keys(a.pk, s.slow_values))
    return a.read_history(files).join(
        joins.build_side(s.slow_keys, s.slow_count), a.pk, "left_semi"
    )


def _as_utc(t: datetime) -> datetime:
    """A Delta statistic as an aware time (delta-rs gives UTC, naive or not)."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


def _may_reach(f: delta.DataFile, column: str, bound: datetime | None) -> bool:
    """Whether a file may hold a ``column`` value at or after ``bound``, by its statistics: a
    closed history file a version ending then (``END``), a change-log file an event (``TS``)."""
    last = f.max_values.get(column)
    if bound is None or not isinstance(last, datetime):
        return True  # no bound, or no usable statistic: it may hold anything
    return _as_utc(last) >= bound - timedelta(milliseconds=1)  # statistics may be truncated


def _files_maybe_holding(
    files: Sequence[delta.DataFile], pk: list[str], values: list[Any] | None
) -> list[delta.DataFile]:
    """``files`` but those whose min/max statistics of the key exclude every value."""
    if values is None:
        return list(files)
    kept = []
    for f in files:
        lo, hi = f.min_values.get(pk[0]), f.max_values.get(pk[0])
        if lo is None or hi is None or type(lo) is not type(values[0]):
            kept.append(f)  # no usable bounds: it may hold any key
            continue
        i = bisect.bisect_left(values, lo)
        if i < len(values) and values[i] <= hi:
            kept.append(f)
    return kept


def _state_events(current: DataFrame, pk: list[str], data_columns: list[str]) -> DataFrame:
    """Events that replay a key's current row: the fold then continues from exactly there.

    A live row becomes an insert at its start (plus a no-op update at its last event, so the
    fold still knows when the key last changed); a deleted key's row becomes an insert at its
    start and a delete at its end (rule 5's start = end included: the delete sorts after).
    Every real pending event of a fast key is later, so these never interleave with them.
    """
    from pyspark.sql import functions as F

    def event(rows: DataFrame, op: str, at: Column, seq: int) -> DataFrame:
        image = cols(data_columns) if op != "DELETE" else []  # a delete carries only its key
        return rows.select(
            *cols(pk), *image, F.lit(op).alias(OP), F.lit(seq).cast("long").alias(SEQ), at.alias(TS)
        )

    live, dead = current.filter(col(ACTIVE)), current.filter(~col(ACTIVE))
    return (
        event(current, "INSERT", col(START), 0)
        .unionByName(
            event(live.filter(col(LAST_EVENT_AT) > col(START)), "UPDATE", col(LAST_EVENT_AT), 1)
        )
        .unionByName(event(dead, "DELETE", col(END), 1), allowMissingColumns=True)
        .unionByName(
            event(dead.filter(col(LAST_EVENT_AT) > col(END)), "DELETE", col(LAST_EVENT_AT), 2),
            allowMissingColumns=True,
        )
    )


def _ghost_events(unversioned: DataFrame, pk: list[str]) -> DataFrame:
    """A delete-only key's past, for the fold: one delete at its last event."""
    from pyspark.sql import functions as F

    return unversioned.select(
        *cols(pk),
        F.lit("DELETE").alias(OP),
        F.lit(0).cast("long").alias(SEQ),
        col(LAST_EVENT_AT).alias(TS),
    )
