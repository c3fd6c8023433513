"""Adopting an existing table into history mode (Fivetran's "Switching to history mode").

The source is a Delta table or a folder of Parquet files in live mode or soft-delete mode: one
row per key, optionally with ``_fivetran_synced`` and ``_fivetran_deleted``. As in the seeds:

* a live row (``_fivetran_deleted`` false, null or absent) becomes a version starting at the
  largest ``_fivetran_synced`` of the source (the adoption's time, ``A``), ending at TMAX,
  active;
* a soft-deleted row becomes a version that starts and ends at 0001-01-01T00:00:00, inactive;
* ``_fivetran_deleted`` and ``_fivetran_synced`` are not kept (nor any other ``_fivetran_``
  column of the source).

The history table stays the fold of its change log, so the rows are written there as events:
an ``INSERT`` at ``A`` for a live row; an ``INSERT`` and a ``DELETE`` at 0001-01-01 for a
soft-deleted one (contract rule 5 gives the version that starts and ends there). Their source
is ``adopt:<source>`` and their ``cdc_change_seq`` is far below any real seq or a truncate's,
derived from ``A``: a real event of the same millisecond sorts after them, and adopting the
same source again logs nothing new. CDC events then apply on top, late ones included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from cdc_platform.lib.columns import (
    OP,
    SEQ,
    SOURCE_FILE,
    SYNCED,
    TMIN_SQL,
    TS,
    col,
    cols,
    from_unix_micros,
    internal,
    is_reserved,
    timestamp_lit,
    value_lit,
)
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import MergeResult
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.reading.passes import event_schema
from cdc_platform.lib.landing.rows.timestamps import CLOCK_SKEW, ahead_of
from cdc_platform.lib.ledgers import erased_keys, revoked_files
from cdc_platform.lib.operations.operation import Request, hour_start, to_ms
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.roots import SourceRootError, adoption_source
from cdc_platform.lib.storage.schema import (
    NATIVE_READ_OPTIONS,
    WIDENINGS,
    normalize_type,
    spark_schema,
    widest,
)
from cdc_platform.lib.storage.stores import Location, Where, read_parquet

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

DELETED = "_fivetran_deleted"
SOURCE_PREFIX = "adopt:"
# Adoption seqs: 2 * A in epoch ms (+1 for a soft-deleted row's delete) above this base, far
# below a truncate's (-T in ms, at least -2.6e14) and any real seq a source gives.
SEQ_BASE = -(2**62)
SourceFormat = Literal["auto", "delta", "parquet"]
_FILE = internal("adopt_file")
_ROW = internal("adopt_row")  # 1-based, in its file
# The repeated-key check's aggregates: working names, so a key column called ``n`` or ``at``
# cannot clash with them.
_ROWS = internal("adopt_rows")
_PLACES = internal("adopt_places")
_SAMPLE = 5


class AdoptionError(Refusal):
    """The source cannot be adopted as it is; the message names the source, rows and reason."""


@dataclass(frozen=True)
class AdoptRequest(Request):
    """The table to adopt (as typed: checked against ``adoption_roots``, the config's) and its
    format. ``now`` is the adoption's time when the source has no ``_fivetran_synced``."""

    source: Where
    adoption_roots: tuple[Where, ...]
    format: SourceFormat = "auto"


@dataclass(frozen=True)
class AdoptResult:
    source: str
    format: str
    adopted_at: datetime  # A: the start of every live row
    live_rows: int
    deleted_rows: int
    events_new: int  # 0 when the same source was adopted before
    dropped_columns: tuple[str, ...]  # the source's _fivetran_ columns, not kept
    merge: MergeResult
    changed: bool = True

    def summary(self) -> str:
        return (
            f"adopted {self.live_rows} live and {self.deleted_rows} soft-deleted row(s) from "
            f"{self.source} at {self.adopted_at.isoformat()}; {self.events_new} event(s) new, "
            f"history version {self.merge.history_version}"
        )

    def metadata(self) -> dict[str, Any]:
        return {
            "operation": ADOPT,
            "source": self.source,
            "format": self.format,
            "adopted_at": self.adopted_at.isoformat(),
            "live_rows": self.live_rows,
            "deleted_rows": self.deleted_rows,
            "events_new": self.events_new,
            "dropped_columns": list(self.dropped_columns),
            **self.merge.metadata(),
        }

    @property
    def hours(self) -> tuple[datetime, ...]:
        return (hour_start(self.adopted_at),)


def source_name(source: Location) -> str:
    """What ``_cdc_source_file`` says of an adoption's events (un-apply accepts it)."""
    return SOURCE_PREFIX + source.uri


def adoption_seqs(adopted_at: datetime) -> tuple[int, int]:
    """The seqs of an adoption at ``adopted_at``: its inserts', and its deletes'."""
    base = SEQ_BASE + 2 * int(to_ms(adopted_at).timestamp() * 1000)
    return base, base + 1


def adopt(t: HistoryTable, request: AdoptRequest) -> AdoptResult:
    """Adopt the table at ``request.source`` into the table's history (see the module
    docstring).

    The source must be under one of ``adoption_roots`` (the config's) and apart from the
    warehouse and the landing root (``lib.storage.roots``): a run's config never copies another
    table's history or change log, or reads a bucket nobody allowed. Errors name the source's
    files, rows and columns, never a value. Raises AdoptionError, naming the rows, for a source
    that cannot be adopted: a missing or null primary-key column, a key on two rows, a column
    whose type contradicts the table's. An erased key's rows are not adopted (the keyring's
    salt tells them).
    """
    where = _checked_source(t, request)
    fmt, rows = _read_source(t.spark, where, request.format)
    pk = t.key
    missing = [k for k in pk if k not in rows.columns]
    if missing:
        raise AdoptionError(
            f"{where}: primary-key column(s) {missing} missing (columns:"
            f" {[c for c in rows.columns if c not in (_FILE, _ROW)]})"
        )
    dropped = tuple(c for c in rows.columns if is_reserved(c) and c not in (_FILE, _ROW))
    _check_keys(rows, where, pk)
    adopted_at = _adopted_at(rows, where, request.now)
    erased_keys.load(t.paths.erased_keys, t.keyring)  # without the salt: refused, nothing written
    events, total, deleted_rows = _events(t, rows, where, adopted_at)
    # A re-run after its events were un-applied logs them again (the user asks for it).
    revoked_files.remove(t.paths.revoked_files, [source_name(where)])
    seqs = adoption_seqs(adopted_at)
    new_events, merge = t.change(
        request.now,
        lambda c: c.append(events, seqs, total + deleted_rows) if total else 0,
        "adoption",
        catch_up=False,
    )
    return AdoptResult(
        source=where.uri,
        format=fmt,
        adopted_at=adopted_at,
        live_rows=total - deleted_rows,
        deleted_rows=deleted_rows,
        events_new=new_events,
        dropped_columns=dropped,
        merge=merge,
    )


def _checked_source(t: HistoryTable, request: AdoptRequest) -> Location:
    """The source, refused for a table adoption cannot serve or a place no root allows."""
    if t.config.keyless:
        # Another tool's `_fivetran_id` is not this platform's hash: its rows could never be
        # matched to the events that follow (docs/limitations.md).
        raise AdoptionError(f"table '{t.name}' is keyless: adopt_table needs a primary key")
    if t.config.protects_columns:
        # A source's rows are copied as they are: its cleartext would reach the table.
        raise AdoptionError(
            f"table '{t.name}' hashes or blocks columns: adopt_table copies a source as it is"
        )
    try:
        return adoption_source(
            request.source, request.adoption_roots, (t.warehouse_root, t.landing_place)
        )
    except SourceRootError as exc:
        raise AdoptionError(str(exc)) from None


def _adopted_at(rows: DataFrame, where: Location, now: datetime) -> datetime:
    """A: the source's largest ``_fivetran_synced`` (``now`` without one), never ahead."""
    from pyspark.sql import functions as F

    # Epoch microseconds: a collected timestamp would come back in the Python process's zone.
    synced_max = (
        rows.agg(F.max(F.unix_micros(col(SYNCED).cast("timestamp")))).collect()[0][0]
        if SYNCED in rows.columns
        else None
    )
    adopted_at = to_ms(from_unix_micros(synced_max)) if synced_max is not None else now
    if ahead_of(adopted_at, now):
        raise AdoptionError(
            f"{where}: its largest {SYNCED} is {adopted_at.isoformat()}, in the future (now "
            f"is {now.isoformat()}, {CLOCK_SKEW.total_seconds():.0f} s of clock skew allowed): "
            "every live row would start after the CDC events logged until then; correct the "
            f"source's {SYNCED} values, or drop the column to adopt at the time of the run"
        )
    return adopted_at


def _events(
    t: HistoryTable, rows: DataFrame, where: Location, adopted_at: datetime
) -> tuple[DataFrame, int, int]:
    """The source's rows as events: each an insert at A (a soft-deleted row's at 0001-01-01,
    followed by its delete); with the counts of rows and of deleted rows."""
    from pyspark.sql import functions as F

    pk = t.key
    data = [c for c in rows.columns if not is_reserved(c) and c not in (_FILE, _ROW)]
    deleted = F.coalesce(col(DELETED), F.lit(False)) if DELETED in rows.columns else F.lit(False)
    typed = _normalized(rows.select(*cols(data), deleted.alias(DELETED)), data)
    typed = _widened(t, typed, where)
    insert_seq, delete_seq = adoption_seqs(adopted_at)
    is_deleted = col(DELETED)
    # A string literal: Python's year-1 datetime reaches the JVM shifted by the calendar change.
    tmin = F.lit(TMIN_SQL).cast("timestamp")
    inserts = typed.select(
        *cols(data),
        F.lit("INSERT").alias(OP),
        F.lit(insert_seq).alias(SEQ),
        F.when(is_deleted, tmin).otherwise(timestamp_lit(adopted_at)).alias(TS),
    )
    deletes = typed.filter(is_deleted).select(
        *cols(pk), F.lit("DELETE").alias(OP), F.lit(delete_seq).alias(SEQ), tmin.alias(TS)
    )
    given = inserts.unionByName(deletes, allowMissingColumns=True).withColumn(
        SOURCE_FILE, F.lit(source_name(where))
    )
    shape = spark_schema(event_schema(delta.arrow_schema_of(typed.drop(DELETED))))
    events = given.select(
        *[
            (col(f.name) if f.name in given.columns else F.lit(None)).cast(f.dataType).alias(f.name)
            for f in shape.fields
        ]
    )
    counts = typed.agg(
        F.count(F.lit(1)).alias("n"), F.sum(is_deleted.cast("int")).alias("deleted")
    ).collect()[0]
    return events, int(counts["n"]), int(counts["deleted"] or 0)


ADOPT = "adopt_table"
# Reader features of a Delta source: the platform reads timestamp_ntz and column mapping by
# name itself (``_physical_schema``); deletion vectors only Delta's own library applies; any
# other feature (a later protocol's) is refused, so a source never chooses the reader.
_READABLE_FEATURES = frozenset({"timestampNtz", "columnMapping"})
_DELTA_LIBRARY_FEATURES = frozenset({"deletionVectors"})


def _read_source(
    spark: SparkSession, where: Location, source_format: SourceFormat
) -> tuple[str, DataFrame]:
    """The source's rows, with the file each came from in ``_FILE`` (for error messages)."""
    fmt = source_format
    if fmt == "auto":
        fmt = "delta" if delta.exists(where) else "parquet"
    if fmt == "delta":
        return fmt, _delta_rows(spark, where)
    if where.is_local and not where.path.exists():
        raise AdoptionError(f"{where}: no such file or folder")
    rows = read_parquet(spark.read.options(**NATIVE_READ_OPTIONS), [where.spark_uri()])
    return fmt, _with_provenance(rows)


def _delta_rows(spark: SparkSession, where: Location) -> DataFrame:
    """A Delta source's rows as of the version checked here. The platform reads the files the
    log lists itself (by physical column name under column mapping by name). A table with
    deletion vectors, or column mapping by id, is read by Delta's own library at that version
    when the session has it (``lib.spark.session.delta_conf``), else refused: its files alone would
    bring deleted rows back, or read columns by the wrong names."""
    from deltalake import DeltaTable

    if not delta.exists(where):
        raise AdoptionError(f"{where}: no Delta table there")
    dt = DeltaTable(where.uri, storage_options=where.storage_options)
    _refuse_files_outside(where, dt)
    if not dt.file_uris():
        raise AdoptionError(f"{where}: the Delta table has no rows to adopt")
    features = set(dt.protocol().reader_features or [])
    unknown = features - _READABLE_FEATURES - _DELTA_LIBRARY_FEATURES
    if unknown:
        raise AdoptionError(f"{where}: the Delta table uses reader features {sorted(unknown)}")
    mode = dt.metadata().configuration.get("delta.columnMapping.mode", "none")
    if mode not in ("none", "name", "id"):
        raise AdoptionError(f"{where}: unknown column mapping mode {mode!r}")
    needs_library = sorted(features & _DELTA_LIBRARY_FEATURES) + (
        ["columnMapping by id"] if mode == "id" else []
    )
    if needs_library:
        return _delta_library_rows(spark, where, dt, needs_library)
    logical = spark_schema(delta.table_arrow_schema(dt))
    physical = _physical_schema(dt, where)
    if dt.metadata().partition_columns:
        return _partitioned_rows(spark, where, dt, logical, physical)
    logged = pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist()
    rows = delta.read_files(
        spark.read.schema(physical).options(**NATIVE_READ_OPTIONS), where, logged
    )
    return _logical(_with_provenance(rows), logical, physical)


def _delta_library_rows(
    spark: SparkSession, where: Location, dt: DeltaTable, features: list[str]
) -> DataFrame:
    """The source read by Delta's own library, pinned to the version checked here."""
    from pyspark.sql import functions as F

    if not _has_delta_library(spark):
        raise AdoptionError(
            f"{where}: the Delta table uses {features}, which only Delta's own library reads"
            " correctly (deletion vectors hide deleted rows the files still hold): adopt it from"
            " a Spark session with delta-spark (docs/engines.md), or purge them first"
            " (`REORG TABLE ... APPLY (PURGE)`, then `ALTER TABLE ... DROP FEATURE`)"
        )
    rows = spark.read.format("delta").option("versionAsOf", dt.version()).load(where.spark_uri())
    # Delta's reader gives no row numbers: errors name the file only.
    return rows.withColumn(_FILE, F.col("_metadata.file_path")).withColumn(
        _ROW, F.lit(None).cast("long")
    )


def _has_delta_library(spark: SparkSession) -> bool:
    """Whether the session runs Delta's SQL extension (``lib.spark.session.delta_conf``)."""
    return "DeltaSparkSessionExtension" in (spark.conf.get("spark.sql.extensions", "") or "")


def _physical_schema(dt: DeltaTable, where: Location) -> StructType:
    """The table's schema as its files store it: its own types, and under column mapping each
    field (nested ones too) named by its ``delta.columnMapping.physicalName``. Two columns
    stored under one name are refused (a hostile log could alias them)."""
    import json

    from pyspark.sql.types import StructType

    def rename(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rename(v) for k, v in node.items()}
            physical = (node.get("metadata") or {}).get("delta.columnMapping.physicalName")
            if "name" in node and physical:
                out["name"] = physical
            return out
        if isinstance(node, list):
            return [rename(v) for v in node]
        return node

    schema = StructType.fromJson(rename(json.loads(dt.schema().to_json())))
    names = [f.name for f in schema.fields]
    if len(set(names)) != len(names) or _FILE in names or _ROW in names:
        raise AdoptionError(f"{where}: the Delta log stores two columns under one name")
    return schema


def _logical(rows: DataFrame, logical: StructType, physical: StructType) -> DataFrame:
    """Rows read by physical names and stored types, under the table's logical names and the
    platform's types (a cast of a struct matches its fields by position, so nested physical
    names become logical ones)."""
    return rows.select(
        *[
            col(p.name).cast(f.dataType).alias(f.name)
            for f, p in zip(logical.fields, physical.fields, strict=True)
        ],
        col(_FILE),
        col(_ROW),
    )


def _refuse_files_outside(where: Location, dt: Any) -> None:
    """A Delta log may name data files by absolute path, URI, ``..`` or a glob pattern Spark
    expands (``a{/..}{/..}/x``): whoever can write a log under an adoption root could point it
    at another table's history or change log. Every file of the source must be a relative path
    inside it, once decoded and normalized (``delta.relative_file``; docs/SECURITY.md)."""
    for action in pa.table(dt.get_add_actions(flatten=True)).to_pylist():
        if action.get("deletionVector.storageType") == "p":
            raise AdoptionError(
                f"{where}: the Delta log names a deletion vector by absolute path: a source's"
                " files must all be inside it"
            )
        try:
            delta.relative_file(where, str(action["path"]))
        except delta.UnsafeFilePathError as exc:
            raise AdoptionError(f"{exc}; nothing was read") from None


def _with_provenance(rows: DataFrame) -> DataFrame:
    """Each row's file and 1-based row number (for error messages: never its values)."""
    from pyspark.sql import functions as F

    return rows.withColumn(_FILE, F.col("_metadata.file_path")).withColumn(
        _ROW, F.col("_metadata.row_index") + 1
    )


def _partitioned_rows(
    spark: SparkSession, where: Location, dt: DeltaTable, logical: StructType, physical: StructType
) -> DataFrame:
    """A partitioned Delta table's rows: its files hold no partition column, so each group of
    files is read with its partition values (from the Delta log, typed) as literal columns."""
    from pyspark.sql.types import StructType

    parts = list(dt.metadata().partition_columns)
    stored = {f.name: p.name for f, p in zip(logical.fields, physical.fields, strict=True)}
    data_schema = StructType(
        [p for f, p in zip(logical.fields, physical.fields, strict=True) if f.name not in parts]
    )
    actions = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    groups: dict[tuple[Any, ...], list[str]] = {}
    for a in actions:
        # The log keys partition values by the column's stored (physical) name.
        values = tuple(
            a[f"partition.{stored[c]}"]
            if f"partition.{stored[c]}" in a
            else a.get(f"partition.{c}")
            for c in parts
        )
        # The log's path is URI-encoded: ``delta.absolute_paths`` decodes it (and checks it).
        groups.setdefault(values, []).append(a["path"])
    frames = []
    for values, paths in groups.items():
        rows = delta.read_files(
            spark.read.schema(data_schema).options(**NATIVE_READ_OPTIONS), where, paths
        )
        for c, v in zip(parts, values, strict=True):
            rows = rows.withColumn(stored[c], value_lit(v).cast(logical[c].dataType))
        frames.append(_with_provenance(rows))
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return _logical(out, logical, physical)


def _place(file: str, row: int | None) -> str:
    return file if row is None else f"{file} row {row}"


def _check_keys(rows: DataFrame, where: Location, pk: Sequence[str]) -> None:
    """Every row has its whole key, and no key is on two rows: else an error naming the rows
    by file and row number, never a key value (it may be an encrypted table's)."""
    from pyspark.sql import functions as F

    null_key = F.lit(False)
    for k in pk:
        null_key = null_key | col(k).isNull()
    bad = rows.filter(null_key).select(_FILE, _ROW).limit(_SAMPLE).collect()
    if bad:
        sample = "; ".join(_place(r[_FILE], r[_ROW]) for r in bad)
        raise AdoptionError(f"{where}: rows with a null primary key ({', '.join(pk)}): {sample}")
    twice = (
        rows.groupBy(*cols(list(pk)))
        .agg(
            F.count(F.lit(1)).alias(_ROWS),
            F.sort_array(F.collect_list(F.struct(col(_FILE), col(_ROW)))).alias(_PLACES),
        )
        .filter(col(_ROWS) > 1)
        .select(_ROWS, _PLACES)
        .limit(_SAMPLE)
        .collect()
    )
    if twice:
        sample = "; ".join(
            " and ".join(_place(a[0], a[1]) for a in r[_PLACES][:3])
            + (f" ({r[_ROWS]} rows)" if r[_ROWS] > 3 else "")
            for r in twice
        )
        raise AdoptionError(f"{where}: a key may be on one row only; one key is on {sample}")


def _normalized(rows: DataFrame, data: Sequence[str]) -> DataFrame:
    """Each data column cast to the one type the change log uses for it (``normalize_type``)."""
    arrow = delta.arrow_schema_of(rows.select(*cols(list(data))))
    target = spark_schema(pa.schema([pa.field(f.name, f.type) for f in arrow]))
    return rows.select(
        *[col(f.name).cast(f.dataType).alias(f.name) for f in target.fields], col(DELETED)
    )


def _widened(t: HistoryTable, typed: DataFrame, where: Location) -> DataFrame:
    """The rows with each column the change log has already in the type both widen to (the
    log, and then the history table, widen to it as for any landing file); an error naming
    the column when there is none."""
    from pyspark.sql.pandas.types import from_arrow_schema

    logged = changelog.key_and_data_fields(t.changelog)
    if logged is None:
        return typed
    paths, may_widen = t.paths, t.config.may_widen
    have = {f.name: f.type for f in logged}
    casts = {}
    for f in delta.arrow_schema_of(typed.drop(DELETED)):
        given = normalize_type(f.type)
        if f.name not in have or pa.types.is_null(have[f.name]):
            continue
        wider = widest(have[f.name], given)
        if wider is None:
            raise AdoptionError(
                f"{where}: column '{f.name}' has type {given} but {have[f.name]} in table "
                f"{paths.history}, and neither widens to the other ({WIDENINGS})"
            )
        if wider != have[f.name] and not may_widen(f.name):
            raise AdoptionError(
                f"{where}: column '{f.name}' has type {given} but {have[f.name]} in table "
                f"{paths.history}: adopting it would widen the column to {wider} for good, "
                "which the table's widen_types does not allow (never a primary-key column by "
                "default); set `widen_types: all` (a key column) or `data` on the table to "
                "accept it"
            )
        if wider != given:
            casts[f.name] = from_arrow_schema(pa.schema([pa.field(f.name, wider)]))[0].dataType
    return typed.select(
        *[col(c).cast(casts[c]).alias(c) if c in casts else col(c) for c in typed.columns]
    )
