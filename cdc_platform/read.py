"""Point-in-time reads of a history table: the rows valid at a time, and the current rows.

A history table keeps every version of a row with the span during which it was current
(``docs/HISTORY_MODE.md``, section 7). This module answers the two questions users ask of it,
in three forms:

* ``as_of(table, ts, spark=...)`` / ``current(table, spark=...)``: a lazy Spark DataFrame;
* ``as_of_arrow(table, ts)`` / ``current_arrow(table)``: a filtered ``pyarrow.dataset.Dataset``
  (DuckDB and Polars scan it directly; ``.to_table()`` materializes it);
* ``as_of_sql(table, ts)`` / ``current_sql(table)``: SQL text to paste into DuckDB (self-contained)
  or Polars (over a frame the caller registers).

``table`` is the history table's folder (``<warehouse_root>/<table>``, a ``str`` or a path) or
its ``TablePaths`` (``TablePaths.of(warehouse_root, "orders")``).

**The rule.** Versions are closed spans of milliseconds: a version is valid at ``ts`` when
``_fivetran_start <= ms <= _fivetran_end``, where ``ms`` is ``ts`` in UTC truncated to the
millisecond. An update at ``T`` ends the old version at ``T - 1 ms``, so exactly one version of
a key is valid at any instant it exists; a deleted version stays valid through the delete's own
millisecond (its ``_fivetran_end``). ``current`` is the active rows (``_fivetran_active``): the
live version of every key that exists, which is ``as_of`` TMAX.

**What comes back.** The key and data columns and the contract's four ``_fivetran_*`` columns
(so a row says since when it holds). The merge's ``_cdc_*`` state columns are left out: they
describe how the platform writes the table, not the data.

**Timestamps.** ``ts`` is a ``datetime`` (naive means UTC, as everywhere in the platform) or an
ISO-8601 string read by the platform's one parser (``lib/landing/rows/timestamps.py``: no zone
means UTC, a date alone means midnight). Anything else raises ``TypeError``; an unparsable string
``ValueError``.

**Files read.** Reads use one Delta snapshot and skip files by their Delta statistics. Every
history file holds one segment (live, deleted or closed; ``lib/history/merge/``) and its statistics
carry exact bounds of ``_fivetran_active``, ``_fivetran_start`` and ``_fivetran_end``, so
``current`` reads only the live files (never a closed or deleted one), and ``as_of`` only files
whose span of starts and ends can contain ``ts``. A file without statistics is always read.

Each function opens the table's latest snapshot (or ``version``'s) and reads it through
``lib.history.reads.Reads``, the reads a ``HistoryTable`` handle gives as ``table.read``. Nothing
heavy is imported here: Spark, delta-rs and Arrow's dataset module load on first use.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import TMAX
from cdc_platform.lib.history.reads import (
    ENGINES,
    Engine,
    Reads,
    TableRef,
    as_of_instant,
    history_path,
    may_hold,
    sql_identifier,
    sql_string,
    sql_timestamp,
)

if TYPE_CHECKING:
    import pyarrow.dataset as ds
    from pyspark.sql import DataFrame, SparkSession


def as_of(
    table: TableRef,
    ts: datetime | str,
    *,
    spark: SparkSession | None = None,
    version: int | None = None,
) -> DataFrame:
    """The version of every key valid at ``ts``, as a lazy Spark DataFrame.

    ``spark`` defaults to the active session (none is ever created here); ``version`` reads
    that Delta version of the table instead of the latest.
    """
    return Reads.open(table, version).as_of(ts, spark)


def current(
    table: TableRef, *, spark: SparkSession | None = None, version: int | None = None
) -> DataFrame:
    """The active rows (one per live key), from the live files only, as a Spark DataFrame."""
    return Reads.open(table, version).current(spark)


def as_of_arrow(table: TableRef, ts: datetime | str, *, version: int | None = None) -> ds.Dataset:
    """The version of every key valid at ``ts``, as a filtered Arrow dataset (nothing read yet)."""
    return Reads.open(table, version).as_of_arrow(ts)


def current_arrow(table: TableRef, *, version: int | None = None) -> ds.Dataset:
    """The active rows as a filtered Arrow dataset over the live files only."""
    return Reads.open(table, version).current_arrow()


def as_of_sql(
    table: TableRef,
    ts: datetime | str,
    *,
    engine: Engine = "duckdb",
    relation: str | None = None,
    version: int | None = None,
) -> str:
    """SQL selecting the version of every key valid at ``ts``.

    ``engine="duckdb"``: self-contained; the ``FROM`` lists, with ``read_parquet``, the Parquet
    files of the table's latest Delta version (or ``version``) that may hold such rows. It
    keeps giving that version's answer until a VACUUM deletes a file it names (replaced files
    are kept 168 hours by default); generate it again to see later commits.

    ``engine="polars"``: Polars SQL has no Delta reader (and its ``read_parquet`` needs one
    schema for every file), so the ``FROM`` names a frame to register, by default the table's
    folder name: ``pl.SQLContext({name: pl.scan_delta(path)}).execute(sql)``.

    ``relation`` replaces the ``FROM`` with any relation, e.g. ``delta_scan('<path>')`` for
    DuckDB's delta extension (which DuckDB downloads on first use).
    """
    return Reads.open(table, version).as_of_sql(ts, engine, relation)


def current_sql(
    table: TableRef,
    *,
    engine: Engine = "duckdb",
    relation: str | None = None,
    version: int | None = None,
) -> str:
    """SQL selecting the active rows; for DuckDB the ``FROM`` lists the live files only.

    ``engine``, ``relation`` and ``version`` as in ``as_of_sql``.
    """
    return Reads.open(table, version).current_sql(engine, relation)


__all__ = [
    "ENGINES",
    "TMAX",
    "Engine",
    "TableRef",
    "as_of",
    "as_of_arrow",
    "as_of_instant",
    "as_of_sql",
    "current",
    "current_arrow",
    "current_sql",
    "history_path",
    "may_hold",
    "sql_identifier",
    "sql_string",
    "sql_timestamp",
]
