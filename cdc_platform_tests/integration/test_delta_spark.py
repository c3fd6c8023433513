"""Delta's own JVM library (delta-spark) on the platform's tables, and the platform on tables
delta-spark wrote.

The suite's session runs Delta's extension and catalog (conftest), as Databricks, EMR or OSS
Spark with delta-spark do. After a demo-like run (late events, a widening, a quarantined file, a
soft truncate, an un-apply, the current table), every Delta table the platform owns reads the
same through delta-spark as through delta-rs, cell by cell and type by type; ``DESCRIBE
HISTORY``, ``DESCRIBE DETAIL``, time travel, ``OPTIMIZE`` and ``VACUUM`` run on them, and the
platform goes on afterwards exactly as on an untouched copy (docs/engines.md).
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_platform import read
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import current_table, invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.adopt import AdoptionError, AdoptRequest, adopt
from cdc_platform.lib.operations.truncate import TruncateRequest, truncate
from cdc_platform.lib.operations.unapply import UnapplyRequest, unapply
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.delta import UnsupportedTableFeatureError
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2, H3 = (H0 + timedelta(hours=n) for n in (1, 2, 3))
TABLE = TableConfig(name="orders", primary_key=("id",), start=H0)
S0 = datetime(2024, 1, 2, tzinfo=UTC)


def at(hour: datetime, minute: int) -> datetime:
    return hour + timedelta(minutes=minute)


def synced(n: int) -> datetime:
    return S0 + timedelta(hours=n)


def _events(hour: datetime, base: int, keys: range, status: str) -> list[dict[str, Any]]:
    return [
        ev("UPDATE" if base else "INSERT", base + k, at(hour, k), k, status=status, amount=k)
        for k in keys
    ]


@pytest.fixture(scope="module")
def built(spark, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo-like history: inserts, then a widening (``amount`` int32 -> int64), late events
    into an applied hour, a quarantined file, a soft truncate, an un-applied file and the
    current table, committed by the platform (delta-rs)."""
    root = tmp_path_factory.mktemp("delta_spark")
    landing, warehouse = root / "landing", root / "warehouse"
    narrow = pa.schema(
        [
            pa.field("id", pa.int64()),
            pa.field("status", pa.string()),
            pa.field("amount", pa.int32()),
            pa.field("cdc_operation_type", pa.string()),
            pa.field("cdc_change_seq", pa.int64()),
            pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
        ]
    )
    write_parquet_events(landing, "orders", H0, _events(H0, 0, range(1, 9), "new"), narrow)
    write_parquet_events(landing, "orders", H0, [ev("DELETE", 50, at(H0, 50), 8)], narrow)
    materialize(spark, TABLE, landing, warehouse, [H0], synced_at=synced(0))
    wide = _events(H1, 100, range(1, 5), "paid")  # amount int64: the table widens
    write_parquet_events(landing, "orders", H1, wide)
    write_parquet_events(
        landing, "orders", H1, [ev("BOGUS", 199, at(H1, 59), 1)], name="bad.parquet"
    )
    materialize(spark, TABLE, landing, warehouse, [H1], synced_at=synced(1))
    write_parquet_events(landing, "orders", H2, _events(H2, 200, range(2, 7), "shipped"))
    materialize(spark, TABLE, landing, warehouse, [H2], synced_at=synced(2))
    # Late: events of hour 1 that land after hour 2 was applied.
    late = [ev("UPDATE", 150, at(H1, 30), k, status="late", amount=k * 10) for k in (3, 4, 5)]
    write_parquet_events(landing, "orders", H1, late, name="late.parquet")
    materialize(spark, TABLE, landing, warehouse, [H1], synced_at=synced(3))
    truncate(
        HistoryTable(spark, TABLE, warehouse),
        TruncateRequest(before=at(H0, 3), soft=True, now=synced(4)),
    )
    extra = write_parquet_events(
        landing, "orders", H2, [ev("UPDATE", 250, at(H2, 40), 2, status="x")]
    )
    materialize(spark, TABLE, landing, warehouse, [H2], synced_at=synced(5))
    unapply(
        HistoryTable(spark, TABLE, warehouse, landing),
        UnapplyRequest((str(extra.relative_to(landing)),), "test", "run-1", now=synced(6)),
    )
    current_table.refresh(HistoryTable(spark, TABLE, warehouse))
    return root


def delta_tables(warehouse: Path) -> list[Path]:
    return sorted(p.parent for p in warehouse.rglob("_delta_log"))


def _plain(t: pa.DataType) -> pa.DataType:
    """Arrow's storage variants of one logical type (large_string, string_view, ...) as one."""
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_list(t):
        return pa.list_(_plain(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_plain(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_plain(t.key_type), _plain(t.item_type))
    return t


def _sorted_rows(table: pa.Table) -> list[tuple]:
    rows = [tuple(r.values()) for r in table.to_pylist()]
    return sorted(rows, key=lambda r: tuple((v is None, repr(v)) for v in r))


def assert_same_reads(spark, path: Path | Location, version: int | None = None) -> None:
    """delta-spark and delta-rs read ``path`` (at ``version``) the same: the Delta schema field
    by field, the Arrow types, and every cell."""
    dt = DeltaTable(str(path), version=version)
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    df = reader.load(str(path))
    rs_fields = json.loads(dt.schema().to_json())["fields"]
    spark_fields = json.loads(df.schema.json())["fields"]
    assert [(f["name"], f["type"], f["nullable"]) for f in spark_fields] == [
        (f["name"], f["type"], f["nullable"]) for f in rs_fields
    ], path
    ours = dt.to_pyarrow_table()
    theirs = df.toArrow()
    assert [_plain(f.type) for f in theirs.schema] == [_plain(f.type) for f in ours.schema], path
    assert theirs.num_rows == ours.num_rows, path
    assert _sorted_rows(theirs) == _sorted_rows(ours), path


def test_every_table_the_platform_writes_reads_the_same_in_delta_spark(spark, built):
    tables = delta_tables(built / "warehouse")
    names = {p.relative_to(built / "warehouse").as_posix() for p in tables}
    # The history, the change log, the current table, quarantine and the other ledgers.
    assert {"orders", "orders_current", "_cdc/orders/changelog", "_cdc/orders/quarantine"} <= names
    assert len(names) >= 6, names
    for path in tables:
        assert_same_reads(spark, path)


def test_history_detail_and_time_travel_agree_with_the_log(spark, built):
    for path in delta_tables(built / "warehouse"):
        dt = DeltaTable(str(path))
        history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
        assert sorted(r["version"] for r in history) == list(range(dt.version() + 1)), path
        detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").collect()[0]
        assert detail["numFiles"] == len(dt.file_uris()), path
        protocol = dt.protocol()
        assert (detail["minReaderVersion"], detail["minWriterVersion"]) == (
            protocol.min_reader_version,
            protocol.min_writer_version,
        ), path
    history_path = built / "warehouse" / "orders"
    latest = DeltaTable(str(history_path)).version()
    for version in range(latest + 1):
        assert_same_reads(spark, history_path, version)
    # timestampAsOf a commit's own time reads that commit's version.
    commits = spark.sql(f"DESCRIBE HISTORY delta.`{history_path}`").collect()
    by_version = {r["version"]: r["timestamp"] for r in commits}
    for version in (1, latest - 1):
        if by_version[version] == by_version.get(version + 1):
            continue  # two commits in one millisecond: the later one is what the time names
        df = (
            spark.read.format("delta")
            .option("timestampAsOf", by_version[version].isoformat())
            .load(str(history_path))
        )
        expected = DeltaTable(str(history_path), version=version).to_pyarrow_table()
        assert _sorted_rows(df.toArrow()) == _sorted_rows(expected)


def _history_and_log(warehouse: Path) -> tuple[list[tuple], list[tuple]]:
    paths = TablePaths.of(warehouse, "orders")
    return (
        _sorted_rows(DeltaTable(str(paths.history)).to_pyarrow_table()),
        _sorted_rows(DeltaTable(str(paths.changelog)).to_pyarrow_table()),
    )


def test_the_platform_goes_on_after_delta_spark_optimizes_and_vacuums(spark, built, tmp_path):
    """OPTIMIZE and VACUUM (no retention) by delta-spark on the history and the change log,
    then the next hour: the same rows, checks, as-of reads and current table as a copy nobody
    maintained."""
    maintained, untouched = tmp_path / "maintained", tmp_path / "untouched"
    for copy in (maintained, untouched):
        shutil.copytree(built, copy)
    warehouse = maintained / "warehouse"
    before = _history_and_log(warehouse)
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        for path in (warehouse / "orders", warehouse / "_cdc" / "orders" / "changelog"):
            spark.sql(f"OPTIMIZE delta.`{path}`").collect()
            spark.sql(f"VACUUM delta.`{path}` RETAIN 0 HOURS").collect()
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    assert _history_and_log(warehouse) == before
    for copy in (maintained, untouched):
        write_parquet_events(
            copy / "landing",
            "orders",
            H3,
            _events(H3, 300, range(1, 12), "done"),
            name="h3.parquet",
        )
        materialize(spark, TABLE, copy / "landing", copy / "warehouse", [H3], synced_at=synced(7))
    assert _history_and_log(warehouse) == _history_and_log(untouched / "warehouse")
    paths = TablePaths.of(warehouse, "orders")
    control_paths = TablePaths.of(untouched / "warehouse", "orders")
    outcomes = {o.name: o.passed for o in invariants.run_checks(spark, paths, TABLE.key)}
    control = {o.name: o.passed for o in invariants.run_checks(spark, control_paths, ("id",))}
    assert outcomes == control
    # Every invariant holds; the one failure is the quarantined file, as it should be.
    assert [name for name, passed in outcomes.items() if not passed] == ["no_quarantined_files"]
    for ts in (at(H1, 45), at(H3, 30)):
        ours = read.as_of_arrow(paths.history, ts).to_table()
        theirs = read.as_of_arrow(control_paths.history, ts).to_table()
        assert _sorted_rows(ours) == _sorted_rows(theirs)
    current_table.refresh(HistoryTable(spark, TABLE, warehouse))
    assert_same_reads(spark, paths.history)
    assert_same_reads(spark, paths.current)


@pytest.mark.parametrize(
    "change",
    [
        "SET TBLPROPERTIES ('delta.columnMapping.mode' = 'name')",
        "SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')",
        "SET TBLPROPERTIES ('delta.appendOnly' = 'true')",
        "ADD CONSTRAINT positive CHECK (id > 0)",
        # Dropped, but leaving checkpointProtection, to which delta-rs 1.6 cannot commit.
        "SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true'); DROP FEATURE deletionVectors",
    ],
    ids=["column-mapping", "deletion-vectors", "append-only", "check-constraint", "dropped"],
)
def test_a_feature_delta_spark_turns_on_is_refused_naming_it(spark, built, tmp_path, change):
    """What the platform cannot keep (delta-rs reads column-mapped files as nulls, cannot read
    deletion vectors, would not enforce a constraint) stops the next run with what to undo,
    before anything is written."""
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    history = copy / "warehouse" / "orders"
    for statement in change.split(";"):
        spark.sql(f"ALTER TABLE delta.`{history}` {statement.strip()}")
    log = copy / "warehouse" / "_cdc" / "orders" / "changelog"
    versions = (DeltaTable(str(history)).version(), DeltaTable(str(log)).version())
    write_parquet_events(copy / "landing", "orders", H3, _events(H3, 300, range(1, 3), "done"))
    with pytest.raises(UnsupportedTableFeatureError, match=r"Delta features .*docs/engines.md"):
        materialize(spark, TABLE, copy / "landing", copy / "warehouse", [H3], synced_at=synced(7))
    assert (DeltaTable(str(history)).version(), DeltaTable(str(log)).version()) == versions


def test_a_feature_undone_as_the_message_says_lets_the_platform_go_on(spark, built, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    history = copy / "warehouse" / "orders"
    spark.sql(f"ALTER TABLE delta.`{history}` ADD CONSTRAINT positive CHECK (id > 0)")
    spark.sql(f"ALTER TABLE delta.`{history}` DROP CONSTRAINT positive")
    write_parquet_events(copy / "landing", "orders", H3, _events(H3, 300, range(1, 3), "done"))
    materialize(spark, TABLE, copy / "landing", copy / "warehouse", [H3], synced_at=synced(7))
    assert_same_reads(spark, history)


# -- adoption of tables delta-spark wrote ---------------------------------------------------------


ADOPT = TableConfig(name="customers", primary_key=("id",), start=H0)
NOW = datetime(2024, 2, 1, tzinfo=UTC)


def _make_source(spark, path: Path, properties: str, partitioned: bool = False) -> None:
    """A soft-delete-mode table as Fivetran would leave it, written by delta-spark."""
    parts = "PARTITIONED BY (region)" if partitioned else ""
    spark.sql(
        f"CREATE TABLE delta.`{path}` (id BIGINT, name STRING, region STRING, seen TIMESTAMP_NTZ,"
        " addr STRUCT<city: STRING, zip: INT>,"
        f" _fivetran_synced TIMESTAMP, _fivetran_deleted BOOLEAN) USING delta {parts}"
        f" TBLPROPERTIES ({properties})"
    )
    spark.sql(
        f"INSERT INTO delta.`{path}` VALUES"
        " (1, 'ann', 'eu', TIMESTAMP_NTZ'2024-01-01 10:00:00', named_struct('city', 'x', 'zip', 1),"
        "  TIMESTAMP'2024-01-05 00:00:00', false),"
        " (2, 'bob', 'us', NULL, NULL, TIMESTAMP'2024-01-05 00:00:00', true),"
        " (3, 'cy', 'eu', TIMESTAMP_NTZ'2024-01-02 10:00:00', named_struct('city', 'y', 'zip', 2),"
        "  TIMESTAMP'2024-01-06 00:00:00', false),"
        " (4, 'dee', 'us', NULL, NULL, TIMESTAMP'2024-01-06 00:00:00', false)"
    )


def _adopted(spark, lake: dict[str, Path], source: Path) -> list[tuple]:
    adopt(
        HistoryTable(spark, ADOPT, lake["warehouse"], lake["landing"]),
        AdoptRequest(source, (lake["root"],), now=NOW),
    )
    rows = DeltaTable(str(TablePaths.of(lake["warehouse"], "customers").history)).to_pyarrow_table()
    return sorted(
        (r["id"], r["name"], r["region"], r["seen"], r["addr"], r["_fivetran_active"])
        for r in rows.to_pylist()
    )


# timestamp_ntz values are UTC in the history table, as a naive landing timestamp is (contract).
EXPECTED = [
    (1, "ann", "eu", datetime(2024, 1, 1, 10, tzinfo=UTC), {"city": "x", "zip": 1}, True),
    (2, "bob", "us", None, None, False),
    (3, "cy", "eu", datetime(2024, 1, 2, 10, tzinfo=UTC), {"city": "y", "zip": 2}, True),
]


@pytest.mark.parametrize(
    ("properties", "partitioned"),
    [
        ("'delta.enableDeletionVectors' = 'true'", False),
        ("'delta.columnMapping.mode' = 'name'", False),
        ("'delta.columnMapping.mode' = 'name'", True),
        ("'delta.columnMapping.mode' = 'id'", False),
        ("'delta.appendOnly' = 'false'", True),
    ],
    ids=[
        "deletion-vectors",
        "column-mapping",
        "column-mapping-partitioned",
        "column-mapping-by-id",
        "partitioned",
    ],
)
def test_a_table_delta_spark_wrote_is_adopted_with_its_features(
    spark, lake, properties, partitioned
):
    """Deletion vectors (a deleted row stays in its file), column mapping by name and by id
    (files use physical names, nested fields too; a column renamed), ``timestamp_ntz``, a
    struct, partitioning and a CHECK constraint."""
    source = lake["root"] / "source"
    _make_source(spark, source, properties, partitioned)
    spark.sql(f"ALTER TABLE delta.`{source}` ADD CONSTRAINT known CHECK (id > 0)")
    spark.sql(f"DELETE FROM delta.`{source}` WHERE id = 4")
    if "columnMapping" in properties:
        spark.sql(f"ALTER TABLE delta.`{source}` RENAME COLUMN name TO full_name")
        spark.sql(f"ALTER TABLE delta.`{source}` RENAME COLUMN full_name TO name")
    assert _adopted(spark, lake, source) == EXPECTED


def test_without_delta_spark_column_mapping_is_read_and_deletion_vectors_are_refused(
    spark, lake, monkeypatch
):
    """A session without Delta's library (the platform's own) reads column-mapped files by
    their physical names, and refuses deletion vectors rather than bring deleted rows back."""
    monkeypatch.setattr(
        "cdc_platform.lib.operations.adopt._has_delta_library", lambda _spark: False
    )
    mapped = lake["root"] / "mapped"
    _make_source(spark, mapped, "'delta.columnMapping.mode' = 'name'", partitioned=True)
    spark.sql(f"ALTER TABLE delta.`{mapped}` RENAME COLUMN name TO label")
    spark.sql(f"ALTER TABLE delta.`{mapped}` RENAME COLUMN label TO name")
    spark.sql(f"DELETE FROM delta.`{mapped}` WHERE id = 4")  # no deletion vectors: rewritten
    assert _adopted(spark, lake, mapped) == EXPECTED
    with_dv = lake["root"] / "with_dv"
    _make_source(spark, with_dv, "'delta.enableDeletionVectors' = 'true'")
    spark.sql(f"DELETE FROM delta.`{with_dv}` WHERE id = 4")
    with pytest.raises(AdoptionError, match=r"deletionVectors.*docs/engines.md"):
        other = TableConfig(name="other", primary_key=("id",), start=H0)
        adopt(
            HistoryTable(spark, other, lake["warehouse"], lake["landing"]),
            AdoptRequest(with_dv, (lake["root"],), now=NOW),
        )
