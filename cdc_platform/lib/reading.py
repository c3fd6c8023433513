"""Reading landing files into change events, in Spark tasks, with bad files set aside.

Two passes over the files, both inside Spark tasks (the driver sees only file names, schemas
and counts):

1. *inspect*: decode each file (decrypt, decompress, parse), check every row's key and change
   columns, and report its schema, or the first bad row and why.
2. *read*: decode the files that passed into Arrow batches conformed to one schema, the table's
   schema so far widened with any new columns.

A file with any bad row is set aside whole (quarantined) so that no file is ever half applied;
re-delivering a fixed file and re-materializing its partition brings it in.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdc_platform.lib.codecs import LandingFileError, decode_file
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.csv_format import read_csv_events
from cdc_platform.lib.keyring import Keyring

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

OP = "cdc_operation_type"
SEQ = "cdc_change_seq"
TS = "cdc_commit_timestamp"
CDC_COLUMNS = (OP, SEQ, TS)
OPERATIONS = ("INSERT", "UPDATE", "DELETE")
UNMODIFIED = "_cdc_unmodified"
SOURCE_FILE = "_cdc_source_file"
SOURCE_ROW = "_cdc_source_row"
TS_TYPE = pa.timestamp("us", tz="UTC")
RESERVED_PREFIXES = ("_fivetran_", "_cdc_")


@dataclass(frozen=True)
class FileReport:
    """What inspecting one landing file found: its schema, or why it is set aside."""

    path: str
    num_rows: int
    schema: pa.Schema | None
    error: str | None = None
    error_row: int | None = None
    bad_rows: int = 0
    seq_min: int | None = None
    seq_max: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def normalize_type(t: pa.DataType) -> pa.DataType:
    """One Arrow type per logical type, so files written by different tools agree."""
    if pa.types.is_dictionary(t):
        return normalize_type(t.value_type)
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    ):
        return pa.binary()
    if pa.types.is_timestamp(t):
        return TS_TYPE
    if pa.types.is_date(t):
        return pa.date32()
    if pa.types.is_time(t):
        return pa.string()
    return t


class LandingReader:
    """Decodes a table's landing files; picklable, so Spark ships it to the tasks.

    The keyring travels inside the pickled task closure, never in Spark conf, logs or the UI.
    """

    def __init__(
        self, table: TableConfig, landing_root: Path, keyring: Keyring | None = None
    ) -> None:
        self.table = table
        self.landing_root = str(landing_root)
        self.keyring = keyring or Keyring.empty()

    def __repr__(self) -> str:
        return f"LandingReader({self.table.name!r})"

    # -- decoding ---------------------------------------------------------------------------

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.landing_root)

    def load(self, path: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The file's rows as Arrow, types normalized; raises LandingFileError with a reason."""
        t = self.table
        try:
            if not t.is_encoded:
                tbl = pq.read_table(path, columns=list(columns) if columns else None)
            else:
                keys = (
                    self.keyring.keys_for(t.name, self.relative(path))
                    if t.encryption != "none"
                    else []
                )
                data = decode_file(
                    path,
                    t.compression,
                    t.encryption,
                    keys,
                    file_format=t.format,
                    table=t.name,
                    relative_path=self.relative(path),
                )
                if t.format == "csv":
                    tbl = read_csv_events(data, t, source=path)
                else:
                    tbl = pq.read_table(
                        io.BytesIO(data), columns=list(columns) if columns else None
                    )
        except LandingFileError:
            raise
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            kind = "Parquet" if t.format == "parquet" else t.format.upper()
            raise LandingFileError(f"not a readable {kind} file: {exc}") from None
        return self._normalize(tbl)

    def _normalize(self, tbl: pa.Table) -> pa.Table:
        cols, names = [], []
        for name, column in zip(tbl.column_names, tbl.columns, strict=True):
            if name == UNMODIFIED:
                cols.append(column)
            elif name == OP:
                cols.append(pc.utf8_upper(column.cast(pa.string())))
            elif name == TS and pa.types.is_string(normalize_type(column.type)):
                cols.append(_parse_timestamps(column.cast(pa.string())))
            else:
                target = normalize_type(column.type)
                cols.append(column if column.type == target else column.cast(target, safe=False))
            names.append(name)
        return pa.table(cols, names=names)

    # -- pass 1: inspect ----------------------------------------------------------------------

    def inspect(self, path: str) -> FileReport:
        needed = [*self.table.primary_key, *CDC_COLUMNS]
        try:
            if not self.table.is_encoded:
                schema = _read_parquet_schema(path)
                missing = [c for c in needed if c not in schema.names]
                if missing:
                    return FileReport(path, 0, None, f"missing required column(s) {missing}")
                tbl = self.load(path, columns=needed)
            else:
                tbl = self.load(path)
                schema = tbl.schema
            schema = pa.schema([pa.field(f.name, normalize_type(f.type)) for f in schema])
        except LandingFileError as exc:
            return FileReport(path, 0, None, str(exc), getattr(exc, "row", None))
        except Exception as exc:  # a reader bug or an exotic file must still name the file
            return FileReport(
                path, 0, None, f"could not read the file: {type(exc).__name__}: {exc}"
            )
        error, row, bad = validate_rows(tbl, self.table.primary_key)
        if error:
            return FileReport(path, tbl.num_rows, schema, error, row, bad)
        bounds = pc.min_max(tbl[SEQ]).as_py() if tbl.num_rows else {"min": None, "max": None}
        return FileReport(
            path,
            tbl.num_rows,
            schema,
            seq_min=bounds["min"],
            seq_max=bounds["max"],
        )

    # -- pass 2: read -------------------------------------------------------------------------

    def read_conformed(self, path: str, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
        """The file's events shaped exactly as ``schema`` (missing columns become nulls)."""
        tbl = self.load(path)
        n = tbl.num_rows
        arrays = []
        for field in schema:
            if field.name == SOURCE_FILE:
                arrays.append(pa.array([self.relative(path)] * n, pa.string()))
            elif field.name == SOURCE_ROW:
                arrays.append(pa.array(range(1, n + 1), pa.int64()))
            elif field.name in tbl.column_names:
                arrays.append(tbl.column(field.name).cast(field.type, safe=False))
            else:
                arrays.append(pa.nulls(n, field.type))
        yield from pa.table(arrays, schema=schema).to_batches(max_chunksize=50_000)


def _parse_timestamps(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """ISO-8601 strings (as Fivetran's Parquet writes instants) to UTC timestamps; naive means UTC.

    Left as strings if any value does not parse: ``validate_rows`` then names the first one.
    """
    for target in (TS_TYPE, pa.timestamp("us")):
        try:
            return column.cast(target).cast(TS_TYPE)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    return column


def _first_unparsable(column: pa.ChunkedArray) -> int:
    for i, value in enumerate(column.to_pylist()):
        if value is not None and pa.types.is_string(
            _parse_timestamps(pa.chunked_array([[value]])).type
        ):
            return i
    return 0


def _read_parquet_schema(path: str) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise LandingFileError(f"not a readable Parquet file: {exc}") from None


def validate_rows(tbl: pa.Table, primary_key: Sequence[str]) -> tuple[str | None, int | None, int]:
    """The first bad row (1-based) and why, plus how many rows are bad; (None, None, 0) if clean."""
    missing = [c for c in (*primary_key, *CDC_COLUMNS) if c not in tbl.column_names]
    if missing:
        return f"missing required column(s) {missing}", None, 0
    if tbl.num_rows == 0:
        return None, None, 0
    checks: list[tuple[pa.ChunkedArray, str]] = []
    for key in primary_key:
        checks.append((pc.is_null(tbl[key]), f"primary key column '{key}' is null"))
    op = tbl[OP]
    checks.append(
        (
            pc.invert(pc.fill_null(pc.is_in(op, pa.array(OPERATIONS)), False)),
            f"{OP} is not INSERT, UPDATE or DELETE",
        )
    )
    checks.append((pc.is_null(tbl[SEQ]), f"{SEQ} is missing"))
    checks.append((pc.is_null(tbl[TS]), f"{TS} is missing"))
    if not pa.types.is_integer(tbl[SEQ].type):
        return f"{SEQ} has type {tbl[SEQ].type}, expected an integer", None, 0
    if pa.types.is_string(tbl[TS].type):
        row = _first_unparsable(tbl[TS])
        return (
            f"row {row + 1}: {TS} {tbl[TS][row].as_py()!r} is not an ISO-8601 timestamp",
            row + 1,
            1,
        )
    if not pa.types.is_timestamp(tbl[TS].type):
        return f"{TS} has type {tbl[TS].type}, expected a timestamp", None, 0
    any_bad = None
    for mask, _ in checks:
        any_bad = mask if any_bad is None else pc.or_(any_bad, mask)
    bad_count = pc.sum(any_bad.cast(pa.int64())).as_py() or 0
    if not bad_count:
        return None, None, 0
    first = pc.index(any_bad, True).as_py()
    for mask, reason in checks:
        if mask[first].as_py():
            detail = reason
            if reason.startswith(OP):
                detail = f"{OP} {op[first].as_py()!r} is not INSERT, UPDATE or DELETE"
            more = f" ({bad_count} bad rows in all)" if bad_count > 1 else ""
            return f"row {first + 1}: {detail}{more}", first + 1, bad_count
    raise AssertionError("unreachable: a bad row matched no check")


def inspect_files(
    spark: SparkSession, reader: LandingReader, paths: Sequence[str]
) -> list[FileReport]:
    """Pass 1, one Spark task per file (up to a cap); only the small reports come back."""
    if not paths:
        return []
    slices = min(len(paths), max(1, spark.sparkContext.defaultParallelism * 4))
    return spark.sparkContext.parallelize(list(paths), slices).map(reader.inspect).collect()


def unify_schema(
    established: pa.Schema | None, reports: Sequence[FileReport]
) -> tuple[list[pa.Field], dict[str, str]]:
    """The key and data columns after these files, and the files set aside for a type clash.

    Columns are only ever added (a column that disappears from the source stays, null from
    then on). A file whose column type contradicts the table's is set aside, not coerced. A
    column of Arrow type ``null`` (every value null, no declared type) is no evidence of a
    type: it never clashes, and is only added once some file gives it a real type.
    """
    skip = {*CDC_COLUMNS, UNMODIFIED, SOURCE_FILE, SOURCE_ROW}
    fields: dict[str, pa.DataType] = {}
    if established is not None:
        fields.update({f.name: f.type for f in established})
    rejected: dict[str, str] = {}
    for report in sorted(reports, key=lambda r: r.path):
        assert report.schema is not None
        typed = [f for f in report.schema if f.name not in skip and not pa.types.is_null(f.type)]
        clash = None
        for f in typed:
            have = fields.get(f.name)
            if f.name.startswith(RESERVED_PREFIXES):
                clash = f"column '{f.name}' uses a reserved system prefix {RESERVED_PREFIXES}"
            elif have is not None and f.type != have:
                clash = f"column '{f.name}' has type {f.type} in this file but {have} in the table"
            if clash:
                break
        if clash:
            rejected[report.path] = clash
            continue
        for f in typed:
            fields.setdefault(f.name, f.type)
    return [pa.field(name, t) for name, t in fields.items()], rejected


def event_schema(key_and_data: Sequence[pa.Field]) -> pa.Schema:
    """The shape of events as read: key and data columns, the change columns, provenance."""
    return pa.schema(
        [
            *key_and_data,
            pa.field(OP, pa.string()),
            pa.field(SEQ, pa.int64()),
            pa.field(TS, TS_TYPE),
            pa.field(UNMODIFIED, pa.list_(pa.string())),
            pa.field(SOURCE_FILE, pa.string()),
            pa.field(SOURCE_ROW, pa.int64()),
        ]
    )


def read_events(
    spark: SparkSession, reader: LandingReader, paths: Sequence[str], schema: pa.Schema
) -> DataFrame:
    """Pass 2: a DataFrame of every event in ``paths`` (lazy; decoded in the tasks)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    spark_schema = from_arrow_schema(schema)
    slices = min(len(paths), max(1, spark.sparkContext.defaultParallelism * 4))
    path_df = spark.createDataFrame(
        spark.sparkContext.parallelize([(p,) for p in paths], slices), "path string"
    )

    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path in batch.column(0).to_pylist():
                yield from reader.read_conformed(path, schema)

    return path_df.mapInArrow(decode, spark_schema)
