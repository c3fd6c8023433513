"""Joining a side whose size grows with a run's keys or events: broadcast only when known small.

Spark broadcasts a join side when its *estimate* of the side is under
``spark.sql.autoBroadcastJoinThreshold`` (10 MB), and its estimate of a Parquet read is the
files' compressed size, scaled down by the columns a plan keeps. The touched keys of a bulk
hour (2M events over 1M keys, 54 MB of Parquet) were estimated under 10 MB; their broadcast
(1M rows, 75 MB as a hash table, built on the driver) ran Spark's default 1 GiB driver out of
memory (issue 22, target 9). So a side whose size grows with keys or events is never left to
that estimate: the caller passes a bound on its rows that it already holds (Delta add-action
statistics, a count the run made anyway), and the side is broadcast when the bound is small
(a small hour keeps its broadcast joins, decided without a Spark job), else the join is a
sort-merge join, which spills to disk instead of failing. Neither changes a join's result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# At most this many rows are broadcast: a key set is a few MB, a whole history row some tens.
BROADCAST_ROWS = 100_000


class _HasRecords(Protocol):
    @property
    def num_records(self) -> int | None: ...


def records(files: Iterable[_HasRecords]) -> int | None:
    """The rows of ``files`` from their Delta statistics; None if a file has none."""
    total = 0
    for f in files:
        if f.num_records is None:
            return None
        total += f.num_records
    return total


def add(*bounds: int | None) -> int | None:
    """The sum of row bounds; unknown if any is."""
    if any(b is None for b in bounds):
        return None
    return sum(b for b in bounds if b is not None)


def smallest(*bounds: int | None) -> int | None:
    """The tightest of several bounds on the same rows; unknown only if every one is."""
    known = [b for b in bounds if b is not None]
    return min(known) if known else None


def build_side(df: DataFrame, rows: int | None) -> DataFrame:
    """``df`` as the side of a join it is about to enter: broadcast when ``rows`` (a bound on
    its rows, None if unknown) is at most ``BROADCAST_ROWS``, else hinted to a sort-merge
    join, so that neither Spark's estimate nor adaptive execution broadcasts it."""
    from pyspark.sql import functions as F

    threshold = df.sparkSession.conf.get("spark.sql.autoBroadcastJoinThreshold", None)
    broadcasts_off = str(threshold).strip() == "-1"  # the operator turned broadcasts off
    if rows is not None and rows <= BROADCAST_ROWS and not broadcasts_off:
        return F.broadcast(df)
    return df.hint("merge")
