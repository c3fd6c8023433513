"""Un-applying a delivery, and re-admitting it: a bad landing file taken back out of a table.

``unapply`` records the files as revoked (``lib.ledgers.revoked_files``), removes their events from the
change log and recomputes the keys they touched, committing the history table once: afterwards
the table is what it would be had the files never landed. It runs in three commits, each safe
to crash after:

1. the files are recorded as revoked: from then on no materialization reads them and no change
   log append takes their events (an append racing this re-reads the list on every attempt);
2. the keys whose events go are recorded (``merge.record_retracted_keys``), then the change-log
   files holding those events are rewritten without them, in one strict commit (so that it
   lands exactly at the version after the one the keys were recorded for);
3. the merge recomputes every retracted key from what the change log still holds, whatever run
   comes first: this one, or the next materialization after a crash.

Running it again changes nothing. An event that another file also delivered (the same key and
``cdc_change_seq``) was logged once, from the file read first: un-applying that file removes it.
Materialize the other file's hour again to log it from there.

``readmit`` deletes the files' revocation and materializes the hours they are in, so their
events are logged and merged again: un-apply then re-admit gives back the same table
(``_fivetran_synced`` aside).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import SOURCE_FILE, col
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history.merge import MergeResult
from cdc_platform.lib.history.removal import GONE
from cdc_platform.lib.history.table import Change, HistoryTable, Removal
from cdc_platform.lib.landing.where.layout import is_data_file
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import Landing
from cdc_platform.lib.ledgers import revoked_files
from cdc_platform.lib.operations.operation import Request
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize_hours

if TYPE_CHECKING:
    pass

# The sources of an operation's own events (``adoption``, ``resync``, ``truncation`` import
# this module, so their prefixes are spelled here too; a test checks they agree).
ADOPT_PREFIX = "adopt:"
RESYNC_PREFIX = "resync:at="
TRUNCATE_PREFIX = "truncate:before="
UNAPPLY = "unapply_files"
READMIT = "readmit_files"
# Digits the landing layout can hold (padded or not): ASCII only, never more than a year's
# four (an unbounded group would hand ``datetime`` a number it overflows on).
_HOUR_PARTS = re.compile(
    r"/year=([0-9]{1,4})/month=([0-9]{1,2})/day=([0-9]{1,2})/hour=([0-9]{1,2})/[^/]+$"
)


class NoMatchingFileError(Refusal, LookupError):
    """A file name or glob given to un-apply or re-admit matches no file of the table."""


class NotReadmittableError(Refusal):
    """Re-admit named an operation's events (adopt, re-sync, truncate): re-run it instead."""


@dataclass(frozen=True)
class UnapplyRequest(Request):
    """Files to take back out (paths or globs, ``match``), why, and the run that asks."""

    files: tuple[str, ...]
    reason: str
    run_id: str


@dataclass(frozen=True)
class UnapplyResult:
    reason: str
    files: tuple[str, ...]  # every file the request names, now revoked
    newly_revoked: tuple[str, ...]  # those this call recorded (a replay records none)
    events_removed: int
    keys_retracted: int
    changelog_files_rewritten: int
    merge: MergeResult
    hours: tuple[datetime, ...]  # the hour folders the files are in
    changed: bool = True

    def summary(self) -> str:
        return (
            f"revoked {len(self.files)} file(s) ({len(self.newly_revoked)} newly), removed "
            f"{self.events_removed} event(s) of {self.keys_retracted} key(s), history version "
            f"{self.merge.history_version}"
        )

    def metadata(self) -> dict[str, Any]:
        return {
            "operation": UNAPPLY,
            "reason": self.reason,
            "files": list(self.files),
            "newly_revoked": len(self.newly_revoked),
            "events_removed": self.events_removed,
            "keys_retracted": self.keys_retracted,
            "changelog_files_rewritten": self.changelog_files_rewritten,
            **self.merge.metadata(),
        }


@dataclass(frozen=True)
class ReadmitRequest(Request):
    files: tuple[str, ...]


@dataclass(frozen=True)
class ReadmitResult:
    files: tuple[str, ...]
    hours: tuple[datetime, ...]
    outcome: MaterializationOutcome | None  # None when no file is in an hour folder
    version_before: int | None
    changed: bool = True

    def summary(self) -> str:
        new = self.outcome.events_new if self.outcome else 0
        return (
            f"re-admitted {len(self.files)} file(s); {new} event(s) logged again over "
            f"{len(self.hours)} hour(s)"
        )

    def metadata(self) -> dict[str, Any]:
        o = self.outcome
        return {
            "operation": READMIT,
            "files": list(self.files),
            "events_new": o.events_new if o else 0,
            "keys_affected": o.merge.keys_affected if o else 0,
            "delta_version": o.merge.history_version if o else self.version_before,
        }


def hour_of(file: str) -> datetime | None:
    """The hour folder a landing-relative file is in (None if it is not in one, or its parts
    are no hour). Total: un-apply and re-admit call it after their commits, so it never raises."""
    m = _HOUR_PARTS.search("/" + file.replace(os.sep, "/"))
    if m is None:
        return None
    try:
        return datetime(*(int(g) for g in m.groups()), tzinfo=UTC)  # type: ignore[misc]
    except (ValueError, OverflowError):
        return None


def is_landing_file(name: str, table: str) -> bool:
    """Whether a ``_cdc_source_file`` names a landing file of ``table`` (``<table>/...``), as
    opposed to an operation's own events (``adopt:``, ``resync:at=``, ``truncate:before=``, a
    re-sync snapshot's files), which no materialization logs again."""
    return name.replace(os.sep, "/").startswith(f"{table}/")


def operation_of(name: str) -> str:
    """What to run to log an operation's events again (re-admitting them logs nothing)."""
    if name.startswith(ADOPT_PREFIX):
        return f"run adopt_table again with source {name.removeprefix(ADOPT_PREFIX)}"
    if name.startswith(RESYNC_PREFIX):
        return f"run resync_table again with its snapshot and at {name.removeprefix(RESYNC_PREFIX)}"
    if name.startswith(TRUNCATE_PREFIX):
        return (
            "run truncate_table (soft) again to close the keys live now; it closes those "
            "written before its before, and the un-apply rewrote the keys it had closed"
        )
    return "it is a re-sync snapshot's file: run resync_table again with its snapshot and at"


def match(
    patterns: Sequence[str], candidates: set[str], table: str, landing_root: Landing
) -> list[str]:
    """The candidates each pattern names: a path or glob relative to the landing root
    (``orders/year=2024/*/*/*/bad-*.parquet``), to the table's folder (``year=2024/...``), or
    absolute under the landing root (a path, or on a bucket its ``s3://`` URI). ``*`` also
    matches ``/``. An operation's own source
    (``adopt:...``, ``resync:at=...``, ``truncate:before=...``, a snapshot file) is matched only
    when named exactly, never by a glob: taking it back cannot be undone by re-admitting it.
    Raises if one matches nothing."""
    if not patterns:
        raise NoMatchingFileError(f"no file given for table {table!r}")
    zone = zone_at(landing_root)
    root = zone.root
    landing = {c for c in candidates if is_landing_file(c, table)}
    operations = candidates - landing
    out: set[str] = set()
    for raw in patterns:
        exact = raw.strip()
        p = exact
        if os.path.isabs(p) or "://" in p:
            p = zone.relative(p)
        p = p.removeprefix("./")
        forms = {p, f"{table}/{p}"}
        hit = {c for c in landing if any(fnmatch.fnmatchcase(c, f) for f in forms)}
        hit |= {c for c in operations if c == exact}
        if not hit:
            globbed = sorted(c for c in operations if any(fnmatch.fnmatchcase(c, f) for f in forms))
            hint = (
                f"; an operation's events match only when named exactly: {globbed[:5]}"
                if globbed
                else ""
            )
            raise NoMatchingFileError(
                f"{raw!r} matches no landing file of table {table!r} (paths are relative to the "
                f"landing root {root} or to its {table}/ folder){hint}"
            )
        out |= hit
    return sorted(out)


def _landing_files(landing_root: Landing, table: str) -> set[str]:
    """Every data file under the table's landing folder, relative to the landing root."""
    files = zone_at(landing_root).table_files(table)
    return {f for f in files if is_data_file(f.rsplit("/", 1)[-1])}


def _logged_files(t: HistoryTable) -> set[str]:
    """Every landing file with an event in the change log."""
    log = t.changelog
    if not log.files:
        return set()
    events = log.read(t.spark)
    return {r[0] for r in events.select(SOURCE_FILE).distinct().collect() if r[0] is not None}


def unapply(t: HistoryTable, request: UnapplyRequest) -> UnapplyResult:
    """Take the named landing files' events out of the table (see the module docstring)."""
    reason = request.reason.strip()
    if not reason:
        raise Refusal("un-applying files needs a reason (it is recorded with them)")
    candidates = _logged_files(t) | _landing_files(t.landing, t.name) | t.revoked()
    files = match(request.files, candidates, t.name, t.landing)
    newly = revoked_files.add(t.paths.revoked_files, files, reason, request.run_id, request.now)
    removal, merge = t.change(
        request.now,
        lambda c: _remove_revoked(c, t.revoked(), fence=bool(newly)),
        "un-apply",
        catch_up=False,
    )
    hours = sorted({h for f in files if (h := hour_of(f)) is not None})
    return UnapplyResult(
        reason,
        tuple(files),
        tuple(newly),
        removal.events,
        removal.keys,
        removal.files_rewritten,
        merge,
        tuple(hours),
    )


def _remove_revoked(c: Change, names: set[str], fence: bool) -> Removal:
    """One attempt: rewrite the change-log files holding events of ``names`` without them.

    With ``fence`` (files were just revoked) a change log holding none of their events still
    gets a commit, an empty one: an append that read the revoked list before the files were
    revoked then loses its strict commit and re-reads the list, instead of logging them."""
    from pyspark.sql import functions as F

    if not names or c.log is None:
        return Removal(0, 0, 0)
    files = [f for f in c.log.files if revoked_files.may_hold(f, names)]
    gone = F.coalesce(col(SOURCE_FILE).isin(sorted(names)), F.lit(False))
    return c.remove(
        lambda events: events.withColumn(GONE, gone),
        "cdc_platform.unapplied_events",
        files,
        fence=fence,
    )


def readmit(t: HistoryTable, request: ReadmitRequest) -> ReadmitResult:
    """Lift the named files' revocation and materialize the hours they are in. An
    operation's source is refused (NotReadmittableError, saying what to run instead).

    Naming a file that is no longer revoked (a re-run after a crash) is not an error: its
    hour is materialized again, which applies whatever is not applied yet.
    """
    version_before = t.history.version
    try:
        files = match(request.files, t.revoked(), t.name, t.landing)
    except NoMatchingFileError:
        files = match(request.files, _landing_files(t.landing, t.name), t.name, t.landing)
    operations = [f for f in files if not is_landing_file(f, t.name)]
    if operations:
        raise NotReadmittableError(
            "an operation's events are not re-admitted (no landing file holds them, so nothing "
            "would log them again); the revocation stays: "
            + "; ".join(f"{f}: {operation_of(f)}" for f in operations)
        )
    revoked_files.remove(t.paths.revoked_files, files)
    hours = sorted({h for f in files if (h := hour_of(f)) is not None})
    outcome = materialize_hours(t.refresh(), hours, request.now) if hours else None
    return ReadmitResult(tuple(files), tuple(hours), outcome, version_before)
