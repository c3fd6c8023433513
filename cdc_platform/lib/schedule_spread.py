"""Spreading a fleet's daily jobs over a window, so 500 tables do not start at one minute.

Each table's daily maintenance starts at the configured time plus an offset derived from its
name (a stable hash: the same table keeps its minute across deploys and hosts), within the
config's ``schedule_window_minutes``. Only a plain daily cron (``M H * * *``) is spread; any
other expression is used as written.
"""

from __future__ import annotations

import hashlib
import re

_DAILY = re.compile(r"^(\d{1,2}) (\d{1,2}) \* \* \*$")


def offset_minutes(name: str, window_minutes: int) -> int:
    """A table's place in the window: stable, and even over many names."""
    if window_minutes <= 1:
        return 0
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % window_minutes


def spread_daily_cron(cron: str, name: str, window_minutes: int) -> str:
    """``cron`` moved later by ``name``'s offset when it is a plain daily time, else as is."""
    m = _DAILY.match(cron.strip())
    if m is None:
        return cron
    minute, hour = int(m.group(1)), int(m.group(2))
    start = (hour * 60 + minute + offset_minutes(name, window_minutes)) % (24 * 60)
    return f"{start % 60} {start // 60} * * *"


# A fleet's one maintenance schedule ticks this often through the window, and each tick starts
# the tables whose place in the window fell since the previous one.
STEP_MINUTES = 5


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


def due_at(cron: str, name: str, window_minutes: int, hour: int, minute: int) -> bool:
    """Whether ``name``'s spread start falls in the step ending at ``hour:minute`` (after the
    previous tick, up to this one): each table is due at exactly one tick a day."""
    start = _daily_start(cron)
    if start is None:
        return True
    mine = (start + offset_minutes(name, window_minutes)) % (24 * 60)
    return (hour * 60 + minute - mine) % (24 * 60) < STEP_MINUTES
