"""Point-in-time reads of one snapshot of a history table (``Reads``): the rows valid at a
time and the current rows, as Spark, Arrow or SQL. ``HistoryTable.read`` gives the handle's;
``cdc_platform.read`` opens one by path (its docstring is the rule and the user's guide)."""

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
class Reads:
    """One version of the history table: what every read works from (``cdc_platform.read``
    says the rule and what comes back)."""

    table: Table
    version: int
    schema: pa.Schema  # the whole table, state columns included
    files: tuple[DataFile, ...]

    @classmethod
    def open(cls, table: TableRef, version: int | None = None) -> Reads:
        from cdc_platform.lib.storage.table import Table

        path = history_path(table)
        history = Table.open(path, version)
        if history.version is None:
            raise FileNotFoundError(f"no Delta table at {path}: has the table been materialized?")
        return cls.of(history)

    @classmethod
    def of(cls, history: Table) -> Reads:
        """The reads of a snapshot already opened (a ``HistoryTable``'s)."""
        if history.version is None:
            raise FileNotFoundError(
                f"no Delta table at {history.location}: has the table been materialized?"
            )
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

    # -- Spark --------------------------------------------------------------------------------

    def as_of(self, ts: datetime | str, spark: SparkSession | None = None) -> DataFrame:
        """The version of every key valid at ``ts``, as a lazy Spark DataFrame (``spark``:
        the active session by default; none is ever created here)."""
        return self._spark(as_of_instant(ts), spark)

    def current(self, spark: SparkSession | None = None) -> DataFrame:
        """The active rows (one per live key), from the live files only."""
        return self._spark(None, spark)

    def _spark(self, at: datetime | None, spark: SparkSession | None) -> DataFrame:
        from pyspark.sql import SparkSession

        session = spark or SparkSession.getActiveSession()
        if session is None:
            raise ValueError("no active SparkSession: pass spark=<your session>")
        rows = self.table.read(session, self.files_at(at))
        if at is None:
            valid = col(ACTIVE)
        else:
            instant = timestamp_lit(at)  # exact before 1582 too (F.lit(datetime) is not)
            valid = (col(START) <= instant) & (col(END) >= instant)
        return rows.filter(valid).select(*cols(self.columns))

    # -- Arrow --------------------------------------------------------------------------------

    def as_of_arrow(self, ts: datetime | str) -> ds.Dataset:
        """The version of every key valid at ``ts``, as a filtered Arrow dataset."""
        return self._arrow(as_of_instant(ts))

    def current_arrow(self) -> ds.Dataset:
        """The active rows as a filtered Arrow dataset over the live files only."""
        return self._arrow(None)

    def _arrow(self, at: datetime | None) -> ds.Dataset:
        import pyarrow as pa
        import pyarrow.dataset as ds

        from cdc_platform.lib.columns import TS_TYPE

        # A dataset schema with the state columns left out reads only the returned columns.
        schema = pa.schema([self.schema.field(n) for n in self.columns])
        files = self.files_at(at)
        if self.path.is_local:
            dataset = ds.dataset(self.paths(files), schema=schema, format="parquet")
        else:  # relative paths on a file system rooted at the table, with its storage options
            fs = self.path.filesystem()
            dataset = ds.dataset(
                [f.path for f in files], schema=schema, format="parquet", filesystem=fs
            )
        if at is None:
            return dataset.filter(ds.field(ACTIVE) == pa.scalar(True))
        instant = pa.scalar(at, TS_TYPE)
        return dataset.filter((ds.field(START) <= instant) & (ds.field(END) >= instant))

    # -- SQL ----------------------------------------------------------------------------------

    def as_of_sql(
        self, ts: datetime | str, engine: Engine = "duckdb", relation: str | None = None
    ) -> str:
        """SQL selecting the version of every key valid at ``ts`` (``cdc_platform.read``)."""
        return self._sql(as_of_instant(ts), engine, relation)

    def current_sql(self, engine: Engine = "duckdb", relation: str | None = None) -> str:
        """SQL selecting the active rows; for DuckDB the ``FROM`` lists the live files only."""
        return self._sql(None, engine, relation)

    def _sql(self, at: datetime | None, engine: Engine, relation: str | None) -> str:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, not {engine!r}")
        if relation is None:
            relation = (
                _read_parquet(self, at)
                if engine == "duckdb"
                else sql_identifier(os.path.basename(str(self.path)))
            )
        select = ", ".join(sql_identifier(c) for c in self.columns)
        if at is None:
            where = sql_identifier(ACTIVE)
        else:
            instant = sql_timestamp(at)
            where = (
                f"{sql_identifier(START)} <= {instant}\n  AND {sql_identifier(END)} >= {instant}"
            )
        return f"SELECT {select}\nFROM {relation}\nWHERE {where}"


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


def _read_parquet(snap: Reads, at: datetime | None) -> str:
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
