"""Tables without a primary key (HISTORY_MODE section 3): each distinct row image is its own key,
``_fivetran_id``, a hash of its values; the rules hold per id."""

from __future__ import annotations

import hashlib
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import PlatformConfig, load_config
from cdc_platform.lib.history import invariants, table_key
from cdc_platform.lib.landing.rows.row_id import row_ids
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    materialize_with_checks,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
H2 = H0 + timedelta(hours=2)


def config_file(tmp_path: Path, key: str = "keyless: true") -> PlatformConfig:
    path = tmp_path / "cdc_platform.yaml"
    path.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\nsnapshot_roots: [snapshot]\ntables:\n"
        f'  - name: t\n    {key}\n    start: "2024-01-01-00:00"\n    current_table: true\n'
    )
    return load_config(path)


def materialize_asset(platform: PlatformConfig, hour: datetime) -> dg.ExecuteInProcessResult:
    return materialize_with_checks(platform, "t", hour)


def item(op: str, seq: int, at: datetime, sku: str, qty: int | None, **more: object) -> dict:
    return ev(op, seq, at, sku, key_column="sku", qty=qty, **more)


def row_id(**cells: object) -> str:
    return row_ids({n: pa.array([v]) for n, v in cells.items()}, 1)[0].as_py()


FIRST_HOUR = [
    item("INSERT", 1, H0 + timedelta(minutes=1), "a", 1),
    item("INSERT", 2, H0 + timedelta(minutes=2), "b", 2),
]


def history_rows(paths: TablePaths) -> list[dict]:
    rows = DeltaTable(paths.history.uri).to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda r: (r["sku"], r["qty"] or 0, r["_fivetran_start"]))


def test_each_distinct_row_is_its_own_key_through_the_asset(spark, tmp_path):
    platform = config_file(tmp_path)
    paths = TablePaths.of(platform.warehouse_root, "t")
    duplicate = item("INSERT", 3, H0 + timedelta(minutes=3), "a", 1)  # nothing new
    write_parquet_events(platform.landing_path, "t", H0, [*FIRST_HOUR, duplicate])
    assert materialize_asset(platform, H0).success
    # A later file with a new column, null in this row: the same row, the same id.
    write_parquet_events(
        platform.landing_path,
        "t",
        H1,
        [
            item("INSERT", 4, H1 + timedelta(minutes=1), "a", 1, note=None),
            # An update without a before-image: the new image opens its own version, the old
            # one stays active until its delete arrives.
            item("UPDATE", 5, H1 + timedelta(minutes=2), "a", 3, note="x"),
            item("DELETE", 6, H1 + timedelta(minutes=3), "b", 2),
        ],
    )
    applied = materialize_asset(platform, H1)
    assert applied.success
    checked = applied.get_asset_check_evaluations()
    assert checked and all(c.passed for c in checked), [c.check_name for c in checked]
    defs = build_table_definitions(platform, platform.table("t"))
    assert defs.current is not None
    assert dg.materialize(
        [defs.current], instance=dg.DagsterInstance.ephemeral(), resources=dagster_resources()
    ).success

    rows = history_rows(paths)
    got = [(r["sku"], r["qty"], r["note"], r["_fivetran_active"]) for r in rows]
    assert got == [("a", 1, None, True), ("a", 3, "x", True), ("b", 2, None, False)]
    assert [r["_fivetran_id"] for r in rows] == [
        row_id(sku="a", qty=1),
        row_id(sku="a", qty=3, note="x"),
        row_id(sku="b", qty=2),
    ]
    assert rows[0]["_fivetran_start"] == H0 + timedelta(minutes=1)  # the duplicates opened none
    assert rows[2]["_fivetran_end"] == H1 + timedelta(minutes=3)  # closed by its delete
    assert table_key.recorded_key(Table.open(paths.history)) == ["_fivetran_id"]

    outcomes = invariants.run_checks(spark, paths, ["_fivetran_id"])
    assert all(o.passed for o in outcomes), [o.name for o in outcomes if not o.passed]
    assert any(o.name == "matches_change_log" for o in outcomes)

    current = DeltaTable(paths.current.uri).to_pyarrow_table()
    assert sorted(current.column("_fivetran_id").to_pylist()) == sorted(
        [row_id(sku="a", qty=1), row_id(sku="a", qty=3, note="x")]
    )


def test_a_row_marking_cells_unmodified_is_set_aside_naming_it(spark, tmp_path):
    platform = config_file(tmp_path)
    paths = TablePaths.of(platform.warehouse_root, "t")
    rows = [
        item("INSERT", 1, H0 + timedelta(minutes=1), "a", 1, _cdc_unmodified=None),
        item("UPDATE", 2, H0 + timedelta(minutes=2), "a", None, _cdc_unmodified=["qty"]),
    ]
    write_parquet_events(platform.landing_path, "t", H0, rows, name="partial.parquet")
    assert materialize_asset(platform, H0).success
    (entry,) = DeltaTable(paths.quarantine.uri).to_pyarrow_table().to_pylist()
    assert entry["file"].endswith("partial.parquet") and entry["row"] == 2
    assert "keyless table's row is identified by all its values" in entry["reason"]


def test_a_row_with_no_data_and_a_widening_file(spark, tmp_path):
    """A file of change columns only is rows of no data (one id); a file that would widen a
    column is set aside saying a keyless table never widens."""
    platform = config_file(tmp_path)
    table, paths = platform.table("t"), TablePaths.of(platform.warehouse_root, "t")
    bare = {k: v for k, v in item("INSERT", 1, H0, "a", 1).items() if k.startswith("cdc_")}
    write_parquet_events(platform.landing_path, "t", H0, [bare])
    materialize(spark, table, platform.landing_path, platform.warehouse_root, [H0])
    ids = DeltaTable(paths.history.uri).to_pyarrow_table().column("_fivetran_id").to_pylist()
    assert ids == [row_ids({}, 1)[0].as_py()]
    write_parquet_events(
        platform.landing_path, "t", H1, [item("INSERT", 2, H1, "a", 1)], name="narrow.parquet"
    )
    wide = item("INSERT", 3, H1 + timedelta(minutes=1), "b", None) | {"qty": "2.5"}
    write_parquet_events(platform.landing_path, "t", H1, [wide], name="wide.parquet")
    result = materialize(spark, table, platform.landing_path, platform.warehouse_root, [H1])
    (aside,) = result.quarantined
    assert aside.file.endswith("wide.parquet") and "never widen" in aside.reason


def test_switching_between_keyed_and_keyless_is_refused(spark, tmp_path):
    platform = config_file(tmp_path)
    write_parquet_events(
        platform.landing_path, "t", H0, [item("INSERT", 1, H0 + timedelta(minutes=1), "a", 1)]
    )
    assert materialize_asset(platform, H0).success
    keyed = config_file(tmp_path, "primary_key: [sku]")
    result = materialize_asset(keyed, H0)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    message = failure.event_specific_data.error.message  # type: ignore[union-attr]
    assert "primary_key: ['sku']" in message and "keyless: true" in message


def test_resync_table_takes_identical_snapshot_rows_as_one(spark, tmp_path):
    platform = config_file(tmp_path)
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(platform.landing_path, "t", H0, FIRST_HOUR)
    assert materialize_asset(platform, H0).success
    folder = tmp_path / "snapshot"
    folder.mkdir()
    pq.write_table(pa.table({"sku": ["a", "c", "a"], "qty": [1, 5, 1]}), folder / "part-0.parquet")
    result = (
        build_definitions(platform)
        .resolve_job_def("resync_table")
        .execute_in_process(
            run_config={
                "ops": {
                    "resync": {
                        "config": {"table": "t", "snapshot": str(folder), "at": H2.isoformat()}
                    }
                }
            },
            resources=dagster_resources(),
            instance=dg.DagsterInstance.ephemeral(),
        )
    )
    assert result.success
    (mat,) = result.asset_materializations_for_node("resync")
    assert mat.metadata["keys_closed"].value == 1
    rows = history_rows(paths)
    got = [(r["sku"], r["qty"], r["_fivetran_start"], r["_fivetran_active"]) for r in rows]
    assert got == [
        ("a", 1, H0 + timedelta(minutes=1), True),  # in the snapshot: unchanged, one row
        ("b", 2, H0 + timedelta(minutes=2), False),  # absent: closed at the snapshot's time
        ("c", 5, H2, True),
    ]
    assert rows[1]["_fivetran_end"] == H2


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("keyless: true\n    primary_key: [id]", "give primary_key or keyless: true, not both"),
        ("keyless: false", "primary_key': required"),
        ("keyless: true\n    ignore_history_columns: [qty]", "new id whenever any column"),
        ("keyless: true\n    widen_types: all", "types never widen"),
        (
            'keyless: true\n    format: csv\n    unmodified_string: "~"\n    columns: {a: int}',
            "unmodified cells has no id",
        ),
    ],
)
def test_config_rules_of_a_keyless_table(tmp_path, key, message):
    with pytest.raises(ValueError, match=message):
        config_file(tmp_path, key)


# The encoding is a contract other engines recompute (docs/history-table.md): pinned.
def _sha(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(parts)).hexdigest()[:32]  # the first 128 bits


def _name(n: str) -> bytes:
    return len(n.encode()).to_bytes(4, "big") + n.encode()


def test_the_id_encoding_is_the_documented_one():
    one = row_ids(
        {
            "qty": pa.array([7], pa.int64()),
            "sku": pa.array(["é"]),
            "gone": pa.array([None], pa.string()),
        },
        1,
    )[0].as_py()
    expected = _sha(
        _name("qty") + b"i" + (7).to_bytes(8, "big", signed=True),
        _name("sku") + b"s" + (2).to_bytes(4, "big") + "é".encode(),
    )
    assert one == expected
    # Column order and absent (null) columns do not matter; every value matters.
    assert row_id(sku="é", qty=7) == one
    assert row_id(sku="é", qty=8) != one
    assert row_id(qty=-0.0) == row_id(qty=0.0)
    assert row_id(qty=float("nan")) == row_ids({"qty": pa.array([float("-nan")])}, 1)[0].as_py()
    # A string and a binary of the same bytes, an int and a float: different values.
    assert row_id(v="1") != row_id(v=b"1") and row_id(v=1) != row_id(v=1.0)
    pinned = row_ids(
        {
            "d": pa.array([Decimal("-1.50")], pa.decimal128(38, 2)),
            "t": pa.array([datetime(2024, 1, 1, tzinfo=UTC)], pa.timestamp("us", tz="UTC")),
            "day": pa.array([date(2024, 1, 2)]),
            "l": pa.array([[1, None]], pa.list_(pa.int64())),
            "s": pa.array([{"y": True, "x": None}]),
            "b": pa.array([False]),
        },
        1,
    )[0].as_py()
    assert pinned == _sha(
        _name("b") + b"b\x00",
        _name("d") + b"d\x02" + (-150).to_bytes(16, "big", signed=True),
        _name("day") + b"D" + (19724).to_bytes(4, "big", signed=True),
        _name("l") + b"l" + (2).to_bytes(4, "big") + b"\x01i" + (1).to_bytes(8, "big") + b"\x00",
        _name("s")
        + b"r"
        + (2).to_bytes(4, "big")
        + _name("x")
        + b"\x00"
        + _name("y")
        + b"\x01b\x01",
        _name("t") + b"t" + (1704067200000000).to_bytes(8, "big", signed=True),
    )


def test_ids_of_rows_without_data_or_beyond_a_datetime():
    """A row with no non-null data cell has the id of nothing; nested times out of Python's
    range hash from their counts (they are kept by keyed tables too); many rows are hashed a
    slice at a time, each as it would be alone."""
    assert row_ids({}, 2).to_pylist() == [_sha()] * 2
    far = pa.array([[10**18]], pa.list_(pa.int64())).cast(pa.list_(pa.timestamp("us", "UTC")))
    assert row_ids({"l": far}, 1)[0].as_py() == _sha(
        _name("l") + b"l" + (1).to_bytes(4, "big") + b"\x01t" + (10**18).to_bytes(8, "big")
    )
    many = row_ids({"n": pa.array(range(120_001), pa.int64())}, 120_001)
    assert len(many) == 120_001 and many[100_000].as_py() == row_id(n=100_000)
