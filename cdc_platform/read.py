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

Nothing heavy is imported here: Spark, delta-rs and Arrow's dataset module load on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any, Literal

from cdc_platform.lib.columns import (
    ACTIVE,
    END,
    HISTORY_SYSTEM_COLUMNS,
    ROW_ID,
    START,
    TMAX,
    col,
    cols,
    is_reserved,
    timestamp_lit,
)
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.dataset as ds
    from pyspark.sql import DataFrame, SparkSession

    from cdc_platform.lib.storage.delta import DataFile
    from cdc_platform.lib.storage.table import Table

TableRef = str | os.PathLike[str] | Location | TablePaths
Engine = Literal["duckdb", "polars"]
ENGINES: tuple[Engine, ...] = ("duckdb", "polars")


def history_path(table: TableRef) -> Location:
    """The history table's folder, from a path, a URI, a ``Location`` or a ``TablePaths``."""
    if isinstance(table, TablePaths):
        return table.history
    if isinstance(table, str | os.PathLike | Location):
        return Location.of(table)
    raise TypeError(f"table must be a path or TablePaths, not {type(table).__name__}: {table!r}")


def as_of_instant(ts: datetime | str) -> datetime:
    """``ts`` as the aware UTC millisecond the rule compares with (truncated, never rounded).

    Raises TypeError for anything but a datetime or a string (a bare ``date`` is refused: it
    does not say which instant of the day is meant), ValueError for a string that is not
    ISO-8601.
    """
    if isinstance(ts, str):
        import pyarrow as pa

        from cdc_platform.lib.landing.rows.timestamps import CAST_ERRORS, parse_timestamps

        try:
            parsed = parse_timestamps(pa.array([ts], pa.string()))[0].as_py()
        except CAST_ERRORS:
            parsed = None
        if not isinstance(parsed, datetime):
            raise ValueError(f"not an ISO-8601 timestamp: {ts!r}")
        ts = parsed
    elif not isinstance(ts, datetime):
        hint = " (pass a datetime: which instant of the day?)" if isinstance(ts, date) else ""
        raise TypeError(f"ts must be a datetime or an ISO-8601 string, not {ts!r}{hint}")
    try:
        utc = ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
    except (ValueError, OverflowError) as exc:  # NaT, or an offset that leaves datetime's range
        raise ValueError(f"ts {ts!r} is not a representable UTC instant: {exc}") from exc
    return utc.replace(microsecond=utc.microsecond // 1000 * 1000)


@dataclass(frozen=True)
class _Snapshot:
    """One version of the history table: what every read in this module works from."""

    table: Table
    version: int
    schema: pa.Schema  # the whole table, state columns included
    files: tuple[DataFile, ...]

    @classmethod
    def open(cls, table: TableRef, version: int | None = None) -> _Snapshot:
        from cdc_platform.lib.storage.table import Table

        path = history_path(table)
        history = Table.open(path, version)
        if history.version is None:
            raise FileNotFoundError(f"no Delta table at {path}: has the table been materialized?")
        return cls(history, history.version, history.arrow_schema, tuple(history.files))

    @property
    def path(self) -> Location:
        return self.table.location

    @property
    def columns(self) -> list[str]:
        """The columns a read returns: key and data columns in table order (a column added
        later comes after the system columns in the table; a keyless table's `_fivetran_id`
        first), then the ``_fivetran_*`` ones."""
        names = self.schema.names
        return [n for n in names if not is_reserved(n) or n == ROW_ID] + [
            n for n in HISTORY_SYSTEM_COLUMNS if n in names
        ]

    def files_at(self, at: datetime | None) -> list[DataFile]:
        """The files that may hold a row valid at ``at`` (None: an active row)."""
        return [f for f in self.files if may_hold(f, at)]

    def paths(self, files: Sequence[DataFile]) -> list[str]:
        from cdc_platform.lib.storage import delta

        return delta.absolute_paths(self.path, files)


def may_hold(f: DataFile, at: datetime | None) -> bool:
    """False only when the file's statistics rule out every row we want.

    The bounds are exact or wider (timestamps are widened to whole milliseconds when written),
    so a file that is skipped never held such a row.
    """
    if at is None:
        return f.max_values.get(ACTIVE) is not False
    first_start, last_end = _utc(f.min_values.get(START)), _utc(f.max_values.get(END))
    if first_start is not None and first_start > at:
        return False
    return not (last_end is not None and last_end < at)


def _utc(value: Any) -> datetime | None:
    if not isinstance(value, datetime):
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# -- Spark ------------------------------------------------------------------------------------


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
    return _spark_read(table, as_of_instant(ts), spark, version)


def current(
    table: TableRef, *, spark: SparkSession | None = None, version: int | None = None
) -> DataFrame:
    """The active rows (one per live key), from the live files only, as a Spark DataFrame."""
    return _spark_read(table, None, spark, version)


def _spark_read(
    table: TableRef, at: datetime | None, spark: SparkSession | None, version: int | None
) -> DataFrame:
    from pyspark.sql import SparkSession

    session = spark or SparkSession.getActiveSession()
    if session is None:
        raise ValueError("no active SparkSession: pass spark=<your session>")
    snap = _Snapshot.open(table, version)
    rows = snap.table.read(session, snap.files_at(at))
    if at is None:
        valid = col(ACTIVE)
    else:
        instant = timestamp_lit(at)  # exact before 1582 too (F.lit(datetime) is not)
        valid = (col(START) <= instant) & (col(END) >= instant)
    return rows.filter(valid).select(*cols(snap.columns))


# -- Arrow ------------------------------------------------------------------------------------


def as_of_arrow(table: TableRef, ts: datetime | str, *, version: int | None = None) -> ds.Dataset:
    """The version of every key valid at ``ts``, as a filtered Arrow dataset (nothing read yet)."""
    return _arrow_read(table, as_of_instant(ts), version)


def current_arrow(table: TableRef, *, version: int | None = None) -> ds.Dataset:
    """The active rows as a filtered Arrow dataset over the live files only."""
    return _arrow_read(table, None, version)


def _arrow_read(table: TableRef, at: datetime | None, version: int | None) -> ds.Dataset:
    import pyarrow as pa
    import pyarrow.dataset as ds

    from cdc_platform.lib.columns import TS_TYPE

    snap = _Snapshot.open(table, version)
    # A dataset schema with the state columns left out reads only the returned columns.
    schema = pa.schema([snap.schema.field(n) for n in snap.columns])
    files = snap.files_at(at)
    if snap.path.is_local:
        dataset = ds.dataset(snap.paths(files), schema=schema, format="parquet")
    else:  # relative paths on a file system rooted at the table, with its storage options
        fs = snap.path.filesystem()
        dataset = ds.dataset(
            [f.path for f in files], schema=schema, format="parquet", filesystem=fs
        )
    if at is None:
        return dataset.filter(ds.field(ACTIVE) == pa.scalar(True))
    instant = pa.scalar(at, TS_TYPE)
    return dataset.filter((ds.field(START) <= instant) & (ds.field(END) >= instant))


# -- SQL --------------------------------------------------------------------------------------


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
    return _sql(table, as_of_instant(ts), engine, relation, version)


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
    return _sql(table, None, engine, relation, version)


def _sql(
    table: TableRef,
    at: datetime | None,
    engine: Engine,
    relation: str | None,
    version: int | None,
) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, not {engine!r}")
    snap = _Snapshot.open(table, version)
    if relation is None:
        relation = (
            _read_parquet(snap, at)
            if engine == "duckdb"
            else sql_identifier(os.path.basename(str(snap.path)))
        )
    select = ", ".join(sql_identifier(c) for c in snap.columns)
    if at is None:
        where = sql_identifier(ACTIVE)
    else:
        instant = sql_timestamp(at)
        where = f"{sql_identifier(START)} <= {instant}\n  AND {sql_identifier(END)} >= {instant}"
    return f"SELECT {select}\nFROM {relation}\nWHERE {where}"


def _read_parquet(snap: _Snapshot, at: datetime | None) -> str:
    """``read_parquet([...], union_by_name = true)`` over the files that may hold the rows.

    DuckDB's columns are those of the files it is given, and a file written before a column
    was added lacks it; so if the footers of the files chosen miss a column, other files of
    the snapshot that have it are added (the ``WHERE`` still filters their rows). A column no
    file has holds only nulls: it is selected as ``NULL``.
    """
    import pyarrow.parquet as pq

    chosen = snap.files_at(at)
    wanted = set(snap.columns)
    have: set[str] = set()
    if not snap.path.is_local:  # the SQL names files; DuckDB would need the store's credentials
        raise ValueError(
            f"SQL for DuckDB lists local files; {snap.path} is on an object store: use "
            "engine='polars', as_of/current (Spark) or as_of_arrow/current_arrow"
        )
    for path in snap.paths(chosen):
        have |= set(pq.read_schema(path).names)
    chosen_paths = {f.path for f in chosen}
    for extra in snap.files:
        if chosen and wanted <= have:
            break
        if extra.path in chosen_paths:
            continue
        names = set(pq.read_schema(snap.paths([extra])[0]).names)
        if chosen and not (wanted - have) & names:
            continue
        chosen.append(extra)
        have |= names
    if not chosen:
        raise ValueError(
            f"the Delta table at {snap.path} (version {snap.version}) has no data files: "
            "there is nothing for SQL to read (as_of and current return no rows)"
        )
    files = ", ".join(sql_string(p) for p in snap.paths(chosen))
    source = f"read_parquet([{files}], union_by_name = true)"
    missing = [c for c in snap.columns if c not in have]
    if not missing:
        return source
    nulls = ", ".join(f"NULL AS {sql_identifier(c)}" for c in missing)
    return f"(SELECT *, {nulls} FROM {source})"


def sql_identifier(name: str) -> str:
    """A column or table name as a SQL identifier (double quotes, inner quotes doubled)."""
    return '"' + name.replace('"', '""') + '"'


def sql_string(value: str) -> str:
    """A SQL string literal (single quotes, inner quotes doubled)."""
    return "'" + value.replace("'", "''") + "'"


def sql_timestamp(at: datetime) -> str:
    """A UTC instant as a zoned SQL timestamp both DuckDB and Polars compare exactly."""
    utc = at.astimezone(UTC)
    return f"CAST({sql_string(utc.isoformat(sep=' ', timespec='milliseconds'))} AS TIMESTAMPTZ)"


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
    "sql_identifier",
    "sql_string",
    "sql_timestamp",
]
