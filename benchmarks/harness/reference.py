"""The single-node references a run is compared with: one SQL fold of every landed event
(window functions: one version per key and millisecond, consecutive equal images merged,
deletes close, docs/HISTORY_MODE.md), in DuckDB (written with delta-rs) and in Spark SQL (the
plainest Spark a data engineer would write), and a row-by-row comparison with a history table."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from benchmarks.harness.table import DATA_COLUMNS, TABLE_NAME, TMAX_US, TS_TYPE

# The fold, up to the versions it opens: a duplicate delivery keeps its first copy; the
# dialect fills the source, the millisecond, the aggregates and the versions' final columns.
FOLD_SQL = """
WITH raw AS (
    SELECT id, {cols}, cdc_change_seq AS seq,
           {ms} AS ms,
           upper(cdc_operation_type) = 'DELETE' AS del,
           row_number() OVER (PARTITION BY id, cdc_change_seq
                              ORDER BY {copy_order}) AS copy
    FROM {source}
),
ev AS (SELECT * FROM raw WHERE copy = 1),
-- one step per (key, millisecond): does it hold an image, does it end deleted, which image
step_keys AS (
    SELECT id, ms,
           bool_or(NOT del) AS has_image,
           {ends_deleted} AS ends_deleted,
           {image_seq} AS image_seq
    FROM ev GROUP BY id, ms
),
steps AS (
    SELECT s.id, s.ms, s.has_image, s.ends_deleted, {image_cols}
    FROM step_keys s LEFT JOIN ev e ON e.id = s.id AND e.seq = s.image_seq
),
walked AS (
    SELECT *,
           coalesce(lag(has_image AND NOT ends_deleted) OVER w, false) AS live_before,
           {prev_cols}
    FROM steps WINDOW w AS (PARTITION BY id ORDER BY ms)
),
opened AS (
    SELECT *, has_image AND NOT (live_before AND {same_image}) AS opens FROM walked
),
closed AS (
    SELECT *,
           {next_close}
               OVER (PARTITION BY id ORDER BY ms
                     ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS next_close
    FROM opened
){versions}
"""

_DUCKDB_VERSIONS = """
SELECT id, {cols}, ms AS _fivetran_start,
       CASE WHEN ends_deleted THEN ms
            WHEN next_close IS NOT NULL THEN next_close
            ELSE {tmax} END AS _fivetran_end
FROM closed WHERE opens"""

_SPARK_VERSIONS = """,
versions AS (
    SELECT id, {cols}, ms AS start_us,
           CASE WHEN ends_deleted THEN ms
                WHEN next_close IS NOT NULL THEN next_close
                ELSE {tmax} END AS end_us
    FROM closed WHERE opens
)
SELECT id, {cols},
       timestamp_micros(start_us) AS _fivetran_start,
       timestamp_micros(end_us) AS _fivetran_end,
       end_us = {tmax} AS _fivetran_active,
       current_timestamp() AS _fivetran_synced
FROM versions"""


@dataclass(frozen=True)
class _Dialect:
    ms: str
    copy_order: str
    source: str
    ends_deleted: str
    image_seq: str
    next_close: str
    null_safe_equal: str  # a format of (column, previous column)
    versions: str


_DUCKDB = _Dialect(
    ms="(epoch_us(cdc_commit_timestamp) // 1000) * 1000",
    copy_order="filename, file_row_number",
    source="read_parquet('{glob}', hive_partitioning = false, filename = true,\n"
    "                      file_row_number = true, union_by_name = true)",
    ends_deleted="arg_max(del, seq)",
    image_seq="max(seq) FILTER (WHERE NOT del)",
    next_close="first_value(CASE WHEN opens THEN ms - 1000 WHEN ends_deleted THEN ms END "
    "IGNORE NULLS)",
    null_safe_equal="{0} IS NOT DISTINCT FROM {1}",
    versions=_DUCKDB_VERSIONS,
)

# Over the view ``landing``: the events with the file and row each came from.
_SPARK = _Dialect(
    ms="unix_micros(date_trunc('millisecond', cdc_commit_timestamp))",
    copy_order="source_file, source_row",
    source="landing",
    ends_deleted="max_by(del, seq)",
    image_seq="max(CASE WHEN NOT del THEN seq END)",
    next_close="first(CASE WHEN opens THEN ms - 1000 WHEN ends_deleted THEN ms END, true)",
    null_safe_equal="{0} <=> {1}",
    versions=_SPARK_VERSIONS,
)


def _fold_sql(dialect: _Dialect, **source: str) -> str:
    cols = ", ".join(DATA_COLUMNS)
    return FOLD_SQL.format(
        cols=cols,
        ms=dialect.ms,
        copy_order=dialect.copy_order,
        source=dialect.source.format(**source),
        ends_deleted=dialect.ends_deleted,
        image_seq=dialect.image_seq,
        image_cols=", ".join(f"e.{c}" for c in DATA_COLUMNS),
        prev_cols=", ".join(f"lag({c}) OVER w AS prev_{c}" for c in DATA_COLUMNS),
        same_image=" AND ".join(
            dialect.null_safe_equal.format(c, f"prev_{c}") for c in DATA_COLUMNS
        ),
        next_close=dialect.next_close,
        versions=dialect.versions.format(cols=cols, tmax=TMAX_US),
    )


def duckdb_fold_sql(glob: str) -> str:
    """The fold over the Parquet files ``glob`` matches, in DuckDB SQL."""
    return _fold_sql(_DUCKDB, glob=glob)


def spark_fold_sql() -> str:
    """The fold over the view ``landing`` (with ``source_file`` and ``source_row``), in Spark
    SQL: history-table rows, ``_fivetran_synced`` the query's time."""
    return _fold_sql(_SPARK)


def reference_fold(landing: Path, out_path: Path, synced_at: datetime) -> tuple[float, pa.Table]:
    """Fold every landing file with DuckDB SQL and write the result with delta-rs."""
    import duckdb
    from deltalake import write_deltalake

    t0 = time.perf_counter()
    sql = duckdb_fold_sql(f"{landing / TABLE_NAME}/**/*.parquet")
    con = duckdb.connect()
    con.execute("SET threads TO 2")
    folded = con.sql(sql).to_arrow_table()
    start = folded.column("_fivetran_start").cast(TS_TYPE)
    end = folded.column("_fivetran_end").cast(TS_TYPE)
    active = pc.equal(folded.column("_fivetran_end"), TMAX_US)  # pyright: ignore[reportAttributeAccessIssue]
    out = folded.select(["id", *DATA_COLUMNS])
    out = out.set_column(
        out.schema.get_field_index("updated_at"), "updated_at", out["updated_at"].cast(TS_TYPE)
    )
    out = out.append_column("_fivetran_start", start)
    out = out.append_column("_fivetran_end", end).append_column("_fivetran_active", active)
    synced = pa.array([synced_at] * out.num_rows, TS_TYPE)
    out = out.append_column("_fivetran_synced", synced)
    write_deltalake(str(out_path), out, mode="overwrite")
    return time.perf_counter() - t0, out


def compare_tables(spark_table: pa.Table, reference: pa.Table) -> str | None:
    """None if equal as sorted row sets (ignoring ``_fivetran_synced``), else what differs."""
    columns = [c for c in reference.column_names if c != "_fivetran_synced"]
    a = spark_table.select(columns)
    b = reference.select(columns).cast(a.schema)
    order = [("id", "ascending"), ("_fivetran_start", "ascending")]
    a, b = a.sort_by(order), b.sort_by(order)
    if a.equals(b):
        return None
    if a.num_rows != b.num_rows:
        return f"{a.num_rows:,} rows vs {b.num_rows:,}"
    for c in columns:
        diff = pc.invert(pc.fill_null(pc.equal(a[c], b[c]), False))  # pyright: ignore[reportAttributeAccessIssue]
        both_null = pc.and_(pc.is_null(a[c]), pc.is_null(b[c]))  # pyright: ignore[reportAttributeAccessIssue]
        diff = pc.and_not(diff, both_null)  # pyright: ignore[reportAttributeAccessIssue]
        idx = pc.indices_nonzero(diff)  # pyright: ignore[reportAttributeAccessIssue]
        if len(idx):
            i = idx[0].as_py()
            return (
                f"{len(idx):,} rows differ in {c}; first: spark {a.slice(i, 1).to_pylist()} "
                f"vs reference {b.slice(i, 1).to_pylist()}"
            )
    return "tables differ (schema or metadata)"
