"""Folder shapes no exporter writes (deep trees, files where folders belong, names that
are no hour): the walk, the sensor, discovery and the asset never raise out of them; they are set
aside with a reason and the rest of the hour is applied."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from cdc_platform.lib.fleet import sensor_cursor
from cdc_platform.lib.landing import discovery
from cdc_platform.lib.landing.where.layout import (
    BAD_NAME,
    IN_SUBFOLDER,
    all_hour_folders,
    files_in_hour,
    fingerprint,
    hour_folder,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events
from cdc_platform_tests.security.hostile_files import (
    H5,
    TABLE,
    TS,
    logged_keys,
    materialize_through_the_asset,
    reasons,
)


def _odd_tree(landing: Path, table: str) -> Path:
    """One real hour plus every shape that used to raise out of the walk."""
    write_parquet_events(landing, table, H5, [ev("INSERT", 1, TS, 1, v="a")], name="ok.parquet")
    base = landing / table
    (base / "year=10000000000" / "month=01" / "day=01" / "hour=00").mkdir(parents=True)
    (base / "year=2024" / "month=99999999999999999999" / "day=01").mkdir(parents=True)
    loop = base / "year=2024" / "month=01" / "day=01" / "hour=07"
    loop.symlink_to(loop)  # a link to itself: ELOOP when followed
    (base / "year=2024" / "month=01" / "day=02").symlink_to("day=02")
    hour = hour_folder(landing, table, H5)
    (hour / os.fsdecode(b"bad-\xff\xfe.parquet")).write_bytes(b"PAR1")
    deep = hour / "nest"
    deep.mkdir()
    # ~1,000 levels below the hour folder (past Python's recursion limit), a file at the bottom.
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(1000):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("f.parquet", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd), "wb") as fh:
            fh.write(b"x")
    finally:
        os.close(fd)
    return hour


def _remove_tree(top: Path) -> None:
    """Remove a tree without recursion: Python 3.11's shutil.rmtree recurses once per level, so
    pytest's own clean-up of an old session folder dies of RecursionError on the deep tree."""
    stack = [top]
    while stack:
        below = [e.path for e in os.scandir(stack[-1]) if e.is_dir(follow_symlinks=False)]
        if below:
            stack.extend(Path(p) for p in below)
            continue
        for entry in os.scandir(stack[-1]):
            os.unlink(entry.path)
        os.rmdir(stack.pop())


@pytest.fixture
def odd_tree() -> Iterator[Callable[..., Path]]:
    """Builds the odd tree under a landing zone and removes its deep part after the test."""
    made: list[Path] = []

    def make(landing: Path, table: str = "t") -> Path:
        made.append(hour_folder(landing, table, H5) / "nest")  # first: a build cut short too
        return _odd_tree(landing, table)

    yield make
    for nest in made:
        if nest.exists():
            _remove_tree(nest)


def test_odd_folder_shapes_never_raise_out_of_the_walk_or_the_sensor(lake, odd_tree) -> None:
    odd_tree(lake["landing"])
    hours = [h for h, _ in all_hour_folders(lake["landing"], "t")]
    assert H5 in hours and all(h.year < 10000 for h in hours)
    files = files_in_hour(lake["landing"], "t", H5)
    by_reason = {f.set_aside for f in files}
    assert BAD_NAME in by_reason and IN_SUBFOLDER in by_reason
    assert len(fingerprint(files)) == 16
    # The sensor's first tick walks everything (a full sweep): it asks for the real hour.
    requests, state = sensor_cursor.evaluate(
        TABLE, lake["landing"], H5 + timedelta(hours=30), sensor_cursor.CursorState()
    )
    asked = {k for r in requests for k in r.partition_keys}
    assert H5.strftime("%Y-%m-%d-%H:00") in asked
    assert state.last_sweep_started is not None


def test_odd_folder_shapes_are_set_aside_and_the_hour_applied(spark, lake, odd_tree) -> None:
    odd_tree(lake["landing"])
    out = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H5])
    assert out.events_read == 1 and logged_keys(lake) == [1]
    got = reasons(lake)
    assert got["bad-\\xff\\xfe.parquet"] == BAD_NAME
    assert got["f.parquet"] == IN_SUBFOLDER


def test_a_new_table_folder_with_odd_shapes_is_discovered_without_raising(lake, odd_tree) -> None:
    odd_tree(lake["landing"], table="fresh")
    assert discovery.unlisted_tables(lake["landing"], []) == ["fresh"]
    found = discovery.describe(lake["landing"], "fresh")
    assert found.first_hour == H5 and "id" in dict(found.columns)


def test_odd_folder_shapes_through_the_asset_and_its_ledger(spark, tmp_path, odd_tree) -> None:
    """The asset records every listed file in the applied-files ledger: a name that is not
    UTF-8 is recorded escaped (a Delta string holds UTF-8 only), and the run succeeds."""

    from cdc_platform.lib.config import load_config
    from cdc_platform.lib.ledgers import applied_files

    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        "  - {name: t, primary_key: [id], start: '2023-12-31-05:00'}\n"
    )
    odd_tree(tmp_path / "landing")
    platform = load_config(tmp_path / "cdc_platform.yaml")
    materialize_through_the_asset(platform)
    recorded = {
        f
        for f, _, _ in applied_files.applied(
            applied_files.ledger_path(platform.warehouse_root, "t")
        )
    }
    assert "t/year=2024/month=01/day=01/hour=05/bad-\\xff\\xfe.parquet" in recorded
