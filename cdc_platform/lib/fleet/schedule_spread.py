"""Spreading a fleet's daily jobs over a window, so 500 tables do not start at one minute.

Each table's daily maintenance starts at the configured time plus an offset derived from its
name (a stable hash: the same table keeps its minute across deploys and hosts), within the
config's ``schedule_window_minutes``. Only a plain daily cron (``M H * * *``) is spread; any
other expression is used as written.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta

_DAILY = re.compile(r"^(\d{1,2}) (\d{1,2}) \* \* \*$")

# A fleet's one maintenance schedule ticks this often through the window, and each tick starts
# the tables whose place in the window has come and that have not started yet.
STEP_MINUTES = 5


def offset_minutes(name: str, window_minutes: int) -> int:
    """A table's place in the window: stable, and even over many names; in a day-long window
    no later than its last ``STEP_MINUTES`` tick, which the fleet's schedule must reach."""
    if window_minutes <= 1:
        return 0
    digest = hashlib.sha256(name.encode()).digest()
    return min(int.from_bytes(digest[:8], "big") % window_minutes, 24 * 60 - STEP_MINUTES)


def spread_daily_cron(cron: str, name: str, window_minutes: int) -> str:
    """``cron`` moved later by ``name``'s offset when it is a plain daily time, else as is."""
    start = _daily_start(cron)
    if start is None:
        return cron
    mine = (start + offset_minutes(name, window_minutes)) % (24 * 60)
    return f"{mine % 60} {mine // 60} * * *"


def _daily_start(cron: str) -> int | None:
    """Minute of the day a plain daily cron names, else None."""
    m = _DAILY.match(cron.strip())
    return None if m is None else int(m.group(2)) * 60 + int(m.group(1))


def window_cron(cron: str, window_minutes: int) -> str:
    """The cron of one schedule standing for every table's spread ``cron``: every
    ``STEP_MINUTES`` through the hours the window touches (any other cron: as written)."""
    start = _daily_start(cron)
    if start is None:
        return cron
    minutes = range(start, start + max(window_minutes, 1) + STEP_MINUTES)
    hours = sorted({(m // 60) % 24 for m in minutes})
    return f"*/{STEP_MINUTES} {','.join(str(h) for h in hours)} * * *"


def window_started(cron: str, at: datetime) -> datetime:
    """The latest start of ``cron``'s daily window at or before ``at`` (UTC); any other cron:
    ``at`` itself."""
    start = _daily_start(cron)
    if start is None:
        return at
    at = at.astimezone(UTC).replace(second=0, microsecond=0)
    since = (at.hour * 60 + at.minute - start) % (24 * 60)
    return at - timedelta(minutes=since)


def due_by(cron: str, name: str, window_minutes: int, at: datetime) -> bool:
    """Whether ``name``'s spread start in the window begun at ``window_started(cron, at)``
    has come by ``at``: a tick starts every such table its window has not started yet, so a
    tick the daemon missed leaves nothing behind."""
    if _daily_start(cron) is None:
        return True
    since = (at.astimezone(UTC) - window_started(cron, at)).total_seconds() // 60
    # The schedule's ticks of its first hour before today's start are in no window (an
    # hour past the last one's end): a first deploy at 04:00 starts nobody before 04:30.
    if since >= window_minutes + STEP_MINUTES + 60:
        return False
    return offset_minutes(name, window_minutes) <= since
