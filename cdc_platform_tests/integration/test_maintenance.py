"""VACUUM removes the files of crashed runs, keeps every committed file, and never reaches into
another table's folder."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import AddAction

from cdc_platform.lib.operations.maintenance import DEFAULT_RETENTION_HOURS, vacuum
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths

OLD = 1_000_000_000  # 2001: older than any retention


def make_table(path: Location, ids: range) -> None:
    write_deltalake(str(path), pa.table({"id": list(ids)}), mode="append")


def crashed_write(table: Location, age: float | None = OLD) -> Path:
    """What a run that died before its commit leaves: a Parquet file in its own data/<uuid>/
    folder (as delta.write_files names it), a .crc beside it, a half-written _temporary/."""
    folder = table.path / delta.DATA_DIR / uuid.uuid4().hex
    (folder / "_temporary" / "0").mkdir(parents=True)
    part = folder / f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    pq.write_table(pa.table({"id": [999]}), part)
    (folder / f".{part.name}.crc").write_bytes(b"crc")
    pq.write_table(pa.table({"id": [998]}), folder / "_temporary" / "0" / "part-00001.parquet")
    if age is not None:
        for p in [folder, *folder.rglob("*")]:
            os.utime(p, (age, age))
    return folder


def test_default_vacuum_keeps_crashed_files_full_vacuum_removes_them(tmp_path: Path) -> None:
    paths = TablePaths.of(tmp_path, "orders")
    for table_path in (paths.history, paths.changelog, paths.quarantine):
        make_table(table_path, range(3))
    leftovers = [crashed_write(paths.history), crashed_write(paths.changelog)]

    # what the README used to document: full=False only considers files the log knows
    for table_path in (paths.history, paths.changelog):
        DeltaTable(str(table_path)).vacuum(
            retention_hours=0, dry_run=False, enforce_retention_duration=False
        )
    assert all(any(p.suffix == ".parquet" for p in f.iterdir()) for f in leftovers)

    removed = vacuum(paths, retention_hours=0, enforce_retention_duration=False)
    assert not any(f.exists() for f in leftovers)
    assert {str(f) for f in leftovers} <= set(removed)
    for table_path in (paths.history, paths.changelog, paths.quarantine):
        assert sorted(delta.read_arrow(table_path)["id"].to_pylist()) == [0, 1, 2]


def test_files_younger_than_the_retention_are_kept(tmp_path: Path) -> None:
    paths = TablePaths.of(tmp_path, "orders")
    make_table(paths.history, range(3))
    in_progress = crashed_write(paths.history, age=None)  # a run writing right now
    assert vacuum(paths, retention_hours=1, enforce_retention_duration=False) == []
    assert in_progress.is_dir() and len(list(in_progress.rglob("*.parquet"))) == 2


def test_replaced_files_go_once_out_of_retention_committed_ones_stay(tmp_path: Path) -> None:
    paths = TablePaths.of(tmp_path, "orders")
    make_table(paths.history, range(3))
    write_deltalake(str(paths.history), pa.table({"id": [7]}), mode="overwrite")
    before = {f.path for f in delta.snapshot_files(delta.open_table(paths.history))}
    assert vacuum(paths, dry_run=True) == []  # within the 168 h default retention
    removed = vacuum(paths, retention_hours=0, enforce_retention_duration=False)
    assert len(removed) == 1
    assert {f.path for f in delta.snapshot_files(delta.open_table(paths.history))} == before
    assert delta.read_arrow(paths.history)["id"].to_pylist() == [7]


def test_never_touches_another_table(tmp_path: Path) -> None:
    """Tables whose names share a prefix, and every table's change log under _cdc/."""
    a, ab = TablePaths.of(tmp_path, "a"), TablePaths.of(tmp_path, "ab")
    for paths in (a, ab):
        make_table(paths.history, range(2))
        make_table(paths.changelog, range(2))
    others = [crashed_write(ab.history), crashed_write(ab.changelog)]
    vacuum(a, retention_hours=0, enforce_retention_duration=False)
    assert all(f.is_dir() for f in others)
    assert sorted(delta.read_arrow(ab.history)["id"].to_pylist()) == [0, 1]


def test_retention_below_the_tables_own_is_refused_unless_asked(tmp_path: Path) -> None:
    paths = TablePaths.of(tmp_path, "orders")
    make_table(paths.history, range(1))
    with pytest.raises(Exception, match="retention"):
        vacuum(paths, retention_hours=0)


def test_committed_files_in_segment_sub_folders_are_kept(tmp_path: Path) -> None:
    """The history table writes `data/<uuid>/<segment>/part-*.parquet`: a committed file one
    level down must never look like a crashed write's leftovers."""
    paths = TablePaths.of(tmp_path, "orders")
    make_table(paths.history, range(1))
    folder = paths.history.path / delta.DATA_DIR / uuid.uuid4().hex
    (folder / "live").mkdir(parents=True)
    part = folder / "live" / "part-00000.snappy.parquet"
    pq.write_table(pa.table({"id": [5]}), part)
    add = AddAction(
        path=part.relative_to(paths.history.path).as_posix(),
        size=part.stat().st_size,
        partition_values={},
        modification_time=int(part.stat().st_mtime * 1000),
        data_change=True,
        stats=json.dumps(delta.file_stats(pq.read_metadata(part))),
    )
    dt = delta.open_table(paths.history)
    delta.commit(dt, [add], [], delta.table_arrow_schema(dt))
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (OLD, OLD))
    vacuum(paths, retention_hours=0, enforce_retention_duration=False)
    assert part.exists()
    assert sorted(delta.read_arrow(paths.history)["id"].to_pylist()) == [0, 5]


ERASED, KEPT, ERASED_NAME = 918273645, 2, "Zelda Quux-Purged"


def parquet_cells(warehouse: Path) -> str:
    """Every cell of every Parquet data file under the warehouse (the Delta logs' checkpoints
    aside: their statistics are docs/limitations.md's)."""
    files = [p for p in sorted(warehouse.rglob("*.parquet")) if "_delta_log" not in p.parts]
    return "\n".join(repr(pq.read_table(p).to_pylist()) for p in files)


def test_a_short_retention_is_an_explicit_choice_that_purges_an_erased_key(
    spark, tmp_path: Path, keyring: Path
) -> None:
    """docs/operating.md sends the operator to ``table_maintenance`` with a short retention to
    purge the files an erasure replaced: without ``allow_short_retention`` it is refused before
    anything is removed, saying how; with it the erased key's cells leave every data file."""
    from datetime import UTC, datetime, timedelta

    from cdc_platform_tests.helpers import (
        POOLS,
        materialize_with_checks,
        one_table_config,
        run_operator_job,
        write_parquet_events,
    )
    from cdc_platform_tests.helpers import event as ev
    from cdc_platform_tests.integration.test_pii import failure_of

    platform = one_table_config(tmp_path, "primary_key: [id]\n    current_table: true")
    h0 = datetime(2024, 1, 1, tzinfo=UTC)
    events = [
        ev("INSERT", 1, h0 + timedelta(minutes=1), ERASED, name=ERASED_NAME),
        ev("INSERT", 2, h0 + timedelta(minutes=2), KEPT, name="b"),
    ]
    write_parquet_events(platform.landing_path, "t", h0, events)
    assert materialize_with_checks(platform, "t", h0).success
    erased = run_operator_job(
        platform, "erase_key", "erase", keys=[{"id": str(ERASED)}], reason="request DSR-1"
    )
    assert erased.success, failure_of(erased)
    warehouse = Path(platform.warehouse_root.uri)
    assert ERASED_NAME in parquet_cells(warehouse)  # the replaced files, until a VACUUM

    refused = run_operator_job(
        platform, "table_maintenance", "compact_and_vacuum", retention_hours=0
    )
    assert not refused.success
    assert "allow_short_retention: true" in failure_of(refused)
    assert ERASED_NAME in parquet_cells(warehouse)  # nothing was removed

    unpooled = run_operator_job(
        platform,
        "table_maintenance",
        "compact_and_vacuum",
        retention_hours=0,
        allow_short_retention=True,
    )
    assert not unpooled.success  # no slot to keep the table's runs out: refused
    assert "needs the table's concurrency pool slot" in failure_of(unpooled)
    assert ERASED_NAME in parquet_cells(warehouse)
    with dg.instance_for_test(overrides=POOLS) as instance:
        purged = run_operator_job(
            platform,
            "table_maintenance",
            "compact_and_vacuum",
            instance,
            retention_hours=0,
            allow_short_retention=True,
        )
    assert purged.success, failure_of(purged)
    cells = parquet_cells(warehouse)
    assert ERASED_NAME not in cells and str(ERASED) not in cells
    assert "'b'" in cells  # the other key's rows stay
    assert DeltaTable(str(TablePaths.of(platform.warehouse_root, "t").history)).to_pyarrow_table()[
        "id"
    ].to_pylist() == [KEPT]


def test_a_negative_retention_is_refused_whatever_is_allowed(spark, tmp_path: Path) -> None:
    from cdc_platform_tests.helpers import one_table_config, run_operator_job
    from cdc_platform_tests.integration.test_pii import failure_of

    platform = one_table_config(tmp_path, "primary_key: [id]")
    result = run_operator_job(
        platform,
        "table_maintenance",
        "compact_and_vacuum",
        retention_hours=-1,
        allow_short_retention=True,
    )
    assert not result.success and "retention_hours -1 is negative" in failure_of(result)
    assert DEFAULT_RETENTION_HOURS == 168


def test_the_command_line_vacuum_refuses_a_short_retention(capsys) -> None:
    """It holds no pool slot: a run writing meanwhile could lose its files; the job can."""
    from cdc_platform.lib.operations.maintenance import main

    with pytest.raises(SystemExit):
        main(["--retention-hours", "0"])
    assert "allow_short_retention: true" in capsys.readouterr().err
