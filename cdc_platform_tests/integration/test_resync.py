"""Re-sync from a snapshot: the seeds' worked tables cell by cell (no change, a change with the
source's timestamp, the exception that replaces a key's history), absent keys closed, late
events afterwards, a replay, refused snapshots, and the ``resync_table`` job."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_platform.definitions import build_definitions
from cdc_platform.lib.columns import TS_TYPE
from cdc_platform.lib.config import PlatformConfig, TableConfig, load_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.resync import (
    ResyncError,
    ResyncRequest,
    resync,
    resync_seqs,
    source_name,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import reference_history

D1, D2, D3 = (datetime(2020, 1, d, tzinfo=UTC) for d in (1, 2, 3))
R = datetime(2020, 1, 3, 6, tzinfo=UTC)  # the re-sync
TABLE = TableConfig(name="t", primary_key=("id",), start=D2)
COLUMNS = ["id", "counter", "_fivetran_start", "_fivetran_end", "_fivetran_active"]
TMAX = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
MS = timedelta(milliseconds=1)
# The seeds' table: a=10 on Jan 2, a=30 on Jan 3. Key b is live too (absent from snapshots).
CDC = [
    ev("INSERT", 1, D2, "a", counter=10),
    ev("UPDATE", 2, D3, "a", counter=30),
    ev("INSERT", 3, D2, "b", counter=5),
]


def build(spark, landing: Path, warehouse: Where) -> TablePaths:
    write_parquet_events(landing, TABLE.name, D2, CDC[::2], name="jan2.parquet")
    write_parquet_events(landing, TABLE.name, D3, CDC[1:2], name="jan3.parquet")
    materialize(spark, TABLE, landing, warehouse, [D2, D3])
    return TablePaths.of(warehouse, TABLE.name)


def snapshot(root: Path, rows: dict, name: str = "part-0.parquet") -> Path:
    folder = root / "snapshot"
    folder.mkdir(exist_ok=True)
    tbl = pa.table(rows)
    if "cdc_commit_timestamp" in rows:
        tbl = tbl.set_column(
            tbl.schema.get_field_index("cdc_commit_timestamp"),
            "cdc_commit_timestamp",
            pa.array(rows["cdc_commit_timestamp"], TS_TYPE),
        )
    pq.write_table(tbl, folder / name)
    return folder


def rows_of(paths: TablePaths) -> list[tuple]:
    return normalize(history_rows(paths.history), COLUMNS)


def snapshot_events(rows: dict, at: datetime = R) -> list[dict]:
    """What a re-sync logs for a snapshot's rows, written out from the module's rules."""
    seq = resync_seqs(at)[0]
    stamps = rows.get("cdc_commit_timestamp", [None] * len(rows["id"]))
    return [
        ev("INSERT", seq, ts or at, key, counter=c)
        for key, c, ts in zip(rows["id"], rows["counter"], stamps, strict=True)
    ]


def checks_pass(spark, paths: TablePaths) -> None:
    outcomes = invariants.run_checks(spark, paths, TABLE.key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]


def versions(paths: TablePaths) -> tuple[int | None, int | None]:
    return delta.version_or_none(paths.history), delta.version_or_none(paths.changelog)


def test_a_resync_with_no_change_keeps_every_version_and_closes_absent_keys(spark, lake):
    paths = build(spark, lake["landing"], lake["warehouse"])
    rows = {"id": ["a"], "counter": [30]}
    folder = snapshot(lake["root"], rows)
    r = resync(
        HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
        ResyncRequest(folder, (lake["root"],), R),
    )

    assert (r.files, r.rows, r.keys_closed, r.keys_replaced) == (1, 1, 1, 0)
    assert rows_of(paths) == [
        ("a", 10, D2, D3 - MS, False),
        ("a", 30, D3, TMAX, True),
        ("b", 5, D2, R, False),  # absent from the snapshot: closed at R
    ]
    delete = ev("DELETE", resync_seqs(R)[1], R, "b")
    assert rows_of(paths) == normalize(
        reference_history([*CDC, *snapshot_events(rows), delete], ["id"]), COLUMNS
    )
    log = delta.read_arrow(paths.changelog).to_pylist()
    assert {e["_cdc_source_file"] for e in log if e["cdc_change_seq"] < 0} == {
        "../snapshot/part-0.parquet",
        source_name(R),
    }
    checks_pass(spark, paths)

    seen = versions(paths)
    again = resync(
        HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
        ResyncRequest(folder, (lake["root"],), R),
    )
    assert (again.events_new, again.keys_closed) == (0, 0) and versions(paths) == seen

    # A late event of b, older than R, lands before the close.
    late = ev("UPDATE", 4, R - timedelta(hours=3), "b", counter=6)
    write_parquet_events(lake["landing"], TABLE.name, D3, [late], name="late.parquet")
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [D3])
    assert rows_of(paths) == normalize(
        reference_history([*CDC, *snapshot_events(rows), delete, late], ["id"]), COLUMNS
    )
    assert ("b", 6, R - timedelta(hours=3), R, False) in rows_of(paths)


def test_a_changed_row_starts_at_the_timestamp_the_snapshot_carries(spark, lake):
    paths = build(spark, lake["landing"], lake["warehouse"])
    rows = {
        "id": ["a", "b"],
        "counter": [40, 5],
        "cdc_commit_timestamp": [datetime(2020, 1, 3, 2, tzinfo=UTC), None],
    }
    resync(
        HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
        ResyncRequest(snapshot(lake["root"], rows), (lake["root"],), R),
    )
    # The seeds' second table, cell by cell; b is unchanged (its row has no timestamp: at R).
    assert rows_of(paths) == [
        ("a", 10, D2, D3 - MS, False),
        ("a", 30, D3, datetime(2020, 1, 3, 1, 59, 59, 999000, tzinfo=UTC), False),
        ("a", 40, datetime(2020, 1, 3, 2, tzinfo=UTC), TMAX, True),
        ("b", 5, D2, TMAX, True),
    ]
    checks_pass(spark, paths)


def test_a_row_older_than_every_version_replaces_the_keys_history(spark, lake):
    paths = build(spark, lake["landing"], lake["warehouse"])
    rows = {"id": ["a", "b"], "counter": [10, 5], "cdc_commit_timestamp": [D1, None]}
    r = resync(
        HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
        ResyncRequest(snapshot(lake["root"], rows), (lake["root"],), R),
    )
    assert r.keys_replaced == 1
    # The seeds' last table: a's previous versions are gone.
    assert rows_of(paths) == [("a", 10, D1, TMAX, True), ("b", 5, D2, TMAX, True)]
    assert {e["id"] for e in delta.read_arrow(paths.changelog).to_pylist()} == {"a", "b"}
    assert [
        e["cdc_change_seq"] for e in delta.read_arrow(paths.changelog).to_pylist() if e["id"] == "a"
    ] == [resync_seqs(R)[0]]
    checks_pass(spark, paths)
    # The old hours read again (a late file for b lands in one): a's old events stay away.
    late = ev("UPDATE", 4, datetime(2020, 1, 3, 3, tzinfo=UTC), "b", counter=6)
    write_parquet_events(lake["landing"], TABLE.name, D3, [late], name="late.parquet")
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [D2, D3])
    assert [r for r in rows_of(paths) if r[0] == "a"] == [("a", 10, D1, TMAX, True)]
    checks_pass(spark, paths)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            {"id": ["a", "b"], "counter": [1, 2], "cdc_operation_type": ["INSERT", "delete"]},
            r"part-0.parquet: row 2: cdc_operation_type is not INSERT: a snapshot holds row images",
        ),
        ({"id": ["a", None], "counter": [1, 2]}, r"part-0.parquet: row 2"),
        (
            {"id": ["a", "a"], "counter": [1, 2]},
            r"one row per key; one key is on .*part-0.parquet row 1 and .*part-0.parquet row 2$",
        ),
        ({"id": ["a"], "counter": [b"x"]}, r"neither widens"),
    ],
)
def test_a_bad_snapshot_is_refused_whole(spark, lake, rows, message):
    paths = build(spark, lake["landing"], lake["warehouse"])
    seen = versions(paths)
    folder = snapshot(lake["root"], rows)
    with pytest.raises(ResyncError, match=message):
        resync(
            HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
            ResyncRequest(folder, (lake["root"],), R),
        )
    assert versions(paths) == seen


def test_a_missing_or_empty_snapshot_folder_is_refused(spark, lake):
    with pytest.raises(ResyncError, match="no such folder"):
        resync(
            HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
            ResyncRequest(lake["root"] / "nope", (lake["root"],), R),
        )
    (lake["root"] / "empty").mkdir()
    with pytest.raises(ResyncError, match="no snapshot file"):
        resync(
            HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
            ResyncRequest(lake["root"] / "empty", (lake["root"],), R),
        )


@pytest.mark.parametrize("key", ["n", "at"])
def test_key_columns_named_like_the_checks_working_names_resync(spark, lake, key):
    """The repeated-key check counts and lists rows under working names: a key column called
    ``n`` or ``at`` neither clashes with them nor is read as them."""
    table = TableConfig(name="t", primary_key=(key,), start=D2)
    cdc = [
        ev(
            e["cdc_operation_type"],
            e["cdc_change_seq"],
            e["cdc_commit_timestamp"],
            e["id"],
            key,
            counter=e["counter"],
        )
        for e in CDC
    ]
    write_parquet_events(lake["landing"], table.name, D2, cdc[::2], name="jan2.parquet")
    write_parquet_events(lake["landing"], table.name, D3, cdc[1:2], name="jan3.parquet")
    materialize(spark, table, lake["landing"], lake["warehouse"], [D2, D3])
    paths = TablePaths.of(lake["warehouse"], table.name)
    folder = snapshot(lake["root"], {key: ["a"], "counter": [30]})
    r = resync(
        HistoryTable(spark, table, lake["warehouse"], lake["landing"]),
        ResyncRequest(folder, (lake["root"],), R),
    )
    assert (r.rows, r.keys_closed, r.keys_replaced) == (1, 1, 0)
    assert normalize(history_rows(paths.history), [key, *COLUMNS[1:]]) == [
        ("a", 10, D2, D3 - MS, False),
        ("a", 30, D3, TMAX, True),
        ("b", 5, D2, R, False),
    ]
    outcomes = invariants.run_checks(spark, paths, table.key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]

    seen = versions(paths)
    (lake["root"] / "twice").mkdir()
    twice = snapshot(lake["root"] / "twice", {key: ["c"] * 4, "counter": [1, 2, 3, 4]})
    with pytest.raises(
        ResyncError,
        match=r"one key is on .*part-0.parquet row 1 and .*part-0.parquet row 2 and "
        r".*part-0.parquet row 3 \(4 rows\)$",
    ):
        resync(
            HistoryTable(spark, table, lake["warehouse"], lake["landing"]),
            ResyncRequest(twice, (lake["root"],), R),
        )
    assert versions(paths) == seen


def job_site(spark, tmp_path: Path) -> tuple[PlatformConfig, TablePaths]:
    """A config of table ``t`` with ``snapshot`` as its snapshot root, its two days applied."""
    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\nsnapshot_roots: [snapshot]\ntables:\n"
        '  - name: t\n    primary_key: [id]\n    start: "2020-01-02-00:00"\n'
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    return platform, build(spark, platform.landing_path, platform.warehouse_root)


def resync_job(
    platform: PlatformConfig, folder: Path, raise_on_error: bool = True
) -> dg.ExecuteInProcessResult:
    """The ``resync_table`` job at R over ``folder``, in process."""
    return (
        build_definitions(platform)
        .resolve_job_def("resync_table")
        .execute_in_process(
            run_config={
                "ops": {
                    "resync": {
                        "config": {"table": "t", "snapshot": str(folder), "at": R.isoformat()}
                    }
                }
            },
            resources=dagster_resources(),
            instance=dg.DagsterInstance.ephemeral(),
            raise_on_error=raise_on_error,
        )
    )


def test_the_dagster_job_resync_table(spark, tmp_path: Path):
    platform, paths = job_site(spark, tmp_path)
    folder = snapshot(tmp_path, {"id": ["a"], "counter": [30]})
    result = resync_job(platform, folder)
    assert result.success
    (mat,) = result.asset_materializations_for_node("resync")
    assert mat.partition == "2020-01-03-06:00"
    assert (mat.metadata["rows"].value, mat.metadata["keys_closed"].value) == (1, 1)
    passed = mat.metadata["checks_passed"].value
    assert isinstance(passed, list) and len(passed) == len(invariants.CHECK_NAMES)
    assert ("b", 5, D2, R, False) in rows_of(paths)


def _symlinked_file(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder.parent / "elsewhere.parquet").write_bytes((folder / "part-0.parquet").read_bytes())
    (folder / "part-1.parquet").symlink_to(folder.parent / "elsewhere.parquet")


def _symlinked_folder(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (folder.parent / "more").mkdir()
    (folder / "more").symlink_to(folder.parent / "more")


def _special_file(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(folder / "part-1.parquet")


def _unlistable_folder(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root no permission stops a listing, so the listing's failure is injected."""
    (folder / "more").mkdir()
    real = os.scandir

    def scandir(path):
        if os.path.basename(path) == "more":
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr("cdc_platform.lib.landing.where.zone.os.scandir", scandir)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_symlinked_file, r"part-1.parquet: a symbolic link"),
        (_symlinked_folder, r"more: a symbolic link"),
        (_special_file, r"part-1.parquet: not a regular file"),
        (_unlistable_folder, r"more: cannot be listed \(Permission denied\)"),
    ],
)
def test_a_snapshot_entry_that_is_not_a_data_file_refuses_the_whole_resync(
    spark, lake, monkeypatch, make, message
):
    """A re-sync closes every key its snapshot lacks: an entry it cannot read as a data file
    (a link, a special file, a folder it cannot list) would close that entry's keys, so the
    whole re-sync is refused, naming it, and nothing is written."""
    paths = build(spark, lake["landing"], lake["warehouse"])
    seen = versions(paths)
    folder = snapshot(lake["root"], {"id": ["a"], "counter": [30]})
    make(folder, monkeypatch)
    with pytest.raises(ResyncError, match=message + r"; the snapshot is read whole"):
        resync(
            HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
            ResyncRequest(folder, (lake["root"],), R),
        )
    assert versions(paths) == seen


def test_the_resync_table_job_refuses_a_snapshot_with_a_symlinked_file(spark, tmp_path: Path):
    """Through the job: a snapshot of two files whose second is a symlink fails the run and
    closes no key (the second file's key ``b`` stays live)."""
    platform, paths = job_site(spark, tmp_path)
    before = rows_of(paths)
    folder = snapshot(tmp_path, {"id": ["a"], "counter": [30]})
    pq.write_table(pa.table({"id": ["b"], "counter": [5]}), tmp_path / "b.parquet")
    (folder / "part-1.parquet").symlink_to(tmp_path / "b.parquet")
    result = resync_job(platform, folder, raise_on_error=False)
    assert not result.success
    (failure,) = result.get_step_failure_events()
    assert "part-1.parquet: a symbolic link" in str(failure.step_failure_data.error)
    assert rows_of(paths) == before
