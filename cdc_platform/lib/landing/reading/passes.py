"""Reading landing files into change events, in Spark tasks, with bad files set aside.

Two passes over the files, both inside Spark tasks (the driver sees only file names, schemas
and counts):

1. *inspect*: decode each file (decrypt, decompress, parse), check every row's key and change
   columns, and report its schema, or the first bad row and why.
2. *read*: decode the files that passed into Arrow batches conformed to one schema, the table's
   schema so far widened with any new columns.

A file with any bad row is set aside whole (quarantined) so that no file is ever half applied;
re-delivering a fixed file and re-materializing its partition brings it in.

This module runs the passes over many files; one file is the reader's (``reader``), and plain
Parquet that Spark reads itself is ``native``'s.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import pyarrow as pa

from cdc_platform.lib.columns import (
    CDC_COLUMNS,
    OP,
    ROW_ID,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    TS,
    TS_TYPE,
    UNMODIFIED,
    UNMODIFIED_TYPE,
    is_reserved,
)
from cdc_platform.lib.landing.reading.file_reader import FileReport, LandingReader
from cdc_platform.lib.landing.reading.native import native_report, read_native, validate_native
from cdc_platform.lib.storage.schema import (
    WIDENINGS,
    widest,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


T = TypeVar("T")

__all__ = ["event_schema", "inspect_files", "per_file", "read_events", "unify_schema"]


def inspect_files(
    spark: SparkSession, reader: LandingReader, paths: Sequence[str], native: bool = True
) -> list[FileReport]:
    """Pass 1; only the small reports come back.

    A plain Parquet file whose columns Spark reads as their normalized types is not decoded
    in Python: its footer is read in the driver (a few kilobytes of a local file, cheaper than
    starting Python workers) and its rows are validated in Spark SQL (``validate_native``), so
    pass 2 can read it with Spark's vectorized reader. Every other file is inspected in Python
    in Spark tasks, one per file (up to a cap). ``native`` False inspects every file in Python
    (the reference behaviour, for tests and benchmarks), as does a landing zone Spark must not
    read by path (``LandingZone.native_reads``: a bucket, whose reads are pinned to an ETag).
    """
    if not paths:
        return []
    footers: dict[str, FileReport | None] = {}
    if native and reader.source.native_reads and reader.reads_footer_first():
        with ThreadPoolExecutor(max_workers=FOOTER_THREADS) as pool:
            footers = dict(zip(paths, pool.map(partial(native_report, reader), paths), strict=True))
    rest = [p for p in paths if footers.get(p) is None]
    inspected = dict(zip(rest, per_file(spark, rest, reader.inspect), strict=True)) if rest else {}
    reports = [r if (r := footers.get(p)) is not None else inspected[p] for p in paths]
    deferred = [r for r in reports if r.native and r.ok and r.num_rows]
    checked = validate_native(spark, reader, deferred) if deferred else {}
    rest = [r.path for r in deferred if r.path not in checked]
    if rest:  # Spark could not validate them: the Python inspection says why
        checked.update(zip(rest, per_file(spark, rest, reader.inspect), strict=True))
    return [checked.get(r.path, r) for r in reports]


# Footers read at once by the driver (local or mounted landing files: I/O bound).
FOOTER_THREADS = 8


def _parallelism(spark: SparkSession) -> int:
    """Task slots to spread per-file work over, from conf (Spark Connect has no SparkContext)."""
    for key in ("spark.default.parallelism", "spark.sql.shuffle.partitions"):
        try:
            return max(1, int(spark.conf.get(key, "") or ""))
        except ValueError:
            continue
    return os.cpu_count() or 1


def path_frame(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """One row per path, spread over a task per file (up to a cap)."""
    n = min(len(paths), _parallelism(spark) * 4)
    df = spark.createDataFrame([(p,) for p in paths], "path string")
    return df.repartition(n) if n > 1 else df


def per_file(spark: SparkSession, paths: list[str], fn: Callable[[str], T]) -> list[T]:
    """``fn(path)`` for every path, in Spark tasks (one per file up to a cap), in order.

    DataFrame APIs only (``mapInArrow``), so it runs on Spark Connect too; each result comes
    back pickled, and it must be small: reports, not rows.
    """
    df = path_frame(spark, paths)

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


_keyless_widening = (
    "a keyless table's column types never widen, since a widened value would hash to another "
    "_fivetran_id (docs/limitations.md)"
)


def unify_schema(
    established: pa.Schema | None,
    reports: Sequence[FileReport],
    may_widen: Callable[[str], bool] | None = None,
    keyless: bool = False,
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
    accept it. Widening is for good, so it is the operator's decision; a ``keyless`` table's
    never widen (a widened value would hash to another ``_fivetran_id``).
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
            if f.name in skip:
                continue
            have = fields.get(f.name, seeds.get(f.name))
            clash = _clash(f, have, by_lower.get(f.name.lower()), may_widen, keyless)
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


def _clash(
    f: pa.Field,
    have: pa.DataType | None,
    same_but_case: str | None,
    may_widen: Callable[[str], bool] | None,
    keyless: bool,
) -> str | None:
    """Why a file's column ``f`` sets the file aside (``unify_schema``), None if it does not:
    a reserved name, a name that differs only in case, a type that neither widens nor is
    widened to the table's ``have``, or a widening the table does not allow."""
    if is_reserved(f.name):
        return f"column '{f.name}' uses a reserved system prefix (_fivetran_, _cdc_)"
    if same_but_case is not None and same_but_case != f.name:
        return (
            f"column '{f.name}' differs only in case from the table's column"
            f" '{same_but_case}' (Delta column names are case-insensitive)"
        )
    if have is None or pa.types.is_null(have) or pa.types.is_null(f.type):
        return None
    wider = widest(have, f.type)
    if wider is None:
        return (
            f"column '{f.name}' has type {f.type} in this file but {have} in the table, "
            f"and neither widens to the other ({WIDENINGS})"
        )
    if may_widen is None or wider == have or may_widen(f.name):
        return None
    clash = f"column '{f.name}' has type {f.type} in this file but {have} in the table: "
    return clash + (
        _keyless_widening
        if keyless
        else (
            f"it would widen the column to {wider} for good, which the "
            "table's widen_types does not allow (never a primary-key column by "
            "default). To accept it, set `widen_types: all` (a key column) or `data` "
            "on the table in the config, then materialize this file's hour again"
        )
    )


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


def with_row_id(fields: Sequence[pa.Field], keyless: bool) -> list[pa.Field]:
    """A keyless table's key and data columns: its id first (computed as each file is read,
    ``LandingReader.read_conformed``), then the columns the files carry."""
    if not keyless:
        return list(fields)
    return [pa.field(ROW_ID, pa.string()), *(f for f in fields if f.name != ROW_ID)]


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
        parts.append(read_native(spark, reader, natively, schema, inspected))
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

    path_df = path_frame(spark, paths)
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
