"""The one shape of an operator operation: ``op(table, request) -> Result``.

``table`` is the ``HistoryTable`` handle the job opened; the request is a frozen dataclass of
what the operator asked, with the operation's one clock, ``now`` (a millisecond in UTC, as
every time the platform writes: ``to_ms``); the result knows what to report: a one-line
summary, its metadata and the hour partitions it concerns (``defs.jobs`` reports them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol


def to_ms(ts: datetime) -> datetime:
    """A time truncated to the millisecond, in UTC (the precision of the history table)."""
    ts = ts.astimezone(UTC)
    return ts.replace(microsecond=(ts.microsecond // 1000) * 1000)


def hour_start(ts: datetime) -> datetime:
    """The hour partition a time falls in."""
    return ts.replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class Request:
    """What every request carries: the operation's clock (default: when it is made)."""

    now: datetime = field(default_factory=lambda: to_ms(datetime.now(UTC)), kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "now", to_ms(self.now))


class Result(Protocol):
    """What an operation reports: a line for the log, metadata, and the hours it changed
    (none: an observation of the table, not of a partition). ``changed`` False: nothing to
    report (nothing was done), and the summary says why."""

    @property
    def changed(self) -> bool: ...

    def summary(self) -> str: ...

    def metadata(self) -> dict[str, Any]: ...

    @property
    def hours(self) -> tuple[datetime, ...]: ...
