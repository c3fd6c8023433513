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

Each broadcast is a Spark job of its own (adaptive execution is off for a small run), so a join
whose two sides are both known to be tiny is a shuffle join inside the query's own job instead
(``probe_rows``), and a small run's key sets are held on the driver (``key_values``) and applied
as ``IN`` filters (``restrict``), which cost no job and prune Parquet row groups by statistics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from cdc_platform.lib.columns import col, cols, quote, string_sql

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# At most this many rows are broadcast: a key set is a few MB, a whole history row some tens.
BROADCAST_ROWS = 100_000
# A join whose other side is known to hold at most this many rows is shuffled, not broadcast:
# shuffling a few rows costs less than the Spark job a broadcast is.
TINY_ROWS = 10_000
# Up to this many keys are held on the driver as values (``key_values``).
MAX_KEY_VALUES = 10_000


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


def build_side(df: DataFrame, rows: int | None, probe_rows: int | None = None) -> DataFrame:
    """``df`` as the side of a join it is about to enter: broadcast when ``rows`` (a bound on
    its rows, None if unknown) is at most ``BROADCAST_ROWS`` and the other side is not known
    to be tiny (``probe_rows`` at most ``TINY_ROWS``), else hinted to a sort-merge join, so
    that neither Spark's estimate nor adaptive execution broadcasts it."""
    from pyspark.sql import functions as F

    threshold = df.sparkSession.conf.get("spark.sql.autoBroadcastJoinThreshold", None)
    broadcasts_off = str(threshold).strip() == "-1"  # the operator turned broadcasts off
    both_tiny = probe_rows is not None and probe_rows <= TINY_ROWS
    if rows is not None and rows <= BROADCAST_ROWS and not broadcasts_off and not both_tiny:
        return F.broadcast(df)
    return df.hint("merge")


def key_values(keys: DataFrame, pk: list[str], rows: int | None) -> list[Any] | None:
    """The distinct values of a one-column key, sorted, collected when ``rows`` (a bound on the
    rows of ``keys``) is at most ``MAX_KEY_VALUES``; None when the key has more columns, the
    bound is unknown or larger, or a value is not an integer or a string (only those compare
    exactly with Delta statistics and as literals: timestamps come back naive, and so on)."""
    if len(pk) != 1 or rows is None or rows > MAX_KEY_VALUES:
        return None
    values = {r[0] for r in keys.select(col(pk[0])).collect()}
    if not all(is_plain_key(v) for v in values):
        return None
    # Spark decodes a string that is not valid UTF-8 with replacement characters: such a value
    # would no longer match the stored bytes as a literal (a join compares the bytes).
    if any(isinstance(v, str) and "\ufffd" in v for v in values):
        return None
    if len({type(v) for v in values}) > 1:
        return None
    return sorted(values)


def is_plain_key(value: Any) -> bool:
    """An integer or a string: a key value exact as a literal, in JSON and in Delta statistics
    (a bool is not one, though Python counts it as an integer)."""
    return isinstance(value, int | str) and not isinstance(value, bool)


def in_keys(pk: list[str], values: list[Any]) -> Column:
    """The filter that keeps the rows whose one-column key is among ``values``.

    Written as one SQL ``IN`` list (one call into the JVM, where ``Column.isin`` makes a few
    per value: 10,000 keys were seconds of a small run's planning), each value a literal no
    value can break out of: an integer's digits, a string's UTF-8 bytes in hex."""
    from pyspark.sql import functions as F

    (column,) = pk
    if not values:
        return F.lit(False)
    literals = [_sql_literal(v) for v in values]
    if None in literals:
        return col(column).isin(values)
    return F.expr(f"{quote(column)} IN ({', '.join(str(lit) for lit in literals)})")


def _sql_literal(value: Any) -> str | None:
    """A plain key value (``is_plain_key``) as an exact Spark SQL literal; None if it has none
    (a string that is not valid Unicode)."""
    if isinstance(value, str):
        try:
            return string_sql(value)
        except UnicodeEncodeError:
            return None
    return str(int(value)) if is_plain_key(value) else None


def restrict(
    df: DataFrame,
    keys: DataFrame,
    pk: list[str],
    rows: int | None,
    values: list[Any] | None,
    how: str = "left_semi",
) -> DataFrame:
    """``df`` joined ``left_semi`` (or ``left_anti``) with ``keys``: a filter on ``values``
    when they are held (``key_values``), else a join (``build_side``)."""
    from pyspark.sql import functions as F

    if values is not None:
        keep = in_keys(pk, values)  # null for a null key: in no set, as in a join
        return df.filter(keep if how == "left_semi" else ~F.coalesce(keep, F.lit(False)))
    return df.join(build_side(keys.select(*cols(pk)), rows), pk, how)
