"""The demo generator writes the landing layout of docs/HISTORY_MODE.md section 1 and every
edge case it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_platform.demo.generate import (
    FAX_UNTIL_HOUR,
    LOYALTY_FROM_HOUR,
    MAX_DELAY_HOURS,
    generate_landing_zone,
)
from cdc_platform.lib.landing.where.layout import all_hour_folders, hour_folder
from cdc_platform_tests.reference import TMAX, reference_history, truncate_to_ms

START = datetime(2024, 1, 1, tzinfo=UTC)
HOURS = 12
PK = {"customers": "customer_id", "orders": "order_id"}
NAME_RE = re.compile(
    r"^part-\d{5}-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\.snappy\.parquet$"
)
HOUR = timedelta(hours=1)


@dataclass
class LandedFile:
    table: str
    folder_hour: datetime
    path: Path
    schema: pa.Schema
    rows: list[dict[str, Any]]

    def commit_hours(self) -> set[datetime]:
        return {hour_of(r["cdc_commit_timestamp"]) for r in self.rows}


def hour_of(ts: datetime) -> datetime:
    return ts.replace(minute=0, second=0, microsecond=0)


def read_landing(root: Path) -> dict[str, list[LandedFile]]:
    out: dict[str, list[LandedFile]] = {}
    for table in sorted(p.name for p in root.iterdir()):
        files = []
        for hour, folder in all_hour_folders(root, table):
            for path in sorted(folder.iterdir()):
                t = pq.read_table(path)
                files.append(LandedFile(table, hour, path, t.schema, t.to_pylist()))
        out[table] = files
    return out


def distinct_events(files: list[LandedFile]) -> list[dict[str, Any]]:
    by_seq: dict[int, dict[str, Any]] = {}
    for f in files:
        for r in f.rows:
            by_seq.setdefault(r["cdc_change_seq"], r)
    return sorted(by_seq.values(), key=lambda r: r["cdc_change_seq"])


def data_of(row: dict[str, Any], table: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("cdc_") and v is not None} | {
        PK[table]: row[PK[table]]
    }


@pytest.fixture(scope="module")
def landing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    root = tmp_path_factory.mktemp("landing")
    return root, generate_landing_zone(root, seed=7, hours=HOURS, start=START)


@pytest.fixture(scope="module")
def landed(landing: tuple[Path, dict[str, int]]) -> dict[str, list[LandedFile]]:
    return read_landing(landing[0])


def test_layout_and_counts(
    landing: tuple[Path, dict[str, int]], landed: dict[str, list[LandedFile]]
) -> None:
    root, written = landing
    assert sorted(written) == ["customers", "orders"]
    assert sorted(landed) == ["customers", "orders"]
    for table, files in landed.items():
        # independent of read_landing: every file under the table's folder, as Parquet metadata
        on_disk = [p for p in (root / table).rglob("*") if p.is_file()]
        assert sum(pq.read_metadata(p).num_rows for p in on_disk) == written[table]
        assert sum(len(f.rows) for f in files) == written[table]
        assert 100 <= written[table] <= 400
        for f in files:
            assert f.path.parent == hour_folder(root, table, f.folder_hour)
            assert NAME_RE.match(f.path.name), f.path.name
            assert f.rows, f"{f.path} is empty"
        per_folder = Counter(f.folder_hour for f in files)
        assert sorted(per_folder) == [START + i * HOUR for i in range(HOURS)]
        assert set(per_folder.values()) <= {1, 2, 3}
        assert len(set(per_folder.values())) > 1, "the number of files per folder should vary"
    # No stray files anywhere in the tree.
    all_files = [p for p in root.rglob("*") if p.is_file()]
    assert len(all_files) == sum(len(files) for files in landed.values())


def test_column_types(landed: dict[str, list[LandedFile]]) -> None:
    ts = pa.timestamp("us", tz="UTC")
    expected = {
        "customers": {
            "customer_id": pa.int64(),
            "name": pa.string(),
            "email": pa.string(),
            "tier": pa.string(),
            "updated_at": ts,
            "loyalty_points": pa.int64(),
            "fax": pa.string(),
        },
        "orders": {
            "order_id": pa.int64(),
            "customer_id": pa.int64(),
            "status": pa.string(),
            "amount": pa.float64(),
            "currency": pa.string(),
        },
    }
    cdc = {
        "cdc_operation_type": pa.string(),
        "cdc_change_seq": pa.int64(),
        "cdc_commit_timestamp": ts,
    }
    for table, files in landed.items():
        types = expected[table] | cdc
        always = set(types) - {"loyalty_points", "fax"}
        for f in files:
            assert always <= set(f.schema.names), f.path
            for field in f.schema:
                assert field.type == types[field.name], (f.path, field)


def test_commit_times_and_late_delivery(landed: dict[str, list[LandedFile]]) -> None:
    for files in landed.values():
        for f in files:
            for r in f.rows:
                ts = r["cdc_commit_timestamp"]
                assert START <= ts < START + HOURS * HOUR
                assert hour_of(ts) <= f.folder_hour <= hour_of(ts) + MAX_DELAY_HOURS * HOUR
        # Whole late files (every event committed before the folder's hour) ...
        assert any(max(f.commit_hours()) < f.folder_hour for f in files)
        # ... and on-time files holding a straggler committed hours earlier.
        assert any(
            min(f.commit_hours()) <= f.folder_hour - 2 * HOUR and f.folder_hour in f.commit_hours()
            for f in files
        )


def test_seqs_unique_per_event_and_increasing_with_time(
    landed: dict[str, list[LandedFile]],
) -> None:
    for files in landed.values():
        events = distinct_events(files)
        # Same seq -> identical content (missing columns count as null).
        for f in files:
            for r in f.rows:
                first = next(e for e in events if e["cdc_change_seq"] == r["cdc_change_seq"])
                cols = set(first) | set(r)
                assert all(first.get(c) == r.get(c) for c in cols), r
        millis = [truncate_to_ms(e["cdc_commit_timestamp"]) for e in events]
        assert millis == sorted(millis)


def test_exact_duplicates_also_across_files(landed: dict[str, list[LandedFile]]) -> None:
    for files in landed.values():
        where: dict[int, list[Path]] = defaultdict(list)
        for f in files:
            for r in f.rows:
                where[r["cdc_change_seq"]].append(f.path)
        dupes = {seq: paths for seq, paths in where.items() if len(paths) > 1}
        assert dupes
        assert any(len(set(paths)) > 1 for paths in dupes.values())


def test_several_events_of_one_key_in_one_millisecond(landed: dict[str, list[LandedFile]]) -> None:
    for table, files in landed.items():
        groups: dict[tuple[int, datetime], list[dict[str, Any]]] = defaultdict(list)
        for e in distinct_events(files):
            groups[(e[PK[table]], truncate_to_ms(e["cdc_commit_timestamp"]))].append(e)
        multi = [g for g in groups.values() if len(g) > 1]
        assert multi
        # An insert (or update) followed by a delete in one millisecond.
        assert any(
            g[-1]["cdc_operation_type"] == "DELETE"
            and any(e["cdc_operation_type"] != "DELETE" for e in g)
            for g in multi
        )
    # orders: in one millisecond, the later seq has the smaller microsecond.
    groups = defaultdict(list)
    for e in distinct_events(landed["orders"]):
        groups[(e["order_id"], truncate_to_ms(e["cdc_commit_timestamp"]))].append(e)
    assert any(
        len(g) > 1 and g[-1]["cdc_commit_timestamp"] < g[0]["cdc_commit_timestamp"]
        for g in groups.values()
    )


def test_update_first_and_unseen_deletes(landed: dict[str, list[LandedFile]]) -> None:
    for table, files in landed.items():
        by_key: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in distinct_events(files):
            by_key[e[PK[table]]].append(e)
        assert any(es[0]["cdc_operation_type"] == "UPDATE" for es in by_key.values())
        assert any(all(e["cdc_operation_type"] == "DELETE" for e in es) for es in by_key.values())
        # A delete of a key that is already deleted (customers: a double delete).
        if table == "customers":
            assert any(
                a["cdc_operation_type"] == b["cdc_operation_type"] == "DELETE"
                for es in by_key.values()
                for a, b in pairwise(es)
            )


def test_delete_rows_carry_only_the_key(landed: dict[str, list[LandedFile]]) -> None:
    for table, files in landed.items():
        deletes = [r for f in files for r in f.rows if r["cdc_operation_type"] == "DELETE"]
        assert deletes
        for r in deletes:
            assert r[PK[table]] is not None
            assert all(
                v is None for k, v in r.items() if k != PK[table] and not k.startswith("cdc_")
            )


def test_visibly_identical_events_with_new_seqs(landed: dict[str, list[LandedFile]]) -> None:
    for table, files in landed.items():
        last: dict[int, dict[str, Any]] = {}
        found = 0
        for e in distinct_events(files):
            key = e[PK[table]]
            if (
                e["cdc_operation_type"] != "DELETE"
                and key in last
                and data_of(last[key], table) == data_of(e, table)
            ):
                found += 1
            last[key] = e
        assert found, table


def test_schema_drift(landed: dict[str, list[LandedFile]]) -> None:
    files = landed["customers"]
    loyalty_from = START + LOYALTY_FROM_HOUR * HOUR
    fax_until = START + FAX_UNTIL_HOUR * HOUR
    for f in files:
        if f.folder_hour < loyalty_from:
            assert "loyalty_points" not in f.schema.names, f.path
        if f.folder_hour <= fax_until:
            assert "fax" in f.schema.names, f.path
        if min(f.commit_hours()) > fax_until:
            assert "fax" not in f.schema.names, f.path
        if min(f.commit_hours()) >= loyalty_from:
            assert "loyalty_points" in f.schema.names, f.path
    assert any("loyalty_points" in f.schema.names for f in files)
    assert any("fax" not in f.schema.names for f in files if f.folder_hour > fax_until)
    assert any(r.get("loyalty_points") is not None for f in files for r in f.rows)
    assert any(r.get("fax") is not None for f in files for r in f.rows)


def test_orders_reference_customers(landed: dict[str, list[LandedFile]]) -> None:
    customers = {r["customer_id"] for f in landed["customers"] for r in f.rows}
    for f in landed["orders"]:
        for r in f.rows:
            if r["cdc_operation_type"] != "DELETE":
                assert r["customer_id"] in customers, r


def test_reference_fold_of_demo_data(landed: dict[str, list[LandedFile]]) -> None:
    for table, files in landed.items():
        rows = [r for f in files for r in f.rows]
        history = reference_history(rows, [PK[table]])
        assert any(v["_fivetran_start"] == v["_fivetran_end"] for v in history)
        assert any(v["_fivetran_end"] == TMAX for v in history)
        assert len(history) < len(distinct_events(files))  # no-ops and deletes make no version
        shipped = [v for v in history if v.get("status") == "SHIPPED"]
        if table == "orders":
            assert shipped


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert generate_landing_zone(a, seed=3) == generate_landing_zone(b, seed=3)
    assert snapshot(a) == snapshot(b)
    generate_landing_zone(c, seed=4)
    assert sorted(snapshot(a)) != sorted(snapshot(c))


@pytest.mark.parametrize("seed", [1, 2, 99])
def test_edge_cases_for_other_seeds(tmp_path: Path, seed: int) -> None:
    written = generate_landing_zone(tmp_path, seed=seed)
    landed = read_landing(tmp_path)
    test_layout_and_counts((tmp_path, written), landed)
    test_commit_times_and_late_delivery(landed)
    test_seqs_unique_per_event_and_increasing_with_time(landed)
    test_exact_duplicates_also_across_files(landed)
    test_several_events_of_one_key_in_one_millisecond(landed)
    test_update_first_and_unseen_deletes(landed)
    test_delete_rows_carry_only_the_key(landed)
    test_visibly_identical_events_with_new_seqs(landed)
    test_schema_drift(landed)


def test_start_must_be_on_the_hour(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on the hour"):
        generate_landing_zone(tmp_path, start=START + timedelta(minutes=5))


def test_runs_as_a_module(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cdc_platform.demo.generate", str(tmp_path), "--hours", "3"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "customers" in out.stdout and "orders" in out.stdout
    assert (tmp_path / "customers" / "year=2024" / "month=01" / "day=01" / "hour=02").is_dir()
