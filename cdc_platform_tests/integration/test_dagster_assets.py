"""The asset through a real Dagster instance: the contract's examples, ranges, the CLI, crashes."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from dagster_pyspark import LazyPySparkResource
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from cdc_platform.defs.resources import SparkResource
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tags import RANGE_END_TAG, RANGE_START_TAG
from cdc_platform.lib.config import REPO_ROOT, load_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.merge import FAULT_ENV
from cdc_platform.lib.history.versions import TMAX
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.deployment import SparkDeployment
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import reference_history

MS = timedelta(milliseconds=1)
SYSTEM = ["_fivetran_start", "_fivetran_end", "_fivetran_active"]


def write_config(root: Path, tables: str) -> Path:
    path = root / "cdc_platform.yaml"
    path.write_text(
        f"landing_root: landing\nwarehouse_root: warehouse\ntables:\n{textwrap.indent(tables, '  ')}"
    )
    return path


def run_partition(
    defs, partition: str | None = None, tags: dict | None = None
) -> dg.ExecuteInProcessResult:
    result = dg.materialize(
        [defs.asset, defs.checks],
        partition_key=partition,
        tags=tags,
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
    )
    assert result.success
    evaluations = result.get_asset_check_evaluations()
    assert len(evaluations) == len(invariants.CHECK_NAMES)
    assert all(e.passed for e in evaluations), [e.check_name for e in evaluations if not e.passed]
    return result


def metadata(result: dg.ExecuteInProcessResult) -> dict:
    """The run's materialization metadata (a range run records the same for each partition)."""
    events = result.get_asset_materialization_events()
    metas = [{k: v.value for k, v in e.materialization.metadata.items()} for e in events]
    assert all(m == metas[0] for m in metas)
    return metas[0] | {"partitions_recorded": len(events)}


def test_seed_001_through_the_asset(spark, tmp_path):
    platform = load_config(
        write_config(tmp_path, '- name: abc\n  primary_key: [id]\n  start: "2020-01-01-00:00"\n')
    )
    defs = build_table_definitions(platform, platform.table("abc"))
    d1 = datetime(2020, 1, 1, tzinfo=UTC)
    d2, d3 = d1 + timedelta(days=1), d1 + timedelta(days=2)

    landing = platform.landing_path
    write_parquet_events(
        landing,
        "abc",
        d1,
        [ev("INSERT", 1, d1, "a", counter=10), ev("INSERT", 2, d1, "b", counter=20)],
    )
    write_parquet_events(
        landing,
        "abc",
        d2,
        [
            ev("UPDATE", 3, d2, "a", counter=30),
            ev("UPDATE", 4, d1, "b", counter=20),
            ev("INSERT", 5, d2, "c", counter=40),
        ],
    )
    write_parquet_events(landing, "abc", d3, [ev("DELETE", 6, d3, "b", counter=None)])
    for day in (d3, d1, d2):  # any order
        result = run_partition(defs, day.strftime("%Y-%m-%d-%H:%M"))
    meta = metadata(result)
    assert meta["files_read"] == 1 and meta["events_read"] == 3 and meta["delta_version"] >= 1
    # The last run updated `a` at d2 (its live version now ends there) and inserted `c`; the
    # update of `b` repeats its image: the valid time restated is from d2 on, no closed version.
    restated = (meta["restated_from"], meta["restated_to"], meta["restated_closed"])
    assert restated == (d2.isoformat(), TMAX.isoformat(), False)

    rows = history_rows(TablePaths.of(platform.warehouse_root, "abc").history, drop=())
    synced = {r.pop("_fivetran_synced") for r in rows}
    assert all(s is not None for s in synced)
    expected = [
        ("a", 10, d1, d2 - MS, False),
        ("a", 30, d2, TMAX, True),
        ("b", 20, d1, d3, False),
        ("c", 40, d2, TMAX, True),
    ]
    assert normalize(rows, ["id", "counter", *SYSTEM]) == normalize(
        [dict(zip(["id", "counter", *SYSTEM], e, strict=True)) for e in expected],
        ["id", "counter", *SYSTEM],
    )


def test_seed_000_update_files_through_the_asset(spark, tmp_path):
    """docs/HISTORY_MODE.md example B: unmodified cells take the previous image's values."""
    platform = load_config(
        write_config(
            tmp_path,
            textwrap.dedent(
                """\
                - name: seed000
                  primary_key: [ID]
                  start: "2024-01-01-00:00"
                  format: csv
                  null_string: "\\\\N"
                  unmodified_string: "__unmodified__"
                  columns: {ID: long, COL1: string, COL2: long}
                """
            ),
        )
    )
    defs = build_table_definitions(platform, platform.table("seed000"))
    t = {i: datetime(2024, 1, 1, i, tzinfo=UTC) for i in range(1, 6)}
    U = "__unmodified__"
    rows = [
        # The destination before the batch (seed's first table), as CDC events.
        (1, "abc", 1, "INSERT", 1, t[1]),
        (1, "pqr", 2, "UPDATE", 2, t[2]),
        (2, "mno", 3, "INSERT", 3, t[2]),
        # The update batch file: only the changed column, the rest unmodified.
        (1, "xyz", U, "UPDATE", 4, t[3]),
        (2, U, 1000, "UPDATE", 5, t[4]),
        (1, "def", U, "UPDATE", 6, t[5]),
    ]
    folder = hour_folder(platform.landing_path, "seed000", t[5])
    folder.mkdir(parents=True)
    with (folder / "update_file.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            ["cdc_change_seq", "COL2", "ID", "cdc_operation_type", "COL1", "cdc_commit_timestamp"]
        )
        for id_, c1, c2, op, seq, ts in rows:
            w.writerow([seq, c2, id_, op, c1, ts.isoformat().replace("+00:00", "Z")])
    run_partition(defs, t[5].strftime("%Y-%m-%d-%H:%M"))

    final = history_rows(TablePaths.of(platform.warehouse_root, "seed000").history)
    expected = [  # the seed's final destination table, cell by cell
        (1, "abc", 1, t[1], t[2] - MS, False),
        (1, "pqr", 2, t[2], t[3] - MS, False),
        (2, "mno", 3, t[2], t[4] - MS, False),
        (1, "def", 2, t[5], TMAX, True),
        (1, "xyz", 2, t[3], t[5] - MS, False),
        (2, "mno", 1000, t[4], TMAX, True),
    ]
    cols = ["ID", "COL1", "COL2", *SYSTEM]
    assert normalize(final, cols) == normalize(
        [dict(zip(cols, e, strict=True)) for e in expected], cols
    )


def test_range_backfill_is_one_run_and_equals_hourly_runs(spark, tmp_path):
    spec = '- name: r\n  primary_key: [id]\n  start: "2024-01-01-00:00"\n'
    h0 = datetime(2024, 1, 1, tzinfo=UTC)
    events = [
        {
            "id": i % 3,
            "v": i,
            "cdc_operation_type": "UPDATE",
            "cdc_change_seq": i,
            "cdc_commit_timestamp": h0 + timedelta(minutes=13 * i),
        }
        for i in range(12)
    ]
    tables = {}
    for mode in ("range", "hourly"):
        root = tmp_path / mode
        root.mkdir()
        platform = load_config(write_config(root, spec))
        for e in events:
            hour = e["cdc_commit_timestamp"].replace(minute=0, second=0) + timedelta(
                hours=e["v"] % 2
            )
            write_parquet_events(platform.landing_path, "r", hour, [e])
        defs = build_table_definitions(platform, platform.table("r"))
        if mode == "range":
            result = run_partition(
                defs, tags={RANGE_START_TAG: "2024-01-01-00:00", RANGE_END_TAG: "2024-01-01-03:00"}
            )
            meta = metadata(result)
            assert (
                meta["files_read"] == 12
                and meta["events_new"] == 12
                and meta["commit_attempts"] == 1
            )
            assert meta["delta_version"] == 1  # one commit for the whole range
            assert meta["partitions_recorded"] == 4
        else:
            for hour in range(4):
                run_partition(defs, f"2024-01-01-{hour:02d}:00")
        tables[mode] = history_rows(TablePaths.of(platform.warehouse_root, "r").history)
    assert tables["range"] == tables["hourly"]
    assert normalize(tables["range"], ["id", "v", *SYSTEM]) == normalize(
        reference_history(events, ["id"]), ["id", "v", *SYSTEM]
    )


def _subprocess_env(config: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {
        "CDC_PLATFORM_CONFIG": str(config),
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
    }
    return env


def test_cli_materializes_one_partition(tmp_path):
    """The README's command: `dagster asset materialize -m cdc_platform.definitions ...`."""
    config = write_config(
        tmp_path, '- name: orders\n  primary_key: [id]\n  start: "2024-01-01-00:00"\n'
    )
    platform = load_config(config)
    h5 = datetime(2024, 1, 1, 5, tzinfo=UTC)
    write_parquet_events(
        platform.landing_path,
        "orders",
        h5,
        [
            {
                "id": 1,
                "status": "new",
                "cdc_operation_type": "INSERT",
                "cdc_change_seq": 1,
                "cdc_commit_timestamp": h5,
            }
        ],
    )
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    dagster = Path(sys.executable).parent / "dagster"
    proc = subprocess.run(
        [
            str(dagster),
            "asset",
            "materialize",
            "-m",
            "cdc_platform.definitions",
            "--select",
            "orders",
            "--partition",
            "2024-01-01-05:00",
        ],
        env=_subprocess_env(config, home),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = history_rows(TablePaths.of(platform.warehouse_root, "orders").history)
    assert [(r["id"], r["status"], r["_fivetran_active"]) for r in rows] == [(1, "new", True)]
    instance = dg.DagsterInstance.from_config(str(home))
    assert instance.get_latest_materialization_event(dg.AssetKey("orders")) is not None


CRASH_SCRIPT = """
import sys
from datetime import UTC, datetime
from cdc_platform.lib.config import load_config
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.session import build_spark_session
platform = load_config(sys.argv[1])
spark = build_spark_session("local[1]", {"spark.sql.shuffle.partitions": "1"})
hour = datetime.fromisoformat(sys.argv[2])
materialize(spark, platform.table("k"), platform.landing_path, platform.warehouse_root, [hour])
print("finished")
"""


@pytest.mark.parametrize(
    "point",
    [
        # Each point starts a fresh process (cold Spark): CI runs the later point, where
        # the change log is committed and the history table is not; --run-slow runs both.
        pytest.param("after_changelog_commit", marks=pytest.mark.slow),
        "before_history_commit",
    ],
)
def test_killed_materialization_leaves_previous_version_and_rerun_converges(spark, tmp_path, point):
    config = write_config(tmp_path, '- name: k\n  primary_key: [id]\n  start: "2024-01-01-00:00"\n')
    platform = load_config(config)
    h0, h1 = datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 1, 1, 1, tzinfo=UTC)
    first = [ev("INSERT", 1, h0, 1, v="a"), ev("INSERT", 2, h0, 2, v="b")]
    second = [
        ev("UPDATE", 3, h1, 1, v="a2"),
        ev("DELETE", 4, h1, 2, v=None),
        ev("INSERT", 5, h1, 3, v="c"),
    ]
    write_parquet_events(platform.landing_path, "k", h0, first)
    write_parquet_events(platform.landing_path, "k", h1, second)
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    env = _subprocess_env(config, tmp_path)

    def materialize_in_subprocess(hour: datetime, fault: str) -> subprocess.CompletedProcess:
        args = [sys.executable, str(script), str(config), hour.isoformat()]
        return subprocess.run(
            args, env=env | {FAULT_ENV: fault}, capture_output=True, text=True, timeout=600
        )

    # Only the killed attempt needs a process of its own; the runs around it share this one's
    # Spark session, as two runs of one code server would.
    table = platform.table("k")
    materialize(spark, table, platform.landing_path, platform.warehouse_root, [h0])
    path = TablePaths.of(platform.warehouse_root, "k").history
    version, before = DeltaTable(str(path)).version(), history_rows(path, drop=())

    crashed = materialize_in_subprocess(h1, fault=point)
    assert crashed.returncode == -9 and "finished" not in crashed.stdout, crashed.stderr[-2000:]
    assert DeltaTable(str(path)).version() == version
    assert history_rows(path, drop=()) == before  # readers still see the previous table

    materialize(spark, table, platform.landing_path, platform.warehouse_root, [h1])
    cols = ["id", "v", *SYSTEM]
    assert normalize(history_rows(path), cols) == normalize(
        reference_history(first + second, ["id"]), cols
    )


def test_an_op_written_for_dagster_pyspark_gets_the_platforms_session(spark):
    """SparkResource is dagster-pyspark's LazyPySparkResource: an op typed for that resource
    runs with it and gets the platform's session (its settings, not the run's); a run config
    that tries to choose where Spark runs is refused before any session exists."""
    seen: dict[str, object] = {}

    @dg.op
    def inspect_session(pyspark: LazyPySparkResource) -> None:
        session = pyspark.spark_session
        seen["zone"] = session.conf.get("spark.sql.session.timeZone")
        seen["rows"] = session.range(4).count()

    @dg.job(resource_defs={"pyspark": SparkResource(stop_at_end_of_run=False)})
    def uses_pyspark() -> None:
        inspect_session()

    assert uses_pyspark.execute_in_process().success
    assert seen == {"zone": "UTC", "rows": 4}
    refused = uses_pyspark.execute_in_process(
        run_config={"resources": {"pyspark": {"config": {"spark_config": {"spark.master": "x"}}}}},
        raise_on_error=False,
    )
    assert not refused.success
    assert spark.range(2).count() == 2  # the suite's session is untouched


def test_a_session_opened_without_the_warehouses_store_is_refused_not_used(monkeypatch):
    """A session is built once: if an op's ``spark_session`` made this resource build it before
    a platform step asked for it with an object-store warehouse, that step is refused by name
    instead of running without the store's settings; a local warehouse needs none."""
    built: list[tuple] = []

    class Stub:
        def stop(self) -> None:
            pass

    def fake_session(self, conf=None, app_name="cdc_platform", storage=()):
        built.append(tuple(storage))
        return Stub()

    monkeypatch.setattr(SparkDeployment, "session", fake_session)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    resource = SparkResource()
    try:
        first = resource.spark_session
        assert resource.session("/local/warehouse") is first
        with pytest.raises(dg.Failure, match="without the settings of the warehouse's object"):
            resource.session("s3://bucket/warehouse")
        assert built == [()]
        fresh = SparkResource()
        fresh.session("s3://bucket/warehouse")
        assert fresh.session("s3://bucket/warehouse") is fresh.spark_session
        assert [len(b) for b in built] == [0, 1]
        # A session that was running already (a notebook's): its settings are not this
        # resource's to know, so nothing is refused on its account.
        monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: Stub()))
        reused = SparkResource()
        assert reused.session("s3://bucket/warehouse") is reused.spark_session
    finally:
        resource.stop()


def test_spark_resource_never_stops_a_session_it_did_not_start(spark, tmp_path):
    """Run teardown stops only what the resource started: the caller's session survives."""
    platform = load_config(
        write_config(tmp_path, '- name: s\n  primary_key: [id]\n  start: "2024-01-01-00:00"\n')
    )
    defs = build_table_definitions(platform, platform.table("s"))
    h0 = datetime(2024, 1, 1, tzinfo=UTC)
    write_parquet_events(platform.landing_path, "s", h0, [ev("INSERT", 1, h0, 1, v="a")])
    result = dg.materialize(
        [defs.asset],
        partition_key="2024-01-01-00:00",
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(spark=SparkResource()),  # stop_at_end_of_run=True
    )
    assert result.success
    assert spark.range(3).count() == 3  # still alive
    SparkResource().stop()  # the public stop() too: only what a SparkResource started
    assert spark.range(3).count() == 3
