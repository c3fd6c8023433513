"""Plain Parquet read by Spark's own reader, in the JVM, with the Python reader's guarantees.

A plain Parquet file whose columns Spark reads as their normalized types is never decoded in
Python: its footer is read in the driver (``native_report``), its rows are validated in Spark
SQL (``validate_native``, numbering checks as ``rows.validate_rows`` does) and read by Spark's
vectorized reader (``read_native``), every row checked again as it is read. ``NativeGuard``
makes Spark's by-path reads safe against a path swapped meanwhile.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_platform.lib.columns import (
    CDC_COLUMNS,
    OP,
    OPERATIONS,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    TMAX_SQL,
    TS,
    UNMODIFIED,
)
from cdc_platform.lib.landing.decoding.codecs import LandingFileError, too_large
from cdc_platform.lib.landing.decoding.formats.parquet import fixed_width_bytes, parquet_bytes
from cdc_platform.lib.landing.reading.file_reader import CHANGED_MARKER, FileReport, LandingReader
from cdc_platform.lib.landing.rows.rules import (
    bad_rows_reason,
    has_text,
    is_string_like,
    row_reason,
)
from cdc_platform.lib.landing.where.safe_open import (
    CHANGED,
    path_ids,
)
from cdc_platform.lib.storage.schema import (
    NATIVE_READ_OPTIONS,
    is_list,
    normalize_type,
)
from cdc_platform.lib.storage.stores import read_parquet

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = [
    "NativeGuard",
    "NativeReadChangedError",
    "native_report",
    "read_native",
    "validate_native",
]


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
    if pa.types.is_map(t):
        return False  # its key and value types are normalized in Python
    if pa.types.is_timestamp(t):
        return t.unit == "us"
    if is_list(t):
        # A list of strings is checked for UTF-8 natively; text deeper down only in Python.
        inner = t.value_type
        if is_string_like(inner) or pa.types.is_binary(inner):
            return pa.types.is_list(t) and _native_type(inner, top_level=False)
        return pa.types.is_list(t) and _native_type(inner, top_level=False) and not has_text(inner)
    if pa.types.is_struct(t):
        return all(_native_type(f.type, top_level=False) and not has_text(f.type) for f in t)
    return not pa.types.is_null(t) and normalize_type(t) == t


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


def native_report(reader: LandingReader, path: str) -> FileReport | None:
    """Pass 1 for a file Spark's own Parquet reader can read as is: its footer only.

    Such a file (plain Parquet, every column in its normalized type or one Spark widens
    to it) gets a report with ``native=True`` and its rows unchecked: they are validated
    in Spark SQL (``validate_native``). Any other file gets None: it is inspected in
    Python (``inspect``), which names whatever is wrong with it.
    """
    if reader.table.is_encoded or reader.table.keyless or reader.table.protects_columns:
        return None  # decoded, an id computed, or a column hashed or blocked: in Python
    try:
        with reader.open(path) as fh:
            pf = pq.ParquetFile(fh)
            schema, meta = pf.schema_arrow, pf.metadata
        reader._check_names(schema)
    except Exception:  # whatever it is, the full inspection names it
        return None
    if not _natively_readable(schema, meta, reader.table.file_key):
        return None
    if max(parquet_bytes(meta), fixed_width_bytes(meta)) > reader.table.max_file_bytes:
        return None  # the inspection sets it aside, saying why
    if _nested_text(meta, set(schema.names)):
        return None  # nested text: one row may hold a million copies; counted as read in Python
    normalized = pa.schema([pa.field(f.name, normalize_type(f.type)) for f in schema])
    return FileReport(path, meta.num_rows, normalized, native=True)


def _nested_text(meta: pq.FileMetaData, top_level: set[str]) -> bool:
    """Whether a text leaf sits inside a list, map or struct: one row may hold a million
    copies of one dictionary string, which Spark's reader would build whole; such a file is
    read in Python, counted batch by batch (``formats.parquet``)."""
    for c in range(meta.num_columns):
        leaf = meta.schema.column(c)
        if leaf.physical_type != "BYTE_ARRAY":
            continue
        if leaf.path not in top_level or leaf.max_repetition_level > 0:
            return True
        if leaf.max_definition_level > 1:
            return True
    return False


def validate_native(
    spark: SparkSession, reader: LandingReader, reports: Sequence[FileReport]
) -> dict[str, FileReport]:
    """The rows of natively readable files validated in Spark SQL: one job for all of them.

    Per file: its row count, seq range, how many rows are bad and the first bad row with the
    first check it fails, numbered as in ``validate_rows`` so the reason reads the same. A
    value outside the years 1 to 9999 (which the Python reader reports as a conversion error,
    quoting the value) and any file Spark fails to read or name are inspected in Python
    instead (by the caller: the files missing from the result), so every reason is exactly
    the one the Python inspection gives.
    """
    from pyspark.sql.pandas.types import from_arrow_schema

    pk = list(reader.table.file_key)
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
            names = [n for n, _ in signature]
            ranged = [n for n in names[len(pk) + 3 :] if _value_checked(schema.field(n).type)]
            sized = {
                n: schema.field(n).type for n in names if _fixed_width(schema.field(n).type) is None
            }
            part = _validation_summary(df, pk, ranged, sized)
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
        cap = reader.table.max_file_bytes
        if (row["bytes"] or 0) + row["rows"] * _fixed_bytes(r.schema) > cap:
            out[r.path] = FileReport(r.path, row["rows"], r.schema, too_large(cap), native=True)
        elif first is None:
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
            error = bad_rows_reason(first["row"], reason, bad)
            out[r.path] = FileReport(
                r.path, row["rows"], r.schema, error, first["row"], bad, native=True
            )
    return out


class NativeReadChangedError(LandingFileError):
    """A file Spark read by path changed while it read it (a symlink swapped in and out)."""


class NativeGuard:
    """What makes Spark's by-path reads of plain Parquet safe against a swapped path.

    Spark's reader opens a path itself, in the JVM, following symlinks: ``O_NOFOLLOW`` and the
    checked descriptor cannot reach it. So every component of each path below the reader's
    root is taken by ``lstat`` (device, inode, type, ctime) before Spark gets the path, and
    again once Spark has read it (``changed``; ``verify`` raises): no component may be or
    have become a symlink, the file must still be the listed one, and nothing may have been
    renamed away and back meanwhile (a rename changes the inode's ctime, which nobody can set
    back). The validation (pass 1) inspects a changed file in Python instead; the read (pass 2)
    calls ``verify`` before its change-log commit (``changelog.Guards(before_commit=...)``),
    and a change discards what was written and reads every file through the checked
    descriptor instead (``batch.LandingBatch.append``). A false alarm (a file delivered into the
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
    """The columns pass 1 reads, with their types: keys, change columns, then top-level dates,
    timestamps and text (whose values are checked), then the other columns whose values'
    size varies (what the file decodes to is counted, ``_decoded_size``)."""
    head = [*pk, *CDC_COLUMNS]
    ranged = [f.name for f in schema if f.name not in head and _value_checked(f.type)]
    sized = [
        f.name for f in schema if f.name not in (*head, *ranged) and _fixed_width(f.type) is None
    ]
    return tuple((n, str(schema.field(n).type)) for n in (*head, *ranged, *sized))


def _fixed_width(t: pa.DataType) -> int | None:
    """The bytes each value of ``t`` takes decoded, where every value takes as many (None:
    text, binary and lists vary; a struct of fixed-width fields is fixed)."""
    if pa.types.is_struct(t):
        widths = [_fixed_width(f.type) for f in t]
        return None if None in widths else sum(w for w in widths if w is not None)
    try:
        return max(t.bit_width // 8, 1)
    except ValueError:  # Arrow's word for a type whose values vary in size
        return None


def _decoded_size(value: Column, t: pa.DataType) -> Column:
    """What one value of type ``t`` takes decoded, as Spark computes it (nulls take nothing
    here; a fixed-width column is counted by the caller, rows times its width)."""
    from pyspark.sql import functions as F

    width = _fixed_width(t)
    if width is not None:
        return F.lit(width).cast("long")
    if is_list(t):
        inner = t.value_type
        total = F.aggregate(
            value, F.lit(0).cast("long"), lambda acc, x: acc + _decoded_size(x, inner)
        )
        return F.coalesce(total, F.lit(0).cast("long")) + 8
    if pa.types.is_struct(t):
        parts = [_decoded_size(value.getField(f.name), f.type) for f in t]
        return sum(parts[1:], parts[0]) if parts else F.lit(0).cast("long")
    return F.coalesce(F.octet_length(value), F.lit(0)).cast("long") + 8


def _fixed_bytes(schema: pa.Schema) -> int:
    """The decoded bytes per row of a file's fixed-width columns (Spark sizes the others)."""
    return sum(_fixed_width(f.type) or 0 for f in schema)


def _value_checked(t: pa.DataType) -> bool:
    """A column whose values the native validation checks: dates and timestamps (years 1 to
    9999), and text (valid UTF-8: Spark reads any bytes as a string, and a change log holding
    invalid text is one some Delta readers refuse)."""
    return (
        pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or is_string_like(t)
        or (is_list(t) and is_string_like(t.value_type))
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


def _validation_summary(
    df: DataFrame, pk: Sequence[str], ranged: Sequence[str], sized: Mapping[str, pa.DataType]
) -> DataFrame:
    """One row per file: rows, bad rows, the first bad (row, check, op), any out-of-range value,
    and the decoded bytes of its variable-size columns (``sized``)."""
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
        _row_bytes(sized).alias("bytes"),
    )
    return rows.groupBy(_FILE).agg(
        F.sum("bytes").alias("bytes"),
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


def _row_bytes(sized: Mapping[str, pa.DataType]) -> Column:
    from pyspark.sql import functions as F

    from cdc_platform.lib.columns import col

    parts = [_decoded_size(col(n), t) for n, t in sized.items()]
    return sum(parts[1:], parts[0]) if parts else F.lit(0).cast("long")


def _local_path(uri: str) -> str:
    """A file as Spark names it (``file:/a%20b/c``) back to a local path."""
    return os.path.normpath(unquote(urlparse(uri).path))


def read_native(
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
        _row_check(list(reader.table.file_key)).isNotNull()
        | (col(SOURCE_ROW) > col(_ROWS))
        | (col(SEQ) < col(_SEQ_MIN))
        | (col(SEQ) > col(_SEQ_MAX))
    )
    marker = F.concat(
        F.lit(f"{CHANGED} [{CHANGED_MARKER}"), F.lower(F.hex(col(SOURCE_FILE))), F.lit("]")
    )
    rows = rows.filter(F.when(changed, F.raise_error(marker)).otherwise(F.lit(True)))
    return rows.select(
        *[F.upper(col(OP)).alias(OP) if f.name == OP else col(f.name).alias(f.name) for f in schema]
    )
