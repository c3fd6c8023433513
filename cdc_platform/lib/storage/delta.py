"""Delta commits without Delta's JVM jars: Spark writes Parquet, delta-rs commits it.

Delta Lake's Spark integration needs jars that live only on Maven Central, which is out of
reach on air-gapped machines. So Spark writes plain Parquet files into the table's folder and
the driver commits them with ``deltalake`` (delta-rs): one ``create_write_transaction`` holds
every add and remove of a change, so readers see the table before or after, never between.
Files Spark wrote but nobody committed are invisible to readers and removed by ``VACUUM``.

The driver only touches file *metadata* here: Parquet footers for the statistics that let
readers skip files, never the rows themselves.

Every table is named by a ``storage.Location`` (a path works too): delta-rs gets its URI and
storage options, Spark its Hadoop URI, and the driver's file operations a ``pyarrow.fs`` file
system, so a local warehouse and one on S3 take the same code.
"""

from __future__ import annotations

import contextlib
import json
import math
import posixpath
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Field, Schema, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from cdc_platform.lib.columns import col
from cdc_platform.lib.errors import PlatformError, Refusal
from cdc_platform.lib.storage.stores import GLOB_CHARACTERS, Location, Where, read_parquet

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, DataFrameReader

T = TypeVar("T")

DATA_DIR = "data"
# How often a writer recomputes and retries after another writer committed first.
COMMIT_ATTEMPTS = 4
# Rows per written file: big enough to avoid many small files, small enough to rewrite cheaply.
ROWS_PER_FILE = 1_000_000
# delta-spark truncates string statistics to this prefix length; longer strings get no bounds.
MAX_STRING_STAT = 32


@dataclass(frozen=True)
class DataFile:
    """A file in a Delta snapshot: its path relative to the table, size and row count."""

    path: str
    size: int
    num_records: int | None
    min_values: Mapping[str, Any]
    max_values: Mapping[str, Any]


def in_predicate(column: str, values: Iterable[str]) -> str:
    """A delta-rs SQL predicate ``column IN ('a', 'b')``, each value quoted as a SQL string."""
    quoted = ", ".join("'" + v.replace("'", "''") + "'" for v in values)
    return f"{column} IN ({quoted})"


def exists(table_path: Where) -> bool:
    loc = Location.of(table_path)
    return DeltaTable.is_deltatable(loc.uri, loc.storage_options)


def open_table(table_path: Where, version: int | None = None) -> DeltaTable:
    """The table's snapshot (the latest, or ``version``); it keeps the storage options, so
    commits, VACUUM and schema changes made through it reach the same store."""
    loc = Location.of(table_path)
    dt = DeltaTable(loc.uri, version=version, storage_options=loc.storage_options)
    check_features(loc, dt)
    return dt


class UnsupportedTableFeatureError(PlatformError, RuntimeError):
    """Another writer (delta-spark, say) turned on a Delta feature the platform cannot keep."""


# Features that are harmless while unused: delta-rs commits to a table that lists them, and its
# commits keep the table correct as long as no column, property or constraint uses them
# (checked below by use). delta-rs 1.6 refuses to commit at all to a table listing
# ``checkpointProtection`` (what Delta leaves after ``DROP FEATURE`` without ``TRUNCATE
# HISTORY``), ``vacuumProtocolCheck`` or ``identityColumns``: those are refused here, by name.
_HARMLESS_FEATURES = frozenset(
    {
        "appendOnly",
        "invariants",
        "timestampNtz",
        "checkConstraints",
        "generatedColumns",
        "changeDataFeed",
        "columnMapping",
    }
)
_CHECKS = "delta.constraints."
_FIELD_USES = {
    "delta.generationExpression": "generated column",
    "delta.identity.start": "identity column",
    "delta.invariants": "NOT NULL or invariant",
}


def check_features(where: Location, dt: DeltaTable) -> None:
    """Refuse a table another engine changed in a way the platform would get wrong
    (docs/engines.md): delta-rs cannot read deletion vectors, reads column-mapped files as
    nulls, and its commits would neither keep an append-only table so nor enforce a CHECK
    constraint, a generated or identity column, row tracking or a change data feed. A feature
    the protocol lists but nothing uses (after ``DROP CONSTRAINT``, say) is no obstacle. The
    message says how to undo it."""
    protocol, config = dt.protocol(), dt.metadata().configuration
    listed = set(protocol.reader_features or []) | set(protocol.writer_features or [])
    found = listed - _HARMLESS_FEATURES
    if config.get("delta.columnMapping.mode", "none") != "none":
        found.add("columnMapping")
    for key, what in (("delta.appendOnly", "appendOnly"), ("delta.enableChangeDataFeed", "CDF")):
        if str(config.get(key, "false")).lower() == "true":
            found.add(f"{what} ({key} = true)")
    found |= {f"CHECK constraint {k.split('.', 2)[2]}" for k in config if k.startswith(_CHECKS)}
    for f in json.loads(dt.schema().to_json())["fields"]:
        found |= {
            f"{what} {f['name']}" for key, what in _FIELD_USES.items() if key in f["metadata"]
        }
    if found:
        raise UnsupportedTableFeatureError(
            f"{where}: the table now uses Delta features {sorted(found)}, set by another writer;"
            " the platform's reads and commits cannot keep them. Undo the change with Delta's "
            "own library (ALTER TABLE ... DROP CONSTRAINT, DROP FEATURE ... TRUNCATE HISTORY, "
            "or UNSET TBLPROPERTIES): see docs/engines.md"
        )


def check_tables(*table_paths: Where) -> None:
    """``check_features`` on each existing table, before a run writes to any of them."""
    for table_path in table_paths:
        if exists(table_path):
            open_table(table_path)


def version_or_none(table_path: Where) -> int | None:
    """The table's current version, or None before its first commit."""
    return open_table(table_path).version() if exists(table_path) else None


def snapshot_files(dt: DeltaTable) -> list[DataFile]:
    """The files of the loaded snapshot, with the min/max statistics the log carries."""
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    files = []
    for a in actions:
        mins = {k[4:]: v for k, v in a.items() if k.startswith("min.") and v is not None}
        maxs = {k[4:]: v for k, v in a.items() if k.startswith("max.") and v is not None}
        files.append(DataFile(a["path"], a["size_bytes"], a.get("num_records"), mins, maxs))
    return files


class UnsafeFilePathError(Refusal):
    """A Delta log names a data file outside its table, or in a form no Delta writer uses."""


def relative_file(table_path: Where, logged: str, field: str = "add.path") -> str:
    """The file a Delta log's ``add`` or ``remove`` path names, as a ``/``-separated path below
    the table, checked: the log's path is a URI reference (RFC 2396), percent-decoded once
    here, as Delta's writers encode it (delta-rs and delta-spark encode a partition value's
    ``{``, ``%`` or space).

    Whoever writes a table's log could name another table's files, so refused, naming the
    field and why: a URI or an absolute path; a bare glob character (``{ } [ ] * ? \\``, never
    left unencoded by a writer: ``a{/..}{/..}/x`` is a pattern Spark expands to ``a/../../x``);
    a ``.`` or ``..`` segment once decoded (``\\`` counts as a separator); and a normalized
    path that is not strictly below the table.
    """

    def refuse(why: str) -> UnsafeFilePathError:
        shown = logged if len(logged) <= 200 else logged[:200] + "..."
        return UnsafeFilePathError(
            f"{Location.of(table_path)}: the Delta log's {field} {shown!r} {why}: refused, as"
            " it may name a file outside the table (docs/SECURITY.md)"
        )

    bare = sorted({c for c in logged if c in GLOB_CHARACTERS})
    if bare:
        raise refuse(f"has glob characters {' '.join(bare)} not percent-encoded")
    if urlsplit(logged).scheme:
        raise refuse("is a URI, not a path relative to the table")
    decoded = unquote(logged)
    if not decoded or "\0" in decoded:
        raise refuse("is empty or has a NUL character")
    if decoded.startswith(("/", "\\")):
        raise refuse("is an absolute path")
    if any(s in (".", "..") for s in decoded.replace("\\", "/").split("/")):
        raise refuse("has a '.' or '..' segment")
    normalized = posixpath.normpath(decoded)
    if normalized in (".", "..") or normalized.startswith(("../", "/")):
        raise refuse("is not below the table")
    return normalized


def absolute_paths(table_path: Where, files: Iterable[DataFile | str]) -> list[str]:
    """Where Spark (or Arrow) reads each file (``s3a://...`` on S3, the local path otherwise);
    ``files`` are a snapshot's (``snapshot_files``) or paths as its log gives them, each
    decoded and kept inside the table (``relative_file``). Hand them to Spark through
    ``storage.read_parquet``: a decoded name may hold a glob character."""
    loc = Location.of(table_path)
    return [
        loc.spark_uri(relative_file(loc, f.path if isinstance(f, DataFile) else f)) for f in files
    ]


def read_files(
    reader: DataFrameReader, table_path: Where, files: Iterable[DataFile | str]
) -> DataFrame:
    """``reader.parquet`` of these files of the table (``absolute_paths``), each read by its
    name, never as a pattern (``storage.read_parquet``)."""
    return read_parquet(reader, absolute_paths(table_path, files))


def read_arrow(table_path: Where, columns: Sequence[str] | None = None) -> pa.Table:
    """The table's current rows (``columns`` only, if given), read with no Python in Arrow's
    I/O threads: locally by Arrow's own file system, on an object store by delta-rs' scan.

    Not ``DeltaTable.to_pyarrow_table``: that reads through a Python file-system handler, so
    Arrow's I/O threads hold buffers owned by Python objects and may still release them after
    the call returned. A thread doing so while the interpreter exits is ended by CPython in the
    middle of Arrow's C++ code and the process aborts ("terminate called without an active
    exception", exit status 134). Neither reader here needs Python in its threads.
    """
    import pyarrow.dataset as ds

    loc = Location.of(table_path)
    dt = open_table(loc)
    schema = table_arrow_schema(dt)
    if not loc.is_local:
        wanted = pa.schema([schema.field(c) for c in columns]) if columns is not None else schema
        # delta-rs' engine may pick other Arrow types (string views): give the table's own.
        return pa.table(dt.scan(columns=wanted.names)).cast(wanted)
    paths = absolute_paths(loc, snapshot_files(dt))
    dataset = ds.dataset(paths, schema=schema, format="parquet")
    return dataset.to_table(columns=list(columns) if columns is not None else None)


def arrow_schema_of(df: DataFrame) -> pa.Schema:
    """The Arrow schema of a Spark DataFrame, every field nullable (Delta schemas must admit nulls)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(df.schema, timezone="UTC")
    return pa.schema([f.with_nullable(True) for f in schema])


def ensure_table(
    table_path: Where,
    schema: pa.Schema,
    description: str = "",
    table: DeltaTable | None = None,
    properties: Mapping[str, str] | None = None,
) -> DeltaTable:
    """Create the table if it is missing, with ``properties`` (the platform's own table
    properties); add any new (nullable) columns. Never drops a column.

    ``table`` is the snapshot the caller already opened, if any (it is returned as it is when
    no column is missing, so a run keeps seeing one version).
    """
    loc = Location.of(table_path)
    if table is None and not exists(loc):
        if loc.is_local:  # an object store has no folders to create
            loc.path.mkdir(parents=True, exist_ok=True)
        return DeltaTable.create(
            loc.uri,
            schema=schema,
            mode="ignore",
            description=description,
            configuration=dict(properties or {}),
            storage_options=loc.storage_options,
            raise_if_key_not_exists=False,  # the platform's keys are not Delta's
        )
    dt = table if table is not None else open_table(loc)
    have = {f.name for f in dt.schema().fields}
    new_fields = [f for f in schema if f.name not in have]
    if new_fields:
        delta_fields = Schema.from_arrow(pa.schema(new_fields)).fields
        dt.alter.add_columns([Field(f.name, f.type, nullable=True) for f in delta_fields])
        dt = open_table(loc)
    return dt


def table_arrow_schema(dt: DeltaTable) -> pa.Schema:
    return pa.schema(dt.schema().to_arrow())


def write_files(
    df: DataFrame, table_path: Where, partition_by: str | None = None, data_change: bool = True
) -> list[AddAction]:
    """Have Spark write ``df`` as Parquet under the table folder; return add actions for them.

    Each write goes to its own ``data/<uuid>/`` folder so concurrent or crashed writers never
    mix files; only the ``part-*`` Parquet files are committed. ``partition_by`` names a
    working column that splits the rows into files (one value per file, the column itself is
    not stored): its values become sub-folders ``data/<uuid>/<value>/``, not Delta partitions.
    """
    loc = Location.of(table_path)
    rel_dir = f"{DATA_DIR}/{uuid.uuid4().hex}"
    writer = df.write.mode("error").option("compression", "snappy")
    if partition_by:
        writer = writer.partitionBy(partition_by)
    writer.parquet(loc.spark_uri(rel_dir))
    return adds_for_written(loc, rel_dir, data_change)


def adds_for_written(table_path: Where, rel_dir: str, data_change: bool = True) -> list[AddAction]:
    """The add actions for the Parquet files a writer left in ``rel_dir`` (table-relative).

    The driver's half of ``write_files``, on the table's own file system (local or object
    store): a ``<column>=<value>/`` sub-folder becomes ``<value>/`` (no Hive-style names in a
    Delta table), checksums, markers and empty files are deleted, and each remaining file's
    statistics come from its Parquet footer. A folder left with nothing to commit (a replay
    with no new events) is removed.
    """
    fs = Location.of(table_path).filesystem()
    listed = fs.get_file_info(pafs.FileSelector(rel_dir, recursive=True, allow_not_found=True))
    adds = []
    for info in sorted((i for i in listed if i.type == pafs.FileType.File), key=lambda i: i.path):
        if not info.base_name.endswith(".parquet") or info.base_name.startswith((".", "_")):
            fs.delete_file(info.path)  # .crc checksums and markers: not table data
            continue
        with fs.open_input_file(info.path) as fh:
            meta = pq.read_metadata(fh)
        if meta.num_rows == 0:
            fs.delete_file(info.path)
            continue
        path = _without_hive_names(info.path)
        if path != info.path:
            fs.create_dir(posixpath.dirname(path))
            fs.move(info.path, path)
        mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
        adds.append(
            AddAction(
                path=path,
                size=int(info.size or 0),
                partition_values={},
                modification_time=int(mtime * 1000),
                data_change=data_change,
                stats=json.dumps(file_stats(meta)),
            )
        )
    if not adds:
        _delete_dir(fs, rel_dir)
        return []
    for info in listed:  # the <column>=<value>/ folders, emptied by the moves
        if info.type == pafs.FileType.Directory and "=" in info.base_name:
            _delete_dir(fs, info.path)
    return sorted(adds, key=lambda a: a.path)


def _without_hive_names(path: str) -> str:
    """``data/<uuid>/<column>=<value>/part-0.parquet`` -> ``data/<uuid>/<value>/part-0.parquet``."""
    return "/".join(p.split("=", 1)[1] if "=" in p else p for p in path.split("/"))


def _delete_dir(fs: pafs.FileSystem, path: str) -> None:
    """Delete ``path`` and everything below it; gone already is fine."""
    with contextlib.suppress(OSError):
        fs.delete_dir(path)


def file_count_for(rows: int, rows_per_file: int = ROWS_PER_FILE) -> int:
    return max(1, math.ceil(rows / rows_per_file))


def num_records(add: AddAction) -> int:
    return int(json.loads(add.stats)["numRecords"])


def stats_only_for(adds: Sequence[AddAction], columns: Sequence[str]) -> list[AddAction]:
    """``adds`` with the bounds and null counts of ``columns`` only (and their row counts): a
    side table that names keys in the clear keeps them out of its Delta log, which no VACUUM
    removes (an erasure's retracted keys, ``merge.record_retracted_keys``)."""
    out = []
    for a in adds:
        stats = json.loads(a.stats) if a.stats else {}
        for part in ("minValues", "maxValues", "nullCount"):
            if part in stats:
                stats[part] = {c: v for c, v in stats[part].items() if c in columns}
        out.append(
            AddAction(
                path=a.path,
                size=a.size,
                partition_values=a.partition_values,
                modification_time=a.modification_time,
                data_change=a.data_change,
                stats=json.dumps(stats),
            )
        )
    return out


def removes_for(files: Sequence[DataFile], data_change: bool = True) -> list[RemoveAction]:
    """Remove actions for ``files``; ``data_change=False`` for a rewrite that changes no row."""
    now_ms = int(time.time() * 1000)
    return [RemoveAction(f.path, data_change, now_ms, f.size, {}) for f in files]


def commit(
    dt: DeltaTable,
    adds: Sequence[AddAction],
    removes: Sequence[RemoveAction],
    schema: pa.Schema,
    app_transaction: tuple[str, int] | None = None,
    metadata: Mapping[str, Any] | None = None,
    strict: bool = False,
    overwrite: bool = False,
) -> int:
    """Commit adds and removes as one Delta version and return it.

    ``strict`` refuses to rebase over a concurrent commit (the caller recomputes and retries);
    ``app_transaction`` records ``(app_id, version)`` in the same commit, so the table itself
    says which input it already contains. ``overwrite`` replaces every file of ``dt``'s
    snapshot with ``adds`` (delta-rs writes the removes; pass none) and makes ``schema`` the
    table's schema in that same commit, so a widened schema and the new rows appear together.
    """
    if overwrite and removes:
        raise ValueError("an overwrite commit removes every file itself: pass no removes")
    props = CommitProperties(
        custom_metadata=dict(metadata or {}),
        max_commit_retries=0 if strict else None,
        app_transactions=[Transaction(*app_transaction)] if app_transaction else None,
    )
    dt.create_write_transaction(
        [*adds, *removes],
        mode="overwrite" if overwrite else "append",
        schema=schema,
        commit_properties=props,
    )
    dt.update_incremental()
    return dt.version()


def arrow_cast(df: DataFrame, schema: pa.Schema) -> DataFrame:
    """``df``'s rows as ``schema``'s columns (by name, in its order), each cast by Arrow: the one
    engine every widening uses (a file decoded in Python, a table rewritten wider, a batch
    appended to a table that widened meanwhile), so a value widened twice reads the same.
    ``df`` is returned as it is when its columns already have those types."""
    from pyspark.sql.pandas.types import from_arrow_schema

    if arrow_schema_of(df).equals(schema):
        return df
    names = schema.names
    frame = df.select(*[col(n) for n in names])

    def cast(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield pa.RecordBatch.from_arrays(
                [batch.column(i).cast(schema.field(i).type) for i in range(batch.num_columns)],
                schema=schema,
            )

    return frame.mapInArrow(cast, from_arrow_schema(schema))


def top_level_leaves(meta: pq.FileMetaData) -> dict[str, int]:
    """Column-chunk index of each top-level primitive column (nested columns have several)."""
    leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
    return {path: i for i, path in enumerate(leaves) if "." not in path}


def discard(table_path: Where, adds: Sequence[AddAction]) -> None:
    """Delete files written for a commit that did not happen (no reader ever saw them)."""
    fs = Location.of(table_path).filesystem()
    for folder in sorted({"/".join(a.path.split("/")[:2]) for a in adds}):
        _delete_dir(fs, folder)


def with_commit_retries(attempt: Callable[[], T], what: str) -> tuple[T, int]:
    """Run ``attempt`` (compute, write, strict commit) until no other writer got in first.

    Returns the result and the number of attempts it took; gives up after COMMIT_ATTEMPTS.
    """
    last: Exception | None = None
    for n in range(1, COMMIT_ATTEMPTS + 1):
        try:
            return attempt(), n
        except CommitFailedError as exc:
            if "Unsupported table features" in str(exc):
                raise  # not a race: retrying recomputes the run to fail the same way
            last = exc
    raise RuntimeError(f"{what} lost {COMMIT_ATTEMPTS} races in a row") from last


def file_stats(meta: pq.FileMetaData) -> dict[str, Any]:
    """Delta file statistics (numRecords, minValues, maxValues, nullCount) from a Parquet footer.

    Bounds are only written where they are exact in Delta's terms: timestamps are widened to
    whole milliseconds, long strings, binaries, decimals and nested columns get none.
    """
    schema = meta.schema.to_arrow_schema()
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    leaves = top_level_leaves(meta)
    for field in schema:
        ci = leaves.get(field.name)
        if ci is None or pa.types.is_nested(field.type):
            continue
        lo = hi = None
        null_count: int | None = 0
        bounded = _stat_kind(field.type) is not None
        for rg in range(meta.num_row_groups):
            st = meta.row_group(rg).column(ci).statistics
            if st is None:
                null_count, bounded = None, False
                break
            if null_count is not None:
                null_count = null_count + st.null_count if st.has_null_count else None
            if not bounded:
                continue
            if not st.has_min_max:
                if st.null_count != meta.row_group(rg).num_rows:
                    bounded = False
                continue
            try:
                lo = st.min if lo is None else min(lo, st.min)
                hi = st.max if hi is None else max(hi, st.max)
            except UnicodeDecodeError:  # bytes that are no text: no bounds, never a failure
                bounded = False
        if null_count is not None:
            nulls[field.name] = null_count
        if bounded and lo is not None:
            lo_json, hi_json = _stat_value(field.type, lo, False), _stat_value(field.type, hi, True)
            if lo_json is not None and hi_json is not None:
                mins[field.name], maxs[field.name] = lo_json, hi_json
    return {"numRecords": meta.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


def _stat_kind(t: pa.DataType) -> str | None:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    return None


def _stat_value(t: pa.DataType, value: Any, upper: bool) -> Any:
    kind = _stat_kind(t)
    if kind == "int" or kind == "bool":
        return value if kind == "int" else bool(value)
    if kind == "float":
        # JSON has no NaN or infinity (delta-rs rejects the log entry): no bound then
        return None if (value is None or not math.isfinite(value)) else value
    if kind == "timestamp":
        ts = value if value.tzinfo else value.replace(tzinfo=UTC)
        ms = ts.replace(microsecond=(ts.microsecond // 1000) * 1000)
        if upper and ms != ts:
            try:
                ms += timedelta(milliseconds=1)
            except OverflowError:  # within 1 ms of datetime.max: no exact upper bound
                return None
        return ms.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms.microsecond // 1000:03d}Z"
    if kind == "date":
        return value.isoformat() if isinstance(value, date | datetime) else None
    if kind == "string":
        return value if isinstance(value, str) and len(value) <= MAX_STRING_STAT else None
    return None
