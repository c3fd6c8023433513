"""Which hourly partitions a landing sensor tick should (re)request, as a pure function.

The idea is Airbyte's incremental cursor with a lookback window: every tick re-reads only the
recent hour folders (``lookback_hours``) and compares each folder's file-set fingerprint with the
one last requested, so new folders and new files in recent folders are picked up cheaply. Files
that land in *older* folders (late deliveries, re-exports) are caught by a periodic full sweep
that walks the whole tree and looks for files modified after the previous sweep's high-water mark.

The cursor stays small: it only keeps fingerprints for the lookback window, for folders that aged
out since the last sweep, and for old folders whose files are too recent to be covered by the
sweep high-water mark yet. No dagster import here, so this is testable and benchmarkable alone.

No hour is left behind (``reconcile``): every hour requested stays *pending* in the cursor until
the applied-files ledger shows its files read. A pending hour is looked at again after the
table's ``retry_backoff_seconds``, doubling with each retry up to ``MAX_BACKOFF_SECONDS``: if its
files are all in the ledger (applied, or set aside in the quarantine, which the ledger records
too) it is done; if a run for it is queued or in flight, it waits; else, whatever made the earlier
run fail (a storage outage, a killed worker, Spark down), it is requested again. The merge is
idempotent, so a request too many costs a run, never a duplicate event.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.where.layout import (
    HOUR,
    LandingFile,
    fingerprint,
    hour_to_partition_key,
    hours_between,
    partition_key_to_hour,
)
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import (
    Landing,
    LandingUnavailableError,
    LandingZone,
    ListBudget,
)
from cdc_platform.lib.ledgers import applied_files

# partition keys -> the (file, size, mtime_ns) the applied-files ledger records for each.
AppliedLookup = Callable[[Collection[str]], Mapping[str, Collection[applied_files.FileIdentity]]]

REASON_NEW_FOLDER = "new folder"
REASON_NEW_FILES = "new files in folder"
REASON_LATE_FILES = "late files found by full sweep"
REASON_INITIAL = "initial backfill"
REASON_RETRY = "not applied yet: requested again"

# A pending hour is retried at most this far apart.
MAX_BACKOFF_SECONDS = 3600
# At most this many pending hours are kept (the oldest first dropped, with the sweep and a
# reset cursor as the backstop): a table broken for months keeps a bounded cursor.
MAX_PENDING = 5000

# A huge backfill becomes a few single-run range requests instead of one giant run.
MAX_RANGE_HOURS = 48

# What one table's tick may list on a bucket (``ListBudget``): the sweep (and the first
# tick's seeding, which is the first sweep) and the check of pending hours go on next tick
# where this one stopped. 100 pages are 100,000 keys, a few seconds of S3.
LIST_REQUESTS_PER_TICK = 100
LIST_SECONDS_PER_TICK = 20.0


def tick_budget(seconds: float = LIST_SECONDS_PER_TICK) -> ListBudget:
    """A table's listing budget for one tick."""
    return ListBudget(LIST_REQUESTS_PER_TICK, min(seconds, LIST_SECONDS_PER_TICK))


_CURSOR_VERSION = 1


@dataclass
class CursorState:
    """What the sensor remembers between ticks; serialised into the Dagster sensor cursor."""

    # partition key -> fingerprint of the file set last requested (lookback window, folders that
    # aged out since the last sweep, and old folders newer than the sweep high-water mark).
    folders: dict[str, str] = field(default_factory=dict)
    # ISO timestamp (the sensor's `now`) at which the last full sweep started.
    last_sweep_started: str | None = None
    # Files with mtime_ns <= this were all seen by a sweep (or a lookback tick) already.
    swept_mtime_ns: int = 0
    # Hours requested and not yet seen applied: partition key -> ``Pending``.
    pending: dict[str, Pending] = field(default_factory=dict)
    # A sweep under way over several ticks (its budget spent), or None.
    sweep: SweepProgress | None = None

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "v": _CURSOR_VERSION,
            "folders": dict(sorted(self.folders.items())),
            "last_sweep_started": self.last_sweep_started,
            "swept_mtime_ns": self.swept_mtime_ns,
            "pending": {k: list(p) for k, p in sorted(self.pending.items())},
        }
        if self.sweep is not None:
            data["sweep"] = self.sweep.to_dict()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | None) -> CursorState:
        """An empty cursor for ``None``/``""`` (first tick or a reset from the UI)."""
        if not raw:
            return cls()
        data: dict[str, Any] = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != _CURSOR_VERSION:
            raise ValueError(
                f"unsupported landing sensor cursor (expected version {_CURSOR_VERSION}); "
                "reset the sensor cursor to start over"
            )
        return cls(
            folders={str(k): str(v) for k, v in (data.get("folders") or {}).items()},
            last_sweep_started=data.get("last_sweep_started"),
            swept_mtime_ns=int(data.get("swept_mtime_ns") or 0),
            pending={
                str(k): Pending(str(v[0]), float(v[1]), float(v[2]), int(v[3]))
                for k, v in (data.get("pending") or {}).items()
            },
            sweep=SweepProgress.from_dict(data["sweep"]) if data.get("sweep") else None,
        )


@dataclass(frozen=True)
class SweepProgress:
    """A full sweep that resumes on the next tick: where its listing goes on, the wall clock
    at its start and the newest mtime it saw so far (its mark, once done), whether it is the
    cursor's first (it requests with ``REASON_INITIAL`` and seeds from the ledger), and the
    old hours it saw whose newest file may end above its mark (key -> newest mtime)."""

    after: str
    wall_ns: int
    seen_ns: int = 0
    initial: bool = False
    recent: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "after": self.after,
            "wall_ns": self.wall_ns,
            "seen_ns": self.seen_ns,
            "initial": self.initial,
            "recent": dict(sorted(self.recent.items())),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepProgress:
        return cls(
            after=str(data["after"]),
            wall_ns=int(data["wall_ns"]),
            seen_ns=int(data.get("seen_ns") or 0),
            initial=bool(data.get("initial")),
            recent={str(k): int(v) for k, v in (data.get("recent") or {}).items()},
        )


class Pending(NamedTuple):
    """An hour requested and not yet seen applied."""

    fingerprint: str  # of the file set last requested
    first_requested: float  # epoch seconds: the backlog's age
    last_checked: float  # epoch seconds of the last request or check
    retries: int  # requests made again so far


def backoff_seconds(table: TableConfig, retries: int) -> float:
    """How long after its last request or check a pending hour is looked at again."""
    return float(min(table.retry_backoff_seconds * 2 ** min(retries, 20), MAX_BACKOFF_SECONDS))


def due_for_check(table: TableConfig, state: CursorState, now: datetime) -> list[str]:
    """The pending hours whose backoff has run out, oldest hour first."""
    at = _as_utc(now).timestamp()
    due = [
        key
        for key, p in state.pending.items()
        if at - p.last_checked >= backoff_seconds(table, p.retries)
    ]
    return sorted(due, key=partition_key_to_hour)


def reconcile(
    table: TableConfig,
    landing_root: Landing,
    now: datetime,
    state: CursorState,
    applied: Mapping[str, Collection[tuple[str, int, int]]],
    in_flight: Collection[str],
    *,
    max_range_hours: int = MAX_RANGE_HOURS,
    budget: ListBudget | None = None,
) -> tuple[list[PartitionRequest], CursorState]:
    """The due pending hours (``due_for_check``) settled: dropped when the ledger's rows for
    the hour (``applied``: partition -> (file, size, mtime_ns)) cover every file in its folder,
    left waiting when a run for it is ``in_flight``, else requested again (backoff doubled).
    On a bucket their folders are listed a day folder at a time (``files_of_hours``) until
    ``budget`` is spent; the hours not listed stay due for the next tick."""
    at = _as_utc(now).timestamp()
    landing = zone_at(landing_root)
    pending = dict(state.pending)
    wanted: dict[str, tuple[str, str]] = {}
    due = due_for_check(table, state, now)
    for key in [k for k in due if partition_key_to_hour(k) < table.start]:
        del pending[key]  # the table's start moved past it
    due = [k for k in due if k in pending]
    try:
        listed, looked = landing.files_of_hours(
            table.name, [partition_key_to_hour(k) for k in due], budget
        )
    except (OSError, LandingUnavailableError):  # looked at again after the backoff
        kept = replace(state, pending=pending)
        return [], postponed(kept, due, now)
    for key in due:
        hour = partition_key_to_hour(key)
        if hour not in looked:  # the budget is spent: still due next tick
            continue
        p = pending[key]
        files = listed.get(hour, [])
        done = {applied_files.identity(landing, f) for f in files} <= set(applied.get(key, ()))
        if not files or done:
            del pending[key]
        elif key in in_flight:
            pending[key] = p._replace(last_checked=at)
        else:
            retries = p.retries + 1
            fp = fingerprint(files)
            pending[key] = Pending(fp, p.first_requested, at, retries)
            # A run key of its own: Dagster runs a sensor's run key once.
            wanted[key] = (REASON_RETRY, f"{fp}/retry{retries}")
    requests = _group(table.name, wanted, max_range_hours)
    return requests, replace(state, pending=pending)


def postponed(state: CursorState, keys: Collection[str], now: datetime) -> CursorState:
    """``state`` with ``keys`` looked at again only after their backoff (nothing decided)."""
    at = _as_utc(now).timestamp()
    pending = {
        k: (p._replace(last_checked=at) if k in keys else p) for k, p in state.pending.items()
    }
    return replace(state, pending=pending)


def backlog(state: CursorState, now: datetime) -> tuple[int, str | None, float]:
    """(hours landed and not yet seen applied, the oldest of them, minutes since the longest
    waiting one was first requested: ``backlog_since``)."""
    first = backlog_since(state)
    if first is None:
        return 0, None, 0.0
    oldest = min(state.pending, key=partition_key_to_hour)
    return len(state.pending), oldest, max(0.0, (_as_utc(now).timestamp() - first) / 60)


def backlog_since(state: CursorState) -> float | None:
    """When the longest-waiting pending hour was first requested (epoch seconds)."""
    return min((p.first_requested for p in state.pending.values()), default=None)


def _with_pending(
    pending: Mapping[str, Pending], wanted: Mapping[str, tuple[str, str]], at: float
) -> dict[str, Pending]:
    """``pending`` plus the hours just requested (a new file set starts its retries over)."""
    out = dict(pending)
    for key, (_, fp) in wanted.items():
        before = out.get(key)
        first = before.first_requested if before is not None else at
        out[key] = Pending(fp, first, at, 0)
    if len(out) > MAX_PENDING:
        for key in sorted(out, key=partition_key_to_hour)[: len(out) - MAX_PENDING]:
            del out[key]
    return out


@dataclass(frozen=True)
class HourRange:
    """Consecutive hourly partitions, oldest first."""

    partition_keys: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.partition_keys[0]

    @property
    def last(self) -> str:
        return self.partition_keys[-1]


@dataclass(frozen=True)
class PartitionRequest(HourRange):
    """One run to launch: a range of consecutive hourly partitions and why."""

    run_key: str
    reason: str


def _as_utc(now: datetime) -> datetime:
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now.astimezone(UTC)


def lookback_window(
    table: TableConfig, now: datetime, end_offset: int = 0
) -> tuple[datetime, datetime]:
    """First and last hour folder a normal tick checks (empty when last < first).

    The last one is the newest *valid* hourly partition: with Dagster's default ``end_offset=0``
    the partition of the still-open hour does not exist yet, so its folder waits until the hour
    closes (a run request for it would fail the tick). Folders before ``table.start`` are ignored.
    """
    current = _as_utc(now).replace(minute=0, second=0, microsecond=0)
    last = current - HOUR + timedelta(hours=end_offset)
    first = max(current - timedelta(hours=table.lookback_hours), table.start)
    return first, last


def sweep_due(table: TableConfig, now: datetime, state: CursorState) -> bool:
    if state.sweep is not None:  # under way: it goes on
        return True
    if state.last_sweep_started is None:
        return True
    elapsed = _as_utc(now) - datetime.fromisoformat(state.last_sweep_started)
    # A clock that went backwards is treated as "due": sweeping is always safe.
    return elapsed < timedelta(0) or elapsed >= timedelta(minutes=table.full_sweep_minutes)


def evaluate(
    table: TableConfig,
    landing_root: Landing,
    now: datetime,
    state: CursorState,
    *,
    end_offset: int = 0,
    max_range_hours: int = MAX_RANGE_HOURS,
    applied: AppliedLookup | None = None,
    budget: ListBudget | None = None,
) -> tuple[list[PartitionRequest], CursorState]:
    """One sensor tick: the partitions to (re)request and the cursor to persist.

    Cost is ``lookback_hours`` folder listings (on a bucket, one listing from the window's
    first key on: ``LandingZone.files_in_hours``), plus the table's one prefix listing when a
    full sweep is due (``full_sweep_minutes``, or on the very first tick, which requests
    everything that exists as an initial backfill). On a bucket the sweep lists until
    ``budget`` is spent and goes on from there on the next ticks (``SweepProgress``).

    Given ``applied`` (the applied-files ledger), an empty cursor is seeded as it sweeps: an
    hour whose current files were all applied already is remembered with its fingerprint,
    exactly as if the sensor had requested it, and only hours holding a file never read are
    requested (a reset cursor asks for nothing twice).
    """
    if max_range_hours < 1:
        raise ValueError(f"max_range_hours must be >= 1, got {max_range_hours}")
    now = _as_utc(now)
    landing = zone_at(landing_root)
    folders = dict(state.folders)
    wanted: dict[str, tuple[str, str]] = {}  # key -> (reason, fingerprint)
    seed = applied if state.last_sweep_started is None else None

    window = lookback_window(table, now, end_offset)
    window_newest: dict[str, int] = {}  # key -> newest mtime, for the sweep's high-water mark
    listed = landing.files_in_hours(table.name, *window) if window[0] <= window[1] else {}
    done = _applied_hours(landing, listed, seed)
    for hour in hours_between(*window):
        key = hour_to_partition_key(hour)
        files = listed.get(hour, [])
        window_newest[key] = _newest(files)
        if not files:
            folders.pop(key, None)
            continue
        fp = fingerprint(files)
        previous = folders.get(key)
        if previous != fp and hour not in done:
            reason = REASON_NEW_FOLDER if previous is None else REASON_NEW_FILES
            wanted[key] = (reason, fp)
        folders[key] = fp

    new_state = replace(state, folders=folders)
    if sweep_due(table, now, state):
        new_state, late, initial = _sweep_step(
            table, landing, now, window, window_newest, new_state, applied, budget
        )
        reason = REASON_INITIAL if initial else REASON_LATE_FILES
        for key, fp in late.items():
            wanted[key] = (reason, fp)

    requests = _group(table.name, wanted, max_range_hours)
    pending = _with_pending(state.pending, wanted, now.timestamp())
    return requests, replace(new_state, pending=pending)


def _applied_hours(
    landing: LandingZone,
    files: Mapping[datetime, list[LandingFile]],
    applied: AppliedLookup | None,
) -> set[datetime]:
    """The hours of ``files`` whose every file the ledger (``applied``) records as read."""
    if applied is None or not files:
        return set()
    recorded = applied([hour_to_partition_key(h) for h in files])
    out = set()
    for hour, fs in files.items():
        done = set(recorded.get(hour_to_partition_key(hour), ()))
        if fs and all(applied_files.identity(landing, f) in done for f in fs):
            out.add(hour)
    return out


def _sweep_step(
    table: TableConfig,
    landing: LandingZone,
    now: datetime,
    window: tuple[datetime, datetime],
    window_newest: dict[str, int],
    state: CursorState,
    applied: AppliedLookup | None,
    budget: ListBudget | None,
) -> tuple[CursorState, dict[str, str], bool]:
    """One tick's share of a full sweep of the hours older than the window: (the cursor, the
    late hours to request, whether this is the cursor's first sweep).

    A folder is late when one of its files was modified after the previous sweep's mark and its
    fingerprint differs from the one remembered (the first sweep with a ledger: unless all its
    files were applied). The new mark is the newest mtime seen, capped by the wall clock at the
    sweep's start (a future-dated file must not hide later deliveries), minus a safety margin;
    old folders with files above the new mark stay in the cursor so the next sweep recognises
    them instead of requesting them again. Everything else older than the window is dropped
    from the cursor once the sweep is done: the mark covers it.
    """
    progress = state.sweep or SweepProgress(
        after="", wall_ns=time.time_ns(), initial=state.last_sweep_started is None
    )
    started = state.last_sweep_started if state.sweep is not None else now.isoformat()
    first, last = window
    previous_mark_ns = state.swept_mtime_ns
    # Newest mtime per hour (skipping the window, compared above, the open hour and future
    # folders, not valid partitions yet, and folders before the table's start); only the
    # hours touched since the previous mark are fingerprinted.
    newest_by_hour, touched, resume = landing.sweep_part(
        table.name, first, previous_mark_ns, progress.after, budget
    )
    touched = {h: fs for h, fs in touched.items() if h >= table.start}
    seen_ns = max(progress.seen_ns, *window_newest.values(), 0)
    done = _applied_hours(landing, touched, applied if progress.initial else None)
    folders = dict(state.folders)
    recent = dict(progress.recent)
    late: dict[str, str] = {}
    for hour, newest in sorted(newest_by_hour.items()):
        if hour < table.start:
            continue
        seen_ns = max(seen_ns, newest)
        files = touched.get(hour, [])
        if not files:
            continue
        key = hour_to_partition_key(hour)
        fp = fingerprint(files)
        if folders.get(key) != fp and hour not in done:
            late[key] = fp
        folders[key] = fp
        recent[key] = max(recent.get(key, 0), _newest(files))

    mark = max(previous_mark_ns, min(seen_ns, progress.wall_ns) - landing.sweep_margin_ns)
    # Hours the mark already covers are dropped now (the sweep does not come back to them).
    for key in [k for k, n in recent.items() if n <= mark]:
        del recent[key]
        if partition_key_to_hour(key) < first:
            folders.pop(key, None)
    if resume is not None:  # goes on next tick, from there
        more = SweepProgress(resume, progress.wall_ns, seen_ns, progress.initial, recent)
        return (
            replace(state, folders=folders, sweep=more, last_sweep_started=started),
            late,
            progress.initial,
        )
    kept = {k: v for k, v in folders.items() if first <= partition_key_to_hour(k) <= last}
    kept |= {k: folders[k] for k in recent if k in folders}
    done_state = replace(
        state, folders=kept, sweep=None, last_sweep_started=started, swept_mtime_ns=mark
    )
    return done_state, late, progress.initial


def _newest(files: Iterable[LandingFile]) -> int:
    return max((f.mtime_ns for f in files), default=0)


def _group(
    table_name: str, wanted: dict[str, tuple[str, str]], max_range_hours: int
) -> list[PartitionRequest]:
    """Merge consecutive hours with the same reason into ranges of at most max_range_hours."""
    out: list[PartitionRequest] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            reason = wanted[run[0]][0]
            out.append(
                PartitionRequest(
                    partition_keys=tuple(run),
                    run_key=make_run_key(table_name, [(k, wanted[k][1]) for k in run]),
                    reason=reason,
                )
            )
            run.clear()

    previous_hour: datetime | None = None
    for key in sorted(wanted, key=partition_key_to_hour):
        hour = partition_key_to_hour(key)
        contiguous = (
            previous_hour is not None
            and hour - previous_hour == HOUR
            and wanted[key][0] == wanted[run[0]][0]
            and len(run) < max_range_hours
        )
        if not contiguous:
            flush()
        run.append(key)
        previous_hour = hour
    flush()
    return out


def make_run_key(table_name: str, key_fingerprints: list[tuple[str, str]]) -> str:
    """Deterministic: the same folders with the same file sets give the same run key."""
    digest = hashlib.sha256()
    for key, fp in key_fingerprints:
        digest.update(f"{key}={fp}\n".encode())
    first, last = key_fingerprints[0][0], key_fingerprints[-1][0]
    return f"{table_name}:{first}..{last}:{digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class BatchRequest(HourRange):
    """One run for several tables: the same hour range applied to each, each table its own
    step and commit (``landing_sensor: fleet``)."""

    tables: tuple[str, ...]
    run_key: str
    reasons: tuple[str, ...]


def batch(
    requests: Mapping[str, Iterable[PartitionRequest]],
    partitions_of: Mapping[str, str],
    tables_per_run: int,
) -> list[BatchRequest]:
    """The tables' requests (table -> its ``PartitionRequest``s) as runs of at most
    ``tables_per_run`` tables, grouped by hour range and by ``partitions_of`` (table -> its
    partitions definition's identity: Dagster runs only assets that share one), oldest range
    first. Deterministic: the same requests give the same run keys, so a tick evaluated twice
    launches nothing twice. A table asked for again (``REASON_RETRY``: its last run did not
    apply the hour) runs alone: whatever failed it, a Python error or a killed process, never
    holds other tables back twice."""
    if tables_per_run < 1:
        raise ValueError(f"tables_per_run must be >= 1, got {tables_per_run}")
    groups: dict[tuple[str, tuple[str, ...], str], list[tuple[str, PartitionRequest]]] = {}
    for table in sorted(requests):
        for request in requests[table]:
            alone = f"retry:{table}" if request.reason == REASON_RETRY else ""
            groups.setdefault((partitions_of[table], request.partition_keys, alone), []).append(
                (table, request)
            )
    out: list[BatchRequest] = []
    for (_, keys, _), members in sorted(
        groups.items(), key=lambda g: (partition_key_to_hour(g[0][1][0]), g[0])
    ):
        for i in range(0, len(members), tables_per_run):
            chunk = members[i : i + tables_per_run]
            digest = hashlib.sha256("".join(f"{t}\0{r.run_key}\n" for t, r in chunk).encode())
            out.append(
                BatchRequest(
                    tables=tuple(t for t, _ in chunk),
                    partition_keys=keys,
                    run_key=f"tables:{keys[0]}..{keys[-1]}:{digest.hexdigest()[:16]}",
                    reasons=tuple(sorted({r.reason for _, r in chunk})),
                )
            )
    return out
