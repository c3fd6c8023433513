"""Late data reaches downstream partitions through a real Dagster daemon: a late file lands in
a three-day-old hour, the landing sensor applies it, and the ``cdc_restatements`` sensor
requests exactly the days of ``orders_daily`` (the demo's downstream asset) its span reaches."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
from deltalake import DeltaTable

from cdc_platform.defs.sensors.restatements import RESTATED_BY_TAG
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.demo.definitions import build_demo_definitions
from cdc_platform.lib.config import REPO_ROOT, load_config
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev

# Generous: the late hour's run starts a Spark JVM of its own on a 2-core machine.
RESTATED_SECONDS = 420
QUIET_SECONDS = 45  # more than a tick of each sensor: nothing else is requested meanwhile


def test_a_late_file_re_runs_exactly_the_downstream_days_it_restated(tmp_path: Path) -> None:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    day = [today - timedelta(days=n) for n in range(6)]  # day[3]: three days ago
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        f"  - name: orders\n    primary_key: [order_id]\n"
        f'    start: "{hour_to_partition_key(day[5])}"\n'
        "    sensor_interval_seconds: 5\n    lookback_hours: 120\n"
    )
    platform = load_config(config)
    landing = platform.landing_path
    h4, h1 = day[4] + timedelta(hours=10), day[1] + timedelta(hours=10)
    write_parquet_events(
        landing,
        "orders",
        h4,
        [
            ev("INSERT", 1, h4, 1, "order_id", amount=10.0),
            ev("INSERT", 2, h4, 2, "order_id", amount=5.0),
        ],
    )
    write_parquet_events(landing, "orders", h1, [ev("UPDATE", 3, h1, 1, "order_id", amount=30.0)])

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.get() as instance:
            _build_before(platform, instance, [h4, h1], day[5:0:-1])
        daily = TablePaths.of(platform.warehouse_root, "orders_daily").history
        before = _totals(daily.uri)
        assert before[_key(day[3])] == 15.0 and before[_key(day[1])] == 35.0

        # Three days late: an update of order 1 made while it was 10.0, at 10:00 three days ago.
        h3 = day[3] + timedelta(hours=10)
        with _daemon(tmp_path, config, home) as alive:
            write_parquet_events(
                landing, "orders", h3, [ev("UPDATE", 4, h3, 1, "order_id", amount=20.0)]
            )
            with dg.DagsterInstance.get() as instance:
                restated = {_key(d) for d in (day[3], day[2], day[1])}
                _wait(alive, instance, RESTATED_SECONDS, lambda: _succeeded(instance) == restated)
                time.sleep(QUIET_SECONDS)
                requested = [r.tags["dagster/partition"] for r in _restating_runs(instance)]
        assert sorted(requested) == sorted(restated)
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    after = _totals(daily.uri)
    # 20 + 5 on the two days the late update reached; 30 + 5 from day 1's update on.
    assert {k: after[k] for k in restated} == {
        _key(day[3]): 25.0,
        _key(day[2]): 25.0,
        _key(day[1]): 35.0,
    }
    assert after[_key(day[4])] == 15.0 and after[_key(day[5])] == 0.0  # not requested


def _build_before(
    platform, instance: dg.DagsterInstance, hours: list[datetime], days: list[datetime]
) -> None:
    """The history of the hours with files, then every past day of the downstream asset."""
    table = build_table_definitions(platform, platform.table("orders"))
    for hour in hours:
        result = dg.materialize(
            [table.asset],
            partition_key=hour_to_partition_key(hour),
            instance=instance,
            resources=dagster_resources(),
        )
        assert result.success
    daily = build_demo_definitions(platform).resolve_assets_def("orders_daily")
    for d in days:
        assert dg.materialize([daily], partition_key=_key(d), instance=instance).success


def _key(day: datetime) -> str:
    return day.strftime("%Y-%m-%d")


def _totals(uri: str) -> dict[str, float]:
    rows = DeltaTable(uri).to_pyarrow_table().to_pylist()
    return {r["day"]: r["total"] for r in rows}


def _restating_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return [r for r in instance.get_runs() if RESTATED_BY_TAG in r.tags]


def _succeeded(instance: dg.DagsterInstance) -> set[str]:
    return {
        r.tags["dagster/partition"]
        for r in _restating_runs(instance)
        if r.status == dg.DagsterRunStatus.SUCCESS
    }


def _wait(
    alive: Callable[[], None],
    instance: dg.DagsterInstance,
    seconds: float,
    done: Callable[[], bool],
) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        alive()
        runs = [
            (r.job_name, r.tags.get("dagster/partition"), r.status) for r in instance.get_runs()
        ]
        assert time.monotonic() < deadline, f"not done within {seconds}s: {runs}"
        time.sleep(2)


@contextmanager
def _daemon(tmp_path: Path, config: Path, home: Path) -> Iterator[Callable[[], None]]:
    """A ``dagster-daemon`` over the demo's code location; yields a check that it still runs
    (failing with its log's tail if not)."""
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: cdc_platform.demo.definitions\n"
        f"      working_directory: {REPO_ROOT}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {"CDC_PLATFORM_CONFIG": str(config), "DAGSTER_HOME": str(home)}
    env["PYTHONPATH"] = str(REPO_ROOT)
    log_path = tmp_path / "daemon.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(workspace)],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def alive() -> None:
            assert proc.poll() is None, log_path.read_text()[-4000:]

        try:
            yield alive
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
