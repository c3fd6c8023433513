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
import logging
import os
import pickle
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdc_platform.lib.columns import (
    CDC_COLUMNS,
    OP,
    OPERATIONS,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    TMAX,
    TMAX_SQL,
    TMIN,
    TS,
    TS_TYPE,
    UNMODIFIED,
    UNMODIFIED_TYPE,
    is_reserved,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.codecs import LandingFileError, decode_file, too_large
from cdc_platform.lib.landing.formats.csv import read_csv_events
from cdc_platform.lib.landing.keyring import Keyring
from cdc_platform.lib.landing.layout import printable_path
from cdc_platform.lib.landing.safe_open import (
    CHANGED,
    FileId,
    check_unchanged,
    open_beneath,
    path_ids,
)
from cdc_platform.lib.landing.timestamps import CAST_ERRORS, first_failure, parse_timestamps
from cdc_platform.lib.storage.schema import (
    NATIVE_READ_OPTIONS,
    WIDENINGS,
    is_list,
    normalize_type,
    unsupported_type,
    widest,
)
from cdc_platform.lib.storage.stores import read_parquet

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

T = TypeVar("T")

__all__ = [
    "FileReport",
    "LandingReader",
    "NativeGuard",
    "NativeReadChangedError",
    "event_schema",
    "inspect_files",
    "read_events",
    "row_reason",
    "unify_schema",
    "validate_native",
    "validate_rows",
]

INT64_MAX = 2**63 - 1
# Spark, Delta and Python's datetime all represent years 1 to 9999, no more.
_DATE_MIN, _DATE_MAX = -719_162, 2_932_896  # 0001-01-01 and 9999-12-31, in days since 1970
_US_MIN, _US_MAX = _DATE_MIN * 86_400_000_000, (_DATE_MAX + 1) * 86_400_000_000 - 1


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
    # Read by Spark's own (vectorized) Parquet reader, not decoded in Python; ``source_uri`` is
    # the file as Spark names it (``_metadata.file_path``), known once its rows were validated.
    native: bool = False
    source_uri: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# Codecs Spark's own Parquet reader has built in (brotli, LZO and Hadoop's old LZ4 need jars).
_NATIVE_CODECS = frozenset({"UNCOMPRESSED", "SNAPPY", "GZIP", "ZSTD", "LZ4_RAW"})
# Spark's hidden per-file column (file path, row index); a data column of that name hides it.
_SPARK_METADATA = "_metadata"


def _native_type(t: pa.DataType, top_level: bool = True) -> bool:
    """True if Spark reads a Parquet column of Arrow type ``t`` exactly as ``normalize_type``
    would make it: already normalized, microsecond timestamps of any zone (or none: naive is
    UTC, and Spark reads a non-UTC-adjusted Parquet timestamp as UTC too), and, as top-level
    columns, the types Spark's reader widens losslessly when asked for the normalized one
    (``_spark_widens``): narrower integers, 32-bit floats, large or dictionary strings."""
    if top_level and _spark_widens(t):
        return True
    if pa.types.is_timestamp(t):
        return t.unit == "us"
    if is_list(t):
        # A list of strings is checked for UTF-8 natively; text deeper down only in Python.
        inner = t.value_type
        if _is_string_like(inner) or pa.types.is_binary(inner):
            return pa.types.is_list(t) and _native_type(inner, top_level=False)
        return pa.types.is_list(t) and _native_type(inner, top_level=False) and not _has_text(inner)
    if pa.types.is_struct(t):
        return all(_native_type(f.type, top_level=False) and not _has_text(f.type) for f in t)
    return not pa.types.is_null(t) and normalize_type(t) == t


def _has_text(t: pa.DataType) -> bool:
    """Whether a type holds strings anywhere (checked for UTF-8 by the Python inspection)."""
    if _is_string_like(t):
        return True
    if is_list(t):
        return _has_text(t.value_type)
    if pa.types.is_struct(t):
        return any(_has_text(f.type) for f in t)
    return False


def _spark_widens(t: pa.DataType) -> bool:
    """A column type Spark's Parquet readers (vectorized or not) read as its normalized type
    with the very values Arrow's cast gives: every integer type but uint64 (whose values above
    2^63-1 must be set aside, in Python) as int64, float32 as float64, large and dictionary
    strings as string. Common in files from pandas and from databases' int/real columns."""
    if pa.types.is_integer(t):
        return not pa.types.is_uint64(t)
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_float32(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _natively_readable(
    schema: pa.Schema, meta: pq.FileMetaData, primary_key: Sequence[str]
) -> bool:
    """A plain Parquet file Spark can read as is; its rows still need validating."""
    types = {f.name: f.type for f in schema}
    if any(name.lower() == _SPARK_METADATA for name in types):
        return False
    if any(c not in types for c in (*primary_key, *CDC_COLUMNS)):
        return False  # the Python inspection names what is missing
    if types[OP] != pa.string() or types[SEQ] != pa.int64():
        return False
    if not (pa.types.is_timestamp(types[TS]) and types[TS].unit == "us"):
        return False
    unmodified = types.get(UNMODIFIED)
    if unmodified is not None and not (
        pa.types.is_list(unmodified) and unmodified.value_type == pa.string()
    ):
        return False
    if not all(_native_type(t) for t in types.values()):
        return False
    codecs = {
        meta.row_group(rg).column(c).compression
        for rg in range(meta.num_row_groups)
        for c in range(meta.num_columns)
    }
    return codecs <= _NATIVE_CODECS


def parquet_bytes(meta: pq.FileMetaData) -> int:
    """The uncompressed size of a Parquet file's row groups, as its footer gives it."""
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def check_parquet_size(meta: pq.FileMetaData, max_bytes: int) -> None:
    """Refuse a Parquet file whose row groups expand past ``max_bytes`` (a Parquet bomb:
    its pages compress as well as any ZSTD stream) before any page is read."""
    if parquet_bytes(meta) > max_bytes:
        raise LandingFileError(too_large(max_bytes))


def _first_invalid_row(values: pa.Array) -> int | None:
    """The first row of ``values`` that fails Arrow's full validation (bisecting prefixes)."""
    lo, hi = 0, len(values)  # the first bad row is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            values.slice(lo, mid - lo).validate(full=True)
            lo = mid
        except pa.ArrowInvalid:
            hi = mid
    try:
        values.slice(lo, 1).validate(full=True)
    except pa.ArrowInvalid:
        return lo
    return None


def _needs_value_check(t: pa.DataType) -> bool:
    """True if normalizing a column of type ``t`` can fail on some value (checked in pass 1)."""
    if pa.types.is_dictionary(t):
        return _needs_value_check(t.value_type)
    return (
        pa.types.is_uint64(t)
        or _has_text(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_decimal(t)
        or pa.types.is_nested(t)
    )


def _is_string_like(t: pa.DataType) -> bool:
    return pa.types.is_string(normalize_type(t))


def _to_type(values: pa.Array, target: pa.DataType) -> pa.Array:
    """``values`` as ``target``, never losing a value: raises ArrowInvalid if one does not fit.

    Nanosecond timestamps are truncated to microseconds (the one documented loss: Spark and
    Delta keep microseconds); Spark's date and timestamp range (years 1 to 9999) is enforced.
    """
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_timestamp(values.type) and values.type.unit == "ns":
        values = pc.floor_temporal(values, unit="microsecond")  # pyright: ignore[reportAttributeAccessIssue]
    out = values if values.type == target else values.cast(target, safe=True)
    if pa.types.is_timestamp(target) or pa.types.is_date(target):
        bounds = pc.min_max(out.cast(pa.int64() if pa.types.is_timestamp(target) else pa.int32()))  # pyright: ignore[reportAttributeAccessIssue]
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        low, high = (_US_MIN, _US_MAX) if pa.types.is_timestamp(target) else (_DATE_MIN, _DATE_MAX)
        if lo is not None and (lo < low or hi > high):
            raise pa.ArrowInvalid("outside the years 1 to 9999")
    return out


class LandingReader:
    """Decodes a table's landing files; picklable, so Spark ships it to the tasks.

    Only the table's own keys travel, inside the pickled task closure (over Spark's encrypted
    RPC), never in Spark conf, logs or the UI.
    For an encrypted table no reason ever quotes a cell (or a library message that might):
    reasons name the row and the column only.
    """

    def __init__(
        self, table: TableConfig, landing_root: Path, keyring: Keyring | None = None
    ) -> None:
        self.table = table
        self.landing_root = str(landing_root)
        # Files are opened only below this folder, never through a symlink (``lib.landing.safe_open``).
        self.root = self.landing_root
        self.keyring = (keyring or Keyring.empty()).for_table(table.name)
        self.hide_values = table.encryption != "none"
        # The file each path was when listed: a path holding another file since is not read.
        self.expected: dict[str, FileId] = {}

    def expect(self, listed: Mapping[str, FileId]) -> None:
        """Read each of these paths only if it is still the file the listing saw."""
        self.expected.update({os.path.abspath(p): i for p, i in listed.items()})

    def listed(self, path: str) -> FileId | None:
        """The file the listing saw at ``path`` (None: not listed, nothing to compare)."""
        return self.expected.get(os.path.abspath(path))

    def open(self, path: str) -> BinaryIO:
        """``path`` opened through ``safe_open.open_beneath``: below the root, no symlink, a
        regular file, the one listed. Every read of a file's bytes goes through this."""
        return open_beneath(self.root, path, self.listed(path))

    def changed_since_listed(self, paths: Sequence[str]) -> set[str]:
        """The paths that are no longer the file the listing saw (gone, a symlink or another
        file now, or rewritten in place: size or times moved), by ``lstat`` from the driver."""
        changed = set()
        for path in paths:
            listed = self.listed(path)
            try:
                st = os.lstat(path)
            except OSError:
                changed.add(path)
                continue
            if not stat.S_ISREG(st.st_mode) or (listed is not None and not listed.matches(st)):
                changed.add(path)
        return changed

    def __repr__(self) -> str:
        return f"LandingReader({self.table.name!r})"

    # -- decoding ---------------------------------------------------------------------------

    def relative(self, path: str) -> str:
        """A file's name as the change log, the quarantine and the ledgers record it (a name
        that is not UTF-8, only ever set aside, with ``\\x`` escapes)."""
        return printable_path(os.path.relpath(path, self.landing_root))

    def show(self, value: object) -> str:
        """A cell as a reason may quote it: never for an encrypted table."""
        if self.hide_values:
            return "the value"
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."

    def _detail(self, exc: BaseException) -> str:
        return "" if self.hide_values else f": {exc}"

    def load(self, path: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The file's rows as Arrow, types normalized; raises LandingFileError with a reason."""
        t = self.table
        try:
            if not t.is_encoded:
                with self.open(path) as fh:
                    tbl = self._read_parquet(fh, columns)
                    check_unchanged(fh, self.listed(path))
            else:
                keys = (
                    self.keyring.keys_for(t.name, self.relative(path))
                    if t.encryption != "none"
                    else []
                )
                with self.open(path) as fh:
                    data = decode_file(
                        fh,
                        t.compression,
                        t.encryption,
                        keys,
                        file_format=t.format,
                        table=t.name,
                        relative_path=self.relative(path),
                        max_bytes=t.max_file_bytes,
                    )
                    check_unchanged(fh, self.listed(path))
                if t.format == "csv":
                    tbl = read_csv_events(data, t, source=path, hide_values=self.hide_values)
                else:
                    tbl = self._read_parquet(io.BytesIO(data), columns)
        except LandingFileError:
            raise
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            kind = "Parquet" if t.format == "parquet" else t.format.upper()
            raise LandingFileError(f"not a readable {kind} file{self._detail(exc)}") from None
        self._check_names(tbl.schema)
        self._check_utf8(tbl)
        return self._normalize(tbl)

    def _check_utf8(self, tbl: pa.Table) -> None:
        """Every string is valid UTF-8 (Parquet readers take any bytes as text): else the
        first bad row and column, never the value."""
        for i, (name, column) in enumerate(zip(tbl.column_names, tbl.columns, strict=True)):
            if not _has_text(column.type):
                continue
            try:
                column.validate(full=True)
            except pa.ArrowInvalid:
                # Arrow validates a nested column's children whole: its row is not known.
                top = _is_string_like(column.type)
                row = _first_invalid_row(column.combine_chunks()) if top else None
                where = f"row {row + 1}, " if row is not None else ""
                raise LandingFileError(
                    f"{where}column {self.label(name, i)}: text that is not valid UTF-8",
                    row + 1 if row is not None else None,
                ) from None

    def _read_parquet(self, source: BinaryIO, columns: Sequence[str] | None) -> pa.Table:
        """A Parquet file's rows, once its footer says they fit in ``max_file_bytes``."""
        pf = pq.ParquetFile(source)
        check_parquet_size(pf.metadata, self.table.max_file_bytes)
        return pf.read(columns=list(columns) if columns else None)

    def label(self, name: str, position: int) -> str:
        """How a reason names a column of a file: by name (a landing file's own schema)."""
        return f"'{name}'"

    def _check_names(self, schema: pa.Schema) -> None:
        """Column names the table can hold: each once (ignoring case), none reserved or empty."""
        seen: dict[str, tuple[str, int]] = {}
        for i, f in enumerate(schema):
            name = self.label(f.name, i)
            if not f.name:
                raise LandingFileError(f"column #{i + 1} has an empty name")
            other = seen.get(f.name.lower())
            if other is not None and other[0] == f.name:
                raise LandingFileError(f"column {name} appears twice")
            if other is not None:
                raise LandingFileError(
                    f"columns {self.label(*other)} and {name} differ only in case"
                    " (Delta column names are case-insensitive)"
                )
            seen[f.name.lower()] = (f.name, i)
            if f.name == UNMODIFIED:
                if not (pa.types.is_null(f.type) or normalize_type(f.type) == UNMODIFIED_TYPE):
                    raise LandingFileError(
                        f"column '{UNMODIFIED}' has type {f.type}, expected list<string>"
                    )
            elif is_reserved(f.name):
                raise LandingFileError(
                    f"column {name} uses a reserved system prefix (_fivetran_, _cdc_)"
                )
            elif f.name not in CDC_COLUMNS:
                why = unsupported_type(f.type)
                if why:
                    raise LandingFileError(f"column {name} has type {f.type}: {why}")

    def _normalize(self, tbl: pa.Table) -> pa.Table:
        cols = []
        for i, (name, column) in enumerate(zip(tbl.column_names, tbl.columns, strict=True)):
            if name == OP:
                convert: Callable[[pa.Array], pa.Array] = lambda a: pc.utf8_upper(  # noqa: E731  # pyright: ignore[reportAttributeAccessIssue]
                    _to_type(a, pa.string())
                )
            elif name == TS and _is_string_like(column.type):
                convert = parse_timestamps
            elif name == UNMODIFIED and pa.types.is_null(column.type):
                convert = lambda a: pa.nulls(len(a), UNMODIFIED_TYPE)  # noqa: E731
            else:
                target = normalize_type(column.type)
                convert = lambda a, target=target: _to_type(a, target)  # noqa: E731
            cols.append(self._convert(name, column.combine_chunks(), convert, i))
        return pa.table(cols, names=tbl.column_names)

    def _convert(
        self,
        name: str,
        values: pa.Array,
        convert: Callable[[pa.Array], pa.Array],
        position: int = 0,
    ) -> pa.Array:
        try:
            return convert(values)
        except CAST_ERRORS:
            pass
        row = first_failure(values, convert)
        if name == TS and _is_string_like(values.type):
            what = "is not an ISO-8601 timestamp"
        elif pa.types.is_integer(values.type):
            what = "is out of range for a 64-bit integer"
        elif pa.types.is_timestamp(values.type) or pa.types.is_date(values.type):
            what = "is out of range (years 1 to 9999)"
        else:
            what = f"cannot be read as {normalize_type(values.type)} without losing it"
        label = self.label(name, position)
        if row is None:
            raise LandingFileError(f"column {label}: a value {what}")
        shown = self.show(values[row].as_py())
        raise LandingFileError(f"row {row + 1}, column {label}: {shown} {what}", row + 1)

    # -- pass 1: inspect ----------------------------------------------------------------------

    def native_report(self, path: str) -> FileReport | None:
        """Pass 1 for a file Spark's own Parquet reader can read as is: its footer only.

        Such a file (plain Parquet, every column in its normalized type or one Spark widens
        to it) gets a report with ``native=True`` and its rows unchecked: they are validated
        in Spark SQL (``validate_native``). Any other file gets None: it is inspected in
        Python (``inspect``), which names whatever is wrong with it.
        """
        if self.table.is_encoded:
            return None
        try:
            with self.open(path) as fh:
                pf = pq.ParquetFile(fh)
                schema, meta = pf.schema_arrow, pf.metadata
            self._check_names(schema)
        except Exception:  # whatever it is, the full inspection names it
            return None
        if not _natively_readable(schema, meta, self.table.primary_key):
            return None
        if parquet_bytes(meta) > self.table.max_file_bytes:
            return None  # the inspection sets it aside, saying why
        normalized = pa.schema([pa.field(f.name, normalize_type(f.type)) for f in schema])
        return FileReport(path, meta.num_rows, normalized, native=True)

    def reads_footer_first(self) -> bool:
        """Plain Parquet: pass 1 checks the footer's columns before reading any row."""
        return not self.table.is_encoded

    def inspect(self, path: str) -> FileReport:
        needed = [*self.table.primary_key, *CDC_COLUMNS]
        try:
            if self.reads_footer_first():
                schema = self._read_parquet_schema(path)
                self._check_names(schema)
                missing = [c for c in needed if c not in schema.names]
                if missing:
                    return FileReport(path, 0, None, f"missing required column(s) {missing}")
                checked = [f.name for f in schema if f.name in needed or _needs_value_check(f.type)]
                tbl = self.load(path, columns=checked)
            else:
                tbl = self.load(path)
                schema = tbl.schema
            schema = pa.schema([pa.field(f.name, normalize_type(f.type)) for f in schema])
        except LandingFileError as exc:
            return FileReport(path, 0, None, str(exc), getattr(exc, "row", None))
        except Exception as exc:  # a reader bug or an exotic file must still name the file
            return FileReport(
                path,
                0,
                None,
                f"could not read the file: {type(exc).__name__}{self._detail(exc)}",
            )
        error, row, bad = validate_rows(tbl, self.table.primary_key, self.show)
        if error:
            return FileReport(path, tbl.num_rows, schema, error, row, bad)
        bounds = pc.min_max(tbl[SEQ]).as_py() if tbl.num_rows else {"min": None, "max": None}  # pyright: ignore[reportAttributeAccessIssue]
        return FileReport(
            path,
            tbl.num_rows,
            schema,
            seq_min=bounds["min"],
            seq_max=bounds["max"],
        )

    def _read_parquet_schema(self, path: str) -> pa.Schema:
        try:
            with self.open(path) as fh:
                return pq.read_schema(fh)
        except (pa.ArrowException, OSError) as exc:
            raise LandingFileError(f"not a readable Parquet file{self._detail(exc)}") from None

    # -- pass 2: read -------------------------------------------------------------------------

    def read_conformed(
        self, path: str, schema: pa.Schema, inspected: FileReport | None = None
    ) -> Iterator[pa.RecordBatch]:
        """The file's events shaped exactly as ``schema`` (missing columns become nulls).

        With ``inspected`` (pass 1's report), the rows must still be the ones inspected: valid,
        as many, within its seq range; else the file changed between the passes and nothing of
        it is returned (``changed_file_error``), as when it no longer loads at all."""
        try:
            tbl = self.load(path)
        except LandingFileError:
            # Only a file that is no longer the listed one counts as changed (set aside); any
            # other error (EIO, memory) fails the run, whose hour the sensor asks for again.
            if inspected is None or not self.changed_since_listed([path]):
                raise
            raise changed_file_error(self.relative(path)) from None
        if inspected is not None:
            self._check_as_inspected(path, tbl, inspected)
        n = tbl.num_rows
        arrays = []
        for field in schema:
            if field.name == SOURCE_FILE:
                arrays.append(pa.array([self.relative(path)] * n, pa.string()))
            elif field.name == SOURCE_ROW:
                arrays.append(pa.array(range(1, n + 1), pa.int64()))
            elif field.name in tbl.column_names:
                arrays.append(tbl.column(field.name).cast(field.type))  # checked in pass 1
            else:
                arrays.append(pa.nulls(n, field.type))
        yield from pa.table(arrays, schema=schema).to_batches(max_chunksize=50_000)

    def _check_as_inspected(self, path: str, tbl: pa.Table, inspected: FileReport) -> None:
        error, _, _ = validate_rows(tbl, self.table.primary_key, self.show)
        bounds = pc.min_max(tbl[SEQ]).as_py() if tbl.num_rows else {"min": None, "max": None}  # pyright: ignore[reportAttributeAccessIssue]
        same = (tbl.num_rows, bounds["min"], bounds["max"]) == (
            inspected.num_rows,
            inspected.seq_min,
            inspected.seq_max,
        )
        if error or not same:
            raise changed_file_error(self.relative(path))


def validate_rows(
    tbl: pa.Table,
    primary_key: Sequence[str],
    show: Callable[[object], str] = repr,
) -> tuple[str | None, int | None, int]:
    """The first bad row (1-based) and why, plus how many rows are bad; (None, None, 0) if clean.

    ``show`` renders a cell for the reason (an encrypted table's reader never shows one).
    A commit timestamp must lie in [0001-01-01, 9999-12-31T23:59:59.999Z): at TMAX or later
    a version could not be told from a live one (a delete there would leave the key active).
    """
    missing = [c for c in (*primary_key, *CDC_COLUMNS) if c not in tbl.column_names]
    if missing:
        return f"missing required column(s) {missing}", None, 0
    if tbl.num_rows == 0:
        return None, None, 0
    if not pa.types.is_integer(tbl[SEQ].type):
        return f"{SEQ} has type {tbl[SEQ].type}, expected an integer", None, 0
    if not pa.types.is_timestamp(tbl[TS].type):
        return f"{TS} has type {tbl[TS].type}, expected a timestamp", None, 0
    checks: list[pa.ChunkedArray] = [pc.is_null(tbl[key]) for key in primary_key]  # pyright: ignore[reportAttributeAccessIssue]
    op = tbl[OP]
    checks.append(pc.invert(pc.fill_null(pc.is_in(op, pa.array(OPERATIONS)), False)))  # pyright: ignore[reportAttributeAccessIssue]
    checks.append(pc.is_null(tbl[SEQ]))  # pyright: ignore[reportAttributeAccessIssue]
    checks.append(pc.is_null(tbl[TS]))  # pyright: ignore[reportAttributeAccessIssue]
    ts = tbl[TS].cast(TS_TYPE)
    out_of_range = pc.or_(  # pyright: ignore[reportAttributeAccessIssue]
        pc.less(ts, pa.scalar(TMIN, TS_TYPE)),  # pyright: ignore[reportAttributeAccessIssue]
        pc.greater_equal(ts, pa.scalar(TMAX, TS_TYPE)),  # pyright: ignore[reportAttributeAccessIssue]
    )
    checks.append(pc.fill_null(out_of_range, False))
    any_bad = checks[0]  # there is always a key, seq and timestamp check
    for mask in checks[1:]:
        any_bad = pc.or_(any_bad, mask)  # pyright: ignore[reportAttributeAccessIssue]
    bad_count = pc.sum(any_bad.cast(pa.int64())).as_py() or 0  # pyright: ignore[reportAttributeAccessIssue]
    if not bad_count:
        return None, None, 0
    first = pc.index(any_bad, True).as_py()
    for check, mask in enumerate(checks):
        if mask[first].as_py():
            reason = row_reason(check, primary_key, op[first].as_py(), show)
            return _bad_rows_reason(first + 1, reason, bad_count), first + 1, bad_count
    raise AssertionError("unreachable: a bad row matched no check")


def row_reason(
    check: int, primary_key: Sequence[str], op: object, show: Callable[[object], str] = repr
) -> str:
    """Why a row is bad, by the number of the first check it fails, in ``validate_rows``'s
    order: each key column null, then the operation, seq missing, ts missing, ts out of range.
    (The Spark SQL validation of natively read files numbers its checks the same way.)"""
    n = len(primary_key)
    if check < n:
        return f"primary key column '{primary_key[check]}' is null"
    return (
        f"{OP} {show(op)} is not INSERT, UPDATE or DELETE",
        f"{SEQ} is missing",
        f"{TS} is missing",
        f"{TS} is out of range (must be before 9999-12-31T23:59:59.999Z)",
    )[check - n]


def _bad_rows_reason(row: int, reason: str, bad_count: int) -> str:
    more = f" ({bad_count} bad rows in all)" if bad_count > 1 else ""
    return f"row {row}: {reason}{more}"


def inspect_files(
    spark: SparkSession, reader: LandingReader, paths: Sequence[str], native: bool = True
) -> list[FileReport]:
    """Pass 1; only the small reports come back.

    A plain Parquet file whose columns Spark reads as their normalized types is not decoded
    in Python: its footer is read in the driver (a few kilobytes of a local file, cheaper than
    starting Python workers) and its rows are validated in Spark SQL (``validate_native``), so
    pass 2 can read it with Spark's vectorized reader. Every other file is inspected in Python
    in Spark tasks, one per file (up to a cap). ``native`` False inspects every file in Python
    (the reference behaviour, for tests and benchmarks).
    """
    if not paths:
        return []
    footers: dict[str, FileReport | None] = {}
    if native and reader.reads_footer_first():
        with ThreadPoolExecutor(max_workers=FOOTER_THREADS) as pool:
            footers = dict(zip(paths, pool.map(reader.native_report, paths), strict=True))
    rest = [p for p in paths if footers.get(p) is None]
    inspected = dict(zip(rest, _per_file(spark, rest, reader.inspect), strict=True)) if rest else {}
    reports = [r if (r := footers.get(p)) is not None else inspected[p] for p in paths]
    deferred = [r for r in reports if r.native and r.ok and r.num_rows]
    checked = validate_native(spark, reader, deferred) if deferred else {}
    return [checked.get(r.path, r) for r in reports]


# Footers read at once by the driver (local or mounted landing files: I/O bound).
FOOTER_THREADS = 8


def validate_native(
    spark: SparkSession, reader: LandingReader, reports: Sequence[FileReport]
) -> dict[str, FileReport]:
    """The rows of natively readable files validated in Spark SQL: one job for all of them.

    Per file: its row count, seq range, how many rows are bad and the first bad row with the
    first check it fails, numbered as in ``validate_rows`` so the reason reads the same. A
    value outside the years 1 to 9999 (which the Python reader reports as a conversion error,
    quoting the value) and any file Spark fails to read or name are inspected in Python
    instead, so every reason is exactly the one the Python inspection gives.
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    pk = list(reader.table.primary_key)
    guard = NativeGuard(reader, [r.path for r in reports])
    groups: dict[tuple[tuple[str, str], ...], list[FileReport]] = {}
    for r in reports:
        assert r.schema is not None
        if r.path in guard.readable:  # else inspected in Python below, which says why
            groups.setdefault(_checked_signature(r.schema, pk), []).append(r)
    by_file = {os.path.normpath(os.path.abspath(r.path)): r for r in reports}
    out: dict[str, FileReport] = {}
    try:  # Spark lists the files as it makes the frame: a file gone by then fails here too
        summary = None
        for signature, members in groups.items():
            first_schema = members[0].schema
            assert first_schema is not None  # only readable files are grouped
            schema = pa.schema([first_schema.field(name) for name, _ in signature])
            df = read_parquet(
                spark.read.schema(from_arrow_schema(schema)).options(**NATIVE_READ_OPTIONS),
                [os.path.abspath(r.path) for r in members],
            )
            part = _validation_summary(df, pk, [n for n, _ in signature[len(pk) + 3 :]])
            summary = part if summary is None else summary.unionByName(part)
        rows = summary.collect() if summary is not None else []
    except Exception as exc:  # e.g. corrupt pages behind a readable footer, a file gone
        _log.warning("native validation failed (%s); inspecting in Python", type(exc).__name__)
        rows = []
    changed = set(guard.changed())  # Spark may have read another file: inspect in Python
    for row in rows:
        r = by_file.get(_local_path(row[_FILE]))
        if r is None or row["conv"] or r.path in changed:
            continue
        first = row["first"]
        if first is None:
            out[r.path] = FileReport(
                r.path,
                row["rows"],
                r.schema,
                seq_min=row["seq_min"],
                seq_max=row["seq_max"],
                native=True,
                source_uri=row[_FILE],
            )
        else:
            reason = row_reason(first["check"], pk, first["op"], reader.show)
            bad = row["bad"]
            error = _bad_rows_reason(first["row"], reason, bad)
            out[r.path] = FileReport(
                r.path, row["rows"], r.schema, error, first["row"], bad, native=True
            )
    rest = [r.path for r in reports if r.path not in out]
    if rest:
        out.update(zip(rest, _per_file(spark, rest, reader.inspect), strict=True))
    return out


class NativeReadChangedError(LandingFileError):
    """A file Spark read by path changed while it read it (a symlink swapped in and out)."""


# A file found changed in pass 2 is named in the error by this marker and its relative path in
# hex (a Spark task's error reaches the driver as text; hex survives any name).
_CHANGED_MARKER = "cdc-changed-file:"
_CHANGED_RE = re.compile(re.escape(_CHANGED_MARKER) + r"([0-9a-fA-F]+)")


def changed_file_error(relative: str) -> LandingFileError:
    """Pass 2 found a file other than pass 1 inspected (rewritten in place between them)."""
    return LandingFileError(f"{CHANGED} [{_CHANGED_MARKER}{relative.encode().hex()}]")


def changed_files_named(exc: BaseException) -> set[str]:
    """The relative paths a failed read named as changed (``changed_file_error``)."""
    names = set()
    for match in _CHANGED_RE.finditer(str(exc)):
        try:
            names.add(bytes.fromhex(match.group(1)).decode())
        except ValueError:
            continue
    return names


class NativeGuard:
    """What makes Spark's by-path reads of plain Parquet safe against a swapped path.

    Spark's reader opens a path itself, in the JVM, following symlinks: ``O_NOFOLLOW`` and the
    checked descriptor cannot reach it. So every component of each path below the reader's
    root is taken by ``lstat`` (device, inode, type, ctime) before Spark gets the path, and
    again once Spark has read it (``changed``; ``verify`` raises): no component may be or
    have become a symlink, the file must still be the listed one, and nothing may have been
    renamed away and back meanwhile (a rename changes the inode's ctime, which nobody can set
    back). The validation (pass 1) inspects a changed file in Python instead; the read (pass 2)
    calls ``verify`` before its change-log commit (``changelog.append(before_commit=...)``),
    and a change discards what was written and reads every file through the checked
    descriptor instead (``pipeline.materialize``). A false alarm (a file delivered into the
    same hour folder meanwhile changes its ctime) only costs that slower read.
    """

    def __init__(self, reader: LandingReader, paths: Sequence[str]) -> None:
        self.reader = reader
        self.ids = {p: self._ids(p) for p in paths}

    @property
    def readable(self) -> set[str]:
        """The paths fit for Spark to read: real files below the root, still the listed ones."""
        return {p for p, ids in self.ids.items() if ids is not None}

    def changed(self) -> list[str]:
        return [p for p, ids in self.ids.items() if ids is not None and self._ids(p) != ids]

    def verify(self) -> None:
        if self.changed():
            raise NativeReadChangedError(
                "a landing file changed while Spark read it by path; reading it again"
            )

    def _ids(self, path: str) -> tuple[tuple[int, int, int, int], ...] | None:
        try:
            ids = path_ids(self.reader.root, path)
        except (LandingFileError, OSError):
            return None
        dev, ino, mode, _ = ids[-1]
        listed = self.reader.expected.get(os.path.abspath(path))
        if any(stat.S_ISLNK(m) for _, _, m, _ in ids) or not stat.S_ISREG(mode):
            return None
        if listed is not None and (listed.dev, listed.ino) != (dev, ino):
            return None
        return ids


# Dates and timestamps are read as written: files from other writers than Spark 2 carry no
# Julian-calendar values to rebase.
_FILE = "_cdc_tmp_file"
_ROW = "_cdc_tmp_row"
_ROWS = "_cdc_tmp_rows"
_SEQ_MIN = "_cdc_tmp_seq_min"
_SEQ_MAX = "_cdc_tmp_seq_max"
_log = logging.getLogger(__name__)


def _checked_signature(schema: pa.Schema, pk: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The columns pass 1 checks, with their types: keys, change columns, then top-level dates
    and timestamps (whose values must lie in the years 1 to 9999)."""
    head = [*pk, *CDC_COLUMNS]
    ranged = [f.name for f in schema if f.name not in head and _value_checked(f.type)]
    return tuple((n, str(schema.field(n).type)) for n in (*head, *ranged))


def _value_checked(t: pa.DataType) -> bool:
    """A column whose values the native validation checks: dates and timestamps (years 1 to
    9999), and text (valid UTF-8: Spark reads any bytes as a string, and a change log holding
    invalid text is one some Delta readers refuse)."""
    return (
        pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or _is_string_like(t)
        or (is_list(t) and _is_string_like(t.value_type))
    )


def _seen_bounds(report: FileReport | None) -> tuple[int | None, int | None, int | None]:
    """(rows, seq min, seq max) pass 1 saw in a file; nulls compare as nothing changed."""
    if report is None:
        return None, None, None
    return report.num_rows, report.seq_min, report.seq_max


def _row_check(pk: Sequence[str]) -> Column:
    """The number of the first check a row fails, in ``validate_rows``'s order, or null."""
    from pyspark.sql import functions as F

    from cdc_platform.lib.columns import col

    op = F.upper(col(OP))
    checks = [col(k).isNull() for k in pk]
    checks.append(~F.coalesce(op.isin(*OPERATIONS), F.lit(False)))
    checks.append(col(SEQ).isNull())
    checks.append(col(TS).isNull())
    tmin, tmax = F.lit("0001-01-01").cast("timestamp"), F.lit(TMAX_SQL).cast("timestamp")
    checks.append(F.coalesce((col(TS) < tmin) | (col(TS) >= tmax), F.lit(False)))
    return F.coalesce(*[F.when(c, F.lit(i)) for i, c in enumerate(checks)])


def _validation_summary(df: DataFrame, pk: Sequence[str], ranged: Sequence[str]) -> DataFrame:
    """One row per file: rows, bad rows, the first bad (row, check, op), any out-of-range value."""
    from pyspark.sql import functions as F

    from cdc_platform.lib.columns import col

    def in_years_1_to_9999(name: str, kind: str) -> Column:
        hi = "9999-12-31 23:59:59.999999" if kind == "timestamp" else "9999-12-31"
        bounds = F.lit("0001-01-01").cast(kind), F.lit(hi).cast(kind)
        return col(name).isNull() | col(name).between(*bounds)

    def valid_utf8(name: str, kind: str) -> Column:
        if kind == "array":
            return F.forall(col(name), lambda x: F.coalesce(F.is_valid_utf8(x), F.lit(True)))
        return F.coalesce(F.is_valid_utf8(col(name)), F.lit(True))

    types = {f.name: f.dataType.typeName() for f in df.schema.fields}
    op = F.upper(col(OP))
    check = _row_check(pk)
    # A value the Python inspection reports (out of range, not UTF-8): inspected there instead.
    conv = F.lit(False)
    for name in [TS, *ranged]:
        kind = types[name]
        if kind in ("date", "timestamp"):
            conv = conv | ~in_years_1_to_9999(name, kind)
        else:
            conv = conv | ~F.coalesce(valid_utf8(name, kind), F.lit(True))
    for name in [OP, *pk]:
        if types[name] == "string":
            conv = conv | ~valid_utf8(name, "string")
    rows = df.select(
        F.col("_metadata.file_path").alias(_FILE),
        (F.col("_metadata.row_index") + 1).alias(_ROW),
        check.alias("check"),
        op.alias("op"),
        conv.alias("conv"),
        col(SEQ).alias("seq"),
    )
    return rows.groupBy(_FILE).agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum(F.col("check").isNotNull().cast("long")).alias("bad"),
        F.min(
            F.when(
                F.col("check").isNotNull(),
                F.struct(F.col(_ROW).alias("row"), F.col("check"), F.col("op")),
            )
        ).alias("first"),
        F.max(F.col("conv")).alias("conv"),
        F.min("seq").alias("seq_min"),
        F.max("seq").alias("seq_max"),
    )


def _local_path(uri: str) -> str:
    """A file as Spark names it (``file:/a%20b/c``) back to a local path."""
    return os.path.normpath(unquote(urlparse(uri).path))


def _parallelism(spark: SparkSession) -> int:
    """Task slots to spread per-file work over, from conf (Spark Connect has no SparkContext)."""
    for key in ("spark.default.parallelism", "spark.sql.shuffle.partitions"):
        try:
            return max(1, int(spark.conf.get(key, "") or ""))
        except ValueError:
            continue
    return os.cpu_count() or 1


def _path_frame(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """One row per path, spread over a task per file (up to a cap)."""
    n = min(len(paths), _parallelism(spark) * 4)
    df = spark.createDataFrame([(p,) for p in paths], "path string")
    return df.repartition(n) if n > 1 else df


def _per_file(spark: SparkSession, paths: list[str], fn: Callable[[str], T]) -> list[T]:
    """``fn(path)`` for every path, in Spark tasks (one per file up to a cap), in order.

    DataFrame APIs only (``mapInArrow``), so it runs on Spark Connect too; each result comes
    back pickled, and it must be small: reports, not rows.
    """
    df = _path_frame(spark, paths)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            names = batch.column(0).to_pylist()
            results = [pickle.dumps(fn(p)) for p in names]
            yield pa.RecordBatch.from_arrays(
                [pa.array(names, pa.string()), pa.array(results, pa.binary())],
                names=["path", "result"],
            )

    rows = df.mapInArrow(run, "path string, result binary").collect()
    by_path = {r["path"]: pickle.loads(r["result"]) for r in rows}
    return [by_path[p] for p in paths]


def unify_schema(
    established: pa.Schema | None,
    reports: Sequence[FileReport],
    may_widen: Callable[[str], bool] | None = None,
) -> tuple[list[pa.Field], dict[str, str]]:
    """The key and data columns after these files, and the files set aside for a type clash.

    Columns are only ever added (a column that disappears from the source stays, null from
    then on). A column's type only widens (``widest``): a file with a wider type widens the
    column, one with a narrower type is cast up; a file whose column type neither widens nor
    is widened to the table's is set aside, not coerced. A
    column of Arrow type ``null`` (every value null, no declared type) is no evidence of a
    type: it never clashes, and is only added once some file gives it a real type.

    ``may_widen`` says which columns a file may widen (the table's ``widen_types``; None:
    every column): a file that would widen another column is set aside, saying how to
    accept it. Widening is for good, so it is the operator's decision.
    """
    skip = {*CDC_COLUMNS, UNMODIFIED}
    fields: dict[str, pa.DataType] = {}
    if established is not None:
        fields.update({f.name: f.type for f in established})
    by_lower = {name.lower(): name for name in fields}
    # A column new in this batch that may not widen starts at its narrowest type among the
    # batch's files, whatever their names: the file order never decides a widening.
    seeds = _narrowest_new_types(fields, reports, may_widen, skip)
    rejected: dict[str, str] = {}
    for report in sorted(reports, key=lambda r: r.path):
        assert report.schema is not None
        typed = [f for f in report.schema if f.name not in skip and not pa.types.is_null(f.type)]
        clash = None
        for f in report.schema:
            have = fields.get(f.name, seeds.get(f.name))
            same_but_case = by_lower.get(f.name.lower())
            if f.name in skip:
                continue
            if is_reserved(f.name):
                clash = f"column '{f.name}' uses a reserved system prefix (_fivetran_, _cdc_)"
            elif same_but_case is not None and same_but_case != f.name:
                clash = (
                    f"column '{f.name}' differs only in case from the table's column"
                    f" '{same_but_case}' (Delta column names are case-insensitive)"
                )
            elif (
                have is not None
                and not pa.types.is_null(have)
                and not pa.types.is_null(f.type)
                and widest(have, f.type) is None
            ):
                clash = (
                    f"column '{f.name}' has type {f.type} in this file but {have} in the table, "
                    f"and neither widens to the other ({WIDENINGS})"
                )
            elif (
                have is not None
                and may_widen is not None
                and not pa.types.is_null(have)
                and not pa.types.is_null(f.type)
                and widest(have, f.type) != have
                and not may_widen(f.name)
            ):
                clash = (
                    f"column '{f.name}' has type {f.type} in this file but {have} in the table: "
                    f"it would widen the column to {widest(have, f.type)} for good, which the "
                    "table's widen_types does not allow (never a primary-key column by "
                    "default). To accept it, set `widen_types: all` (a key column) or `data` "
                    "on the table in the config, then materialize this file's hour again"
                )
            if clash:
                break
        if clash:
            rejected[report.path] = clash
            continue
        for f in typed:
            have = fields.get(f.name)
            fields[f.name] = (
                f.type if have is None or pa.types.is_null(have) else widest(have, f.type) or have
            )
            by_lower.setdefault(f.name.lower(), f.name)
    return [pa.field(name, t) for name, t in fields.items()], rejected


def _narrowest_new_types(
    fields: Mapping[str, pa.DataType],
    reports: Sequence[FileReport],
    may_widen: Callable[[str], bool] | None,
    skip: set[str],
) -> dict[str, pa.DataType]:
    """For each column the table does not have yet and may not widen: the type every other
    type of it in ``reports`` widens from, if there is one (else none: clashes decide)."""
    if may_widen is None:
        return {}
    seen: dict[str, list[pa.DataType]] = {}
    for report in reports:
        for f in report.schema or ():
            known = fields.get(f.name)
            if f.name in skip or pa.types.is_null(f.type) or may_widen(f.name):
                continue
            if known is None or pa.types.is_null(known):
                seen.setdefault(f.name, []).append(f.type)
    return {
        name: t
        for name, types in seen.items()
        for t in [next((t for t in types if all(widest(t, u) == u for u in types)), None)]
        if t is not None
    }


def event_schema(key_and_data: Sequence[pa.Field]) -> pa.Schema:
    """The shape of events as read: key and data columns, the change columns, provenance."""
    return pa.schema(
        [
            *key_and_data,
            pa.field(OP, pa.string()),
            pa.field(SEQ, pa.int64()),
            pa.field(TS, TS_TYPE),
            pa.field(UNMODIFIED, UNMODIFIED_TYPE),
            pa.field(SOURCE_FILE, pa.string()),
            pa.field(SOURCE_ROW, pa.int64()),
        ]
    )


def read_events(
    spark: SparkSession,
    reader: LandingReader,
    paths: Sequence[str],
    schema: pa.Schema,
    native: Mapping[str, str] | None = None,
    inspected: Mapping[str, FileReport] | None = None,
) -> DataFrame:
    """Pass 2: a DataFrame of every event in ``paths`` (lazy).

    Files in ``native`` (path -> the file as Spark names it, ``FileReport.source_uri``) are read
    by Spark's vectorized Parquet reader; every other file is decoded in Python tasks. With
    ``inspected`` (pass 1's reports), each file's rows are checked again as they are read:
    a file rewritten between the passes fails the read, naming it (``changed_files_named``),
    never reaching the change log unvalidated.
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    native = native or {}
    inspected = inspected or {}
    parts = []
    decoded = [p for p in paths if p not in native]
    if decoded:
        parts.append(_read_decoded(spark, reader, decoded, schema, inspected))
    natively = {p: native[p] for p in paths if p in native}
    if natively:
        parts.append(_read_native(spark, reader, natively, schema, inspected))
    if not parts:
        return spark.createDataFrame([], from_arrow_schema(schema))
    out = parts[0]
    for part in parts[1:]:
        out = out.unionByName(part)
    return out


def _read_decoded(
    spark: SparkSession,
    reader: LandingReader,
    paths: Sequence[str],
    schema: pa.Schema,
    inspected: Mapping[str, FileReport],
) -> DataFrame:
    from pyspark.sql.pandas.types import from_arrow_schema

    path_df = _path_frame(spark, paths)
    # Only what the check needs travels to the tasks (not the schemas).
    wanted = set(paths)
    seen = {
        p: FileReport(p, r.num_rows, None, seq_min=r.seq_min, seq_max=r.seq_max)
        for p, r in inspected.items()
        if p in wanted
    }

    def decode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path in batch.column(0).to_pylist():
                yield from reader.read_conformed(path, schema, seen.get(path))

    return path_df.mapInArrow(decode, from_arrow_schema(schema))


def _read_native(
    spark: SparkSession,
    reader: LandingReader,
    files: Mapping[str, str],
    schema: pa.Schema,
    inspected: Mapping[str, FileReport],
) -> DataFrame:
    """The files read by Spark itself; provenance from its ``_metadata`` column (1-based rows).

    Each row is checked again as it is read (``_row_check``, its row number and seq within
    what pass 1 saw): a file rewritten since fails the read, naming it."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from cdc_platform.lib.columns import col

    data = pa.schema([f for f in schema if f.name not in (SOURCE_FILE, SOURCE_ROW)])
    df = read_parquet(
        spark.read.schema(from_arrow_schema(data)).options(**NATIVE_READ_OPTIONS),
        [os.path.abspath(p) for p in files],
    )
    seen = {p: inspected.get(p) for p in files}
    names = spark.createDataFrame(
        [(uri, reader.relative(p), *_seen_bounds(seen[p])) for p, uri in files.items()],
        f"{_FILE} string, {SOURCE_FILE} string, {_ROWS} long, {_SEQ_MIN} long, {_SEQ_MAX} long",
    )
    rows = df.select(
        "*",
        F.col("_metadata.file_path").alias(_FILE),
        (F.col("_metadata.row_index") + 1).cast("long").alias(SOURCE_ROW),
    ).join(F.broadcast(names), _FILE)
    changed = (
        _row_check(list(reader.table.primary_key)).isNotNull()
        | (col(SOURCE_ROW) > col(_ROWS))
        | (col(SEQ) < col(_SEQ_MIN))
        | (col(SEQ) > col(_SEQ_MAX))
    )
    marker = F.concat(
        F.lit(f"{CHANGED} [{_CHANGED_MARKER}"), F.lower(F.hex(col(SOURCE_FILE))), F.lit("]")
    )
    rows = rows.filter(F.when(changed, F.raise_error(marker)).otherwise(F.lit(True)))
    return rows.select(
        *[F.upper(col(OP)).alias(OP) if f.name == OP else col(f.name).alias(f.name) for f in schema]
    )
