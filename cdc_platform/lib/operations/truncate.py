"""Truncating a history table, as Fivetran's ``Truncate`` does (``before`` T, soft or hard).

The history table stays a fold of its change log, so a truncate is written there:

* **soft** closes every live version written before T (``_fivetran_synced < T``) at T. Each
  such key gets a synthetic ``DELETE`` event at T in the change log, and the merge applies it
  like any delete (rule 4: ``_fivetran_end`` = T, ``_fivetran_active`` = false). The events name
  their origin in ``_cdc_source_file`` (``truncate:before=<T>``) and carry
  ``cdc_change_seq`` = -T in epoch milliseconds: a real event of the same millisecond sorts
  after the truncate and wins, and the same truncate run twice logs nothing new. A later event
  of a closed key re-opens it; a late event older than T lands before the delete.
* **hard** removes every key whose latest version (live or deleted) was written before T, with
  all its versions, and its events from the change log, as an un-apply does: the removal is
  recorded, then the merge recomputes those keys and finds nothing left. Keys with no version
  (every event a delete) go too. Delta time travel keeps the rows that were there.

The table is brought up to date with its change log first, so T is compared with what every
logged event made of it. A table that does not exist yet is not an error: nothing happens.
Each step is one Delta commit that a crash leaves whole or absent; the next run (or the same
truncate again) finishes the work.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import (
    ACTIVE,
    CURRENT,
    INGESTED_AT,
    OP,
    SEQ,
    SOURCE_FILE,
    SYNCED,
    TS,
    col,
    cols,
    internal,
    timestamp_lit,
)
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history.merge import MergeResult, is_closed_file
from cdc_platform.lib.history.table import Change, HistoryTable
from cdc_platform.lib.ledgers import revoked_files
from cdc_platform.lib.operations.operation import Request, hour_start, to_ms
from cdc_platform.lib.storage.table import Table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SOURCE_PREFIX = "truncate:before="
_OLD = internal("written_before")
_LOGGED = internal("last_logged")
_GOES = internal("goes")
TRUNCATE = "truncate_table"


@dataclass(frozen=True)
class TruncateRequest(Request):
    """Truncate what was written before ``before`` (None: everything up to the catch-up),
    soft (close the live versions) or hard (remove the keys)."""

    before: datetime | None = None
    soft: bool = True


@dataclass(frozen=True)
class TruncateResult:
    before: datetime
    soft: bool
    keys: int  # keys closed (soft) or removed (hard) by this call; 0 on a replay
    events_logged: int  # soft: synthetic deletes added to the change log
    events_removed: int  # hard: events taken out of the change log
    merge: MergeResult
    changed: bool  # False: no table yet, nothing to truncate

    def summary(self) -> str:
        if not self.changed:
            return "no table yet, nothing to truncate"
        kind, done = ("soft", "closed") if self.soft else ("hard", "removed")
        return (
            f"{kind} truncate before {self.before.isoformat()}: {self.keys} key(s) {done}, "
            f"history version {self.merge.history_version}"
        )

    def metadata(self) -> dict[str, Any]:
        return {
            "operation": TRUNCATE,
            "before": self.before.isoformat(),
            "soft": self.soft,
            f"keys_{'closed' if self.soft else 'removed'}": self.keys,
            "events_logged": self.events_logged,
            "events_removed": self.events_removed,
            **self.merge.metadata(),
        }

    @property
    def hours(self) -> tuple[datetime, ...]:
        return (hour_start(self.before),)


def source_name(before: datetime) -> str:
    """What ``_cdc_source_file`` says of a soft truncate's events (un-apply accepts it)."""
    return SOURCE_PREFIX + to_ms(before).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def truncate_seq(before: datetime) -> int:
    """The ``cdc_change_seq`` of a soft truncate's deletes: below every real seq of its ms."""
    return -int(to_ms(before).timestamp() * 1000)


def truncate(t: HistoryTable, request: TruncateRequest) -> TruncateResult:
    """Truncate the table before ``request.before`` (see the module docstring).

    Without ``before``, T is the millisecond after the catch-up merge: every row written so far
    counts as written before it, the ones that merge just wrote included. A ``before`` later
    than ``now`` is refused: it would close or remove what events logged later still write.
    """
    now, soft = request.now, request.soft
    before = _checked_before(request.before, now)
    if not t.changelog.exists:
        return TruncateResult(before, soft, 0, 0, 0, MergeResult(), changed=False)
    if soft:
        # A re-run after its events were un-applied logs them again (the user asks for it).
        revoked_files.remove(t.paths.revoked_files, [source_name(before)])
        (keys, logged), merge = t.change(now, partial(_close_live, before=before), "soft truncate")
        return TruncateResult(before, soft, keys, logged, 0, merge, changed=True)
    (removed, keys), merge = t.change(now, partial(_remove_keys, before=before), "hard truncate")
    return TruncateResult(before, soft, keys, 0, removed, merge, changed=True)


def _checked_before(before: datetime | None, now: datetime) -> datetime:
    """T as given, to the millisecond; the millisecond after ``now`` when not given."""
    if before is None:
        return now + timedelta(milliseconds=1)
    if before.tzinfo is None:
        raise Refusal(f"truncate before {before.isoformat()}: give a time zone (or Z for UTC)")
    if before.year < 1971:
        raise Refusal(f"truncate before {before.isoformat()}: a time after 1970 is expected")
    before = to_ms(before)
    if before > now + timedelta(milliseconds=1):
        raise Refusal(
            f"truncate before {before.isoformat()}: that is in the future (now is "
            f"{now.isoformat()}); give a time that has passed, or none for now"
        )
    return before


def _latest_rows(t: HistoryTable) -> DataFrame | None:
    """Each key's latest version (live or deleted), read from the live and deleted files only;
    None when the table has no history yet."""
    files = [f for f in t.history.files if not is_closed_file(f)]
    if not files:
        return None
    return t.history.read(t.spark, files, where=col(CURRENT))


def _close_live(c: Change, before: datetime) -> tuple[int, int]:
    """Log a delete at ``before`` for every key live and written before it, decided on the
    version the table has caught up with (a crash may have left events logged but not
    merged); returns (keys, events new to the log)."""
    latest = _latest_rows(c.table)
    closing = (
        None
        if latest is None
        else latest.filter(col(ACTIVE) & (col(SYNCED) < timestamp_lit(before)))
    )
    return _log_deletes(c, closing, before)


def _log_deletes(c: Change, rows: DataFrame | None, before: datetime) -> tuple[int, int]:
    """Append a delete at ``before`` for the key of each of ``rows``, fenced on the version the
    keys were decided on; returns (keys, events new to the log). The events have every
    change-log column (null where a delete has no value)."""
    from pyspark.sql import functions as F

    count = 0 if rows is None else rows.count()
    if rows is None or not count or c.log is None:
        return 0, 0
    pk = c.table.key
    seq = truncate_seq(before)
    given = {
        OP: F.lit("DELETE"),
        SEQ: F.lit(seq),
        TS: timestamp_lit(before),
        SOURCE_FILE: F.lit(source_name(before)),
    }
    events = rows.select(
        *[
            (col(f.name) if f.name in pk else given.get(f.name, F.lit(None)))
            .cast(f.dataType)
            .alias(f.name)
            for f in c.log.spark_schema.fields
        ]
    )
    return count, c.append(events, (seq, seq), count)


def _remove_keys(c: Change, before: datetime) -> tuple[int, int]:
    """Take out of the change log every event of the keys a hard truncate removes: those whose
    latest version was written before ``before``, and delete-only keys (no version) whose events
    were all logged before it. Returns (events removed, keys).

    Decided on a change log the history table has caught up with, and committed strictly on
    it: an event logged meanwhile (a key this attempt never saw) makes the commit fail and the
    attempt start again, so it is never removed (nor forgotten) unseen."""
    assert c.log is not None  # the caller checked that the change log exists
    going = _keys_going(c.table, c.log, before)
    removal = c.remove_keys(going, "cdc_platform.truncated_events")
    return removal.events, removal.keys


def _keys_going(t: HistoryTable, log: Table, before: datetime) -> DataFrame:
    """The keys that go, decided once over every change-log file: a key's events may lie in
    files that are not all rewritten, so a flag computed again over the rewritten ones would
    see part of them (and drop an event it neither counts nor forgets)."""
    from pyspark.sql import functions as F

    key_cols, cut = cols(t.key), timestamp_lit(before)
    last = log.read(t.spark).groupBy(*key_cols).agg(F.max(col(INGESTED_AT)).alias(_LOGGED))
    # A key with no version: its events were all logged before T (null: an old log).
    unversioned_gone = F.coalesce(col(_LOGGED) < cut, F.lit(True))
    latest = _latest_rows(t)
    if latest is None:
        flagged = last.select(*key_cols, unversioned_gone.alias(_GOES))
    else:
        versioned = latest.select(*key_cols, (col(SYNCED) < cut).alias(_OLD))
        flagged = last.join(versioned, t.key, "left").select(
            *key_cols,
            F.when(col(_OLD).isNull(), unversioned_gone).otherwise(col(_OLD)).alias(_GOES),
        )
    return flagged.filter(col(_GOES)).select(*key_cols)
