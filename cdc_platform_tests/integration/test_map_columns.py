"""Map columns (docs/history-table.md, types): kept as Delta maps, compared by their entries
sorted by key, so a map whose file lists the same entries in another order is the same value:
no version (rule 2), the same ``_fivetran_id``; the checks compare them so too."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.landing.rows.row_id import row_ids
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    materialize_with_checks,
    one_table_config,
    run_operator_job,
)

H0 = datetime(2024, 1, 1, tzinfo=UTC)
MAP = pa.map_(pa.string(), pa.int64())


def config(tmp_path: Path, key: str) -> PlatformConfig:
    return one_table_config(tmp_path, key)


def land(platform: PlatformConfig, rows: list[tuple[int, list, str, int, int]]) -> None:
    """(id, map entries, operation, seq, minute) rows as one Parquet file of hour H0."""
    folder = hour_folder(platform.landing_path, "t", H0)
    folder.mkdir(parents=True, exist_ok=True)
    tbl = pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "tags": pa.array([r[1] for r in rows], MAP),
            "cdc_operation_type": [r[2] for r in rows],
            "cdc_change_seq": pa.array([r[3] for r in rows], pa.int64()),
            "cdc_commit_timestamp": pa.array(
                [H0 + timedelta(minutes=r[4]) for r in rows], pa.timestamp("us", tz="UTC")
            ),
        }
    )
    pq.write_table(tbl, folder / "part-0.parquet")


ROWS = [
    (1, [("a", 1), ("b", 2)], "INSERT", 1, 1),
    (1, [("b", 2), ("a", 1)], "UPDATE", 2, 2),  # the same map, listed in another order
    (1, [("a", 1), ("b", 3)], "UPDATE", 3, 3),  # a value changes: a new version
    (2, None, "INSERT", 4, 4),
]


def test_a_map_is_stored_and_compared_by_its_entries(spark, tmp_path):
    platform = config(tmp_path, "primary_key: [id]")
    land(platform, ROWS)
    result = materialize_with_checks(platform, "t", H0)
    evaluations = result.get_asset_check_evaluations()
    assert result.success and evaluations and all(e.passed for e in evaluations)
    paths = TablePaths.of(platform.warehouse_root, "t")
    history = DeltaTable(str(paths.history))
    assert pa.types.is_map(history.to_pyarrow_table().schema.field("tags").type)
    rows = sorted(history.to_pyarrow_table().to_pylist(), key=lambda r: r["_fivetran_start"])
    assert [(r["id"], r["tags"], r["_fivetran_active"]) for r in rows] == [
        (1, [("a", 1), ("b", 2)], False),
        (1, [("a", 1), ("b", 3)], True),
        (2, None, True),
    ]
    assert rows[1]["_cdc_changed_columns"] == ["tags"]

    # A rekey folds and compares maps too, and a rekey back keeps every cell.
    before = sorted(map(str, history.to_pyarrow_table().to_pylist()))
    for key in ("keyless: true", "primary_key: [id]"):
        rekeyed = run_operator_job(config(tmp_path, key), "rekey_table", "rekey")
        assert rekeyed.success
    after = DeltaTable(str(paths.history)).to_pyarrow_table().to_pylist()
    assert sorted(map(str, after)) == before


def test_a_keyless_map_has_one_id_whatever_the_order_of_its_entries(spark, tmp_path):
    one = pa.array([[("a", 1), ("b", 2)]], MAP)
    other = pa.array([[("b", 2), ("a", 1)]], MAP)
    assert row_ids({"tags": one}, 1) == row_ids({"tags": other}, 1)
    assert row_ids({"tags": one}, 1) != row_ids({"tags": pa.array([[("a", 1)]], MAP)}, 1)

    platform = config(tmp_path, "keyless: true")
    land(
        platform,
        [(1, e, "INSERT", s, s) for s, e in ((1, [("a", 1), ("b", 2)]), (2, [("b", 2), ("a", 1)]))],
    )
    result = materialize_with_checks(platform, "t", H0)
    assert result.success and all(e.passed for e in result.get_asset_check_evaluations())
    paths = TablePaths.of(platform.warehouse_root, "t")
    assert DeltaTable(str(paths.history)).to_pyarrow_table().num_rows == 1
