"""Two writers on one table at once: both finish, and the table is what one writer would make.

Dagster keeps one writer per table (a pool of limit 1); these tests cover the second line of
defence: delta-rs refuses a history commit built on a stale snapshot and ``apply_pending``
recomputes against the winner and retries (a bounded number of times).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from cdc_platform.defs.jobs.skeleton import pool_name
from cdc_platform.defs.launcher import process_alive
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import CONFIG_ENV_VAR, REPO_ROOT, PlatformConfig, TableConfig
from cdc_platform.lib.history import invariants, merge
from cdc_platform.lib.history.merge import COMMIT_ATTEMPTS
from cdc_platform.lib.history.merge import write as merge_write
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, history_rows, write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
T0, T1, T2 = (h + timedelta(minutes=5) for h in (H0, H1, H2))
NAME = "conc"
TABLE = TableConfig(name=NAME, primary_key=("id",), start=H0)


def ev(op: str, seq: int, ts: datetime, id_: int, v: int | None = None) -> dict[str, Any]:
    return {
        "id": id_,
        "v": v,
        "cdc_operation_type": op,
        "cdc_change_seq": seq,
        "cdc_commit_timestamp": ts,
    }


def write_landing(landing: Path) -> None:
    """Hours 1 and 2 both change keys 1, 2 and 3; hour 2 also holds late events."""
    write_parquet_events(
        landing, NAME, H0, [ev("INSERT", 1, T0, 1, 10), ev("INSERT", 2, T0, 2, 20)]
    )
    write_parquet_events(landing, NAME, H0, [ev("INSERT", 3, T0, 3, 30)])
    write_parquet_events(
        landing,
        NAME,
        H1,
        [ev("UPDATE", 5, T1, 1, 11), ev("DELETE", 6, T1, 2), ev("UPDATE", 7, T1, 3, 31)],
    )
    write_parquet_events(
        landing,
        NAME,
        H2,
        [
            ev("UPDATE", 4, T0 + timedelta(minutes=30), 1, 15),  # late: committed before hour 1
            ev("UPDATE", 8, T2, 1, 12),
            ev("INSERT", 9, T2, 2, 21),  # re-insert after hour 1's delete
            ev("UPDATE", 10, T1 - timedelta(minutes=10), 3, 29),  # late, before hour 1's update
        ],
    )


@pytest.fixture(scope="module")
def lakes(spark, tmp_path_factory) -> dict[str, Path]:
    """``base``: hour 0 materialized; ``reference``: all three hours in one materialization."""
    base = tmp_path_factory.mktemp("conc_base")
    write_landing(base / "landing")
    materialize(spark, TABLE, base / "landing", base / "warehouse", [H0])
    reference = tmp_path_factory.mktemp("conc_reference")
    shutil.copytree(base / "landing", reference / "landing")
    materialize(spark, TABLE, reference / "landing", reference / "warehouse", [H0, H1, H2])
    return {"base": base, "reference": reference}


def run_together(
    spark, root: Path, calls: Sequence[list[datetime]]
) -> list[MaterializationOutcome]:
    """Start one thread per call, released at the same moment; re-raise any thread's error."""
    barrier = threading.Barrier(len(calls))
    results: list[MaterializationOutcome | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def work(i: int, hours: list[datetime]) -> None:
        try:
            barrier.wait(timeout=60)
            results[i] = materialize(spark, TABLE, root / "landing", root / "warehouse", hours)
        except BaseException as exc:  # re-raised by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, h)) for i, h in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a materialization did not finish"
    if errors:
        raise errors[0]
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def assert_same_table(root: Path, reference: Path) -> None:
    got = history_rows(TablePaths.of(root / "warehouse", NAME).history)
    want = history_rows(TablePaths.of(reference / "warehouse", NAME).history)
    assert got == want
    assert len(want) == 9  # the reference really has history to compare


def copy_of(lakes: dict[str, Path], tmp_path: Path) -> Path:
    dest = tmp_path / "lake"
    shutil.copytree(lakes["base"], dest)
    return dest


def test_two_hours_touching_the_same_keys_at_once(spark, lakes, tmp_path: Path) -> None:
    root = copy_of(lakes, tmp_path)
    results = run_together(spark, root, [[H1], [H2]])
    attempts = [r.merge.attempts for r in results]
    assert all(1 <= a <= COMMIT_ATTEMPTS for a in attempts)
    print(f"commit attempts per writer: {attempts}")
    assert_same_table(root, lakes["reference"])
    outcomes = invariants.run_checks(spark, TablePaths.of(root / "warehouse", NAME), ("id",))
    assert [o.name for o in outcomes if not o.passed] == []


def test_the_same_hours_twice_at_once(spark, lakes, tmp_path: Path) -> None:
    root = copy_of(lakes, tmp_path)
    results = run_together(spark, root, [[H1, H2], [H1, H2]])
    print(f"commit attempts per writer: {[r.merge.attempts for r in results]}")
    assert_same_table(root, lakes["reference"])
    # Re-running afterwards changes nothing (the watermark covers both writers' events).
    again = materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    assert again.events_new == 0 and again.merge.keys_affected == 0
    assert_same_table(root, lakes["reference"])

    # The change log holds each (key, seq) once: a writer whose change-log commit loses the race
    # dedupes against the winner's events again before it retries.
    log = DeltaTable(str(TablePaths.of(root / "warehouse", NAME).changelog)).to_pyarrow_table()
    counts = Counter(zip(log["id"].to_pylist(), log["cdc_change_seq"].to_pylist(), strict=True))
    assert sorted(k for k, n in counts.items() if n > 1) == []


def test_a_lost_commit_race_is_recomputed_and_retried(
    spark, lakes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic: another writer commits hours 1 and 2 just before this one commits hour 1."""
    root = copy_of(lakes, tmp_path)
    real_fault_point = merge.fault_point
    rival: list[MaterializationOutcome] = []
    started: list[str] = []

    def rival_commits_first(name: str) -> None:
        real_fault_point(name)
        if name == "before_history_commit" and not started:
            started.append(name)  # before the call: the rival passes this point too
            rival.append(materialize(spark, TABLE, root / "landing", root / "warehouse", [H2]))

    monkeypatch.setattr(merge_write, "fault_point", rival_commits_first)
    result = materialize(spark, TABLE, root / "landing", root / "warehouse", [H1])
    assert rival[0].merge.attempts == 1
    assert result.merge.attempts == 2
    # The retry found the rival's commit already covering this run's events: nothing to redo.
    assert result.merge.keys_affected == 0
    assert result.merge.history_version == rival[0].merge.history_version
    assert_same_table(root, lakes["reference"])
    assert_no_uncommitted_files(TablePaths.of(root / "warehouse", NAME).history)


def test_retries_are_bounded_and_leave_the_table_intact(
    spark, lakes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_of(lakes, tmp_path)
    history = TablePaths.of(root / "warehouse", NAME).history
    before = history_rows(history, drop=())
    version = DeltaTable(str(history)).version()
    real_fault_point = merge.fault_point
    lost: list[str] = []

    def always_lose(name: str) -> None:
        real_fault_point(name)
        if name == "before_history_commit":
            lost.append(name)
            raise CommitFailedError("simulated: a concurrent commit won")

    monkeypatch.setattr(merge_write, "fault_point", always_lose)
    with pytest.raises(RuntimeError, match=f"lost {COMMIT_ATTEMPTS} races in a row"):
        materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    assert len(lost) == COMMIT_ATTEMPTS
    assert DeltaTable(str(history)).version() == version
    assert history_rows(history, drop=()) == before
    assert_no_uncommitted_files(history)

    # The events were logged before the merge gave up: the next run applies them.
    monkeypatch.setattr(merge_write, "fault_point", real_fault_point)
    again = materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    assert again.events_new == 0 and again.merge.keys_affected == 3
    assert_same_table(root, lakes["reference"])


def assert_no_uncommitted_files(table: Location) -> None:
    """Every Parquet file under the table is in the snapshot or was removed by a commit."""
    table_path = table.path
    dt = DeltaTable(str(table_path))
    on_disk = {
        str(p.relative_to(table_path))
        for p in Path(table_path).rglob("*.parquet")
        if "_delta_log" not in p.parts
    }
    ever_added = {
        a["add"]["path"]
        for v in range(dt.version() + 1)
        for a in map(json.loads, (table_path / "_delta_log" / f"{v:020d}.json").open())
        if "add" in a
    }
    assert on_disk <= ever_added, on_disk - ever_added


def test_one_writer_per_table_is_configured() -> None:
    instance_yaml = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    assert instance_yaml["concurrency"]["pools"]["default_limit"] == 1
    platform = PlatformConfig(Path("/nonexistent/l"), Location.of("/nonexistent/w"), (TABLE,))
    defs = build_table_definitions(platform, TABLE)
    assert pool_name(TABLE) == f"cdc_table_{NAME}"
    assert defs.asset.op.pool == f"cdc_table_{NAME}"
    assert defs.asset.op.pools == {f"cdc_table_{NAME}"}


# --- a killed run frees its slot ---------------------------------------------------------------

KILLED = "killed"
FREE_SLOTS_AFTER_SECONDS = 1


def killed_run_home(root: Path) -> Path:
    """A DAGSTER_HOME with the shipped dagster.yaml, its slot grace shortened for the test."""
    home = root / "dagster_home"
    home.mkdir()
    settings = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    settings["run_monitoring"]["free_slots_after_run_end_seconds"] = FREE_SLOTS_AFTER_SECONDS
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings))
    return home


def monitoring_iteration(instance: dg.DagsterInstance) -> None:
    """One pass of the monitoring daemon `dagster dev` runs (run health, then slot release)."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import EmptyWorkspaceTarget
    from dagster._daemon.daemon import MonitoringDaemon

    with WorkspaceProcessContext(instance, EmptyWorkspaceTarget()) as context:
        errors = [e for e in MonitoringDaemon(interval_seconds=1).run_iteration(context) if e]
    assert errors == []


def test_shipped_instance_monitors_runs() -> None:
    instance_yaml = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    monitoring = instance_yaml["run_monitoring"]
    assert monitoring["enabled"] is True
    assert monitoring["max_resume_run_attempts"] == 0
    assert monitoring["free_slots_after_run_end_seconds"] > 0
    assert instance_yaml["run_launcher"] == {
        "module": "cdc_platform.defs.launcher",
        "class": "LocalRunLauncher",
    }


def test_kill_9_of_a_run_frees_its_slot_and_the_next_run_completes(spark, tmp_path: Path) -> None:
    """Kill -9 of a run's process group while it holds the table's pool slot;
    run monitoring marks the run failed, the slot is freed, and the next run completes."""
    started = time.monotonic()
    table = TableConfig(name=KILLED, primary_key=("id",), start=H0)
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "landing_root": str(tmp_path / "landing"),
                "warehouse_root": str(tmp_path / "warehouse"),
                "tables": [{"name": KILLED, "primary_key": ["id"], "start": "2024-01-01-00:00"}],
            }
        )
    )
    write_parquet_events(tmp_path / "landing", KILLED, H0, [ev("INSERT", 1, T0, 1, 10)])
    home = killed_run_home(tmp_path)
    pool = pool_name(table)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {"DAGSTER_HOME": str(home), CONFIG_ENV_VAR: str(config), "PYTHONPATH": str(REPO_ROOT)}
    dagster_cli = Path(sys.executable).parent / "dagster"
    command = [str(dagster_cli), "asset", "materialize", "-m", "cdc_platform.definitions"]
    command += ["--select", KILLED, "--partition", "2024-01-01-00:00"]
    log = (tmp_path / "run.log").open("w+")
    # The instance's storage is created here, before the CLI opens it: two processes creating
    # one SQLite schema at once race ("table alembic_version already exists").
    instance = dg.DagsterInstance.from_config(str(home))
    assert (
        instance.get_runs() == []
        and not instance.event_log_storage.get_concurrency_info(pool).claimed_slots
    )
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not instance.event_log_storage.get_concurrency_info(pool).claimed_slots:
            assert proc.poll() is None, "the run ended before it claimed its slot"
            assert time.monotonic() < deadline, "the run never claimed its pool slot"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # the run worker and everything it started
        proc.wait(timeout=60)
        (run,) = instance.get_runs()
        assert run.status == dg.DagsterRunStatus.STARTED  # nobody will ever finish it...
        info = instance.event_log_storage.get_concurrency_info(pool)
        assert info.active_run_ids == {run.run_id}  # ...and it holds the slot: the leak

        monitoring_iteration(instance)
        failed = instance.get_run_by_id(run.run_id)
        assert failed is not None and failed.status == dg.DagsterRunStatus.FAILURE
        (failure,) = instance.get_records_for_run(
            run_id=run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE
        ).records
        event = failure.event_log_entry.dagster_event
        assert event is not None and "is gone" in (event.message or "")

        time.sleep(FREE_SLOTS_AFTER_SECONDS + 1)
        monitoring_iteration(instance)
        info = instance.event_log_storage.get_concurrency_info(pool)
        assert info.claimed_slots == [] and info.active_run_ids == set()

        # The next run of the table takes the slot and completes.
        platform = PlatformConfig(
            tmp_path / "landing", Location.of(tmp_path / "warehouse"), (table,)
        )
        defs = build_table_definitions(platform, table)
        result = dg.materialize(
            [defs.asset, defs.checks],
            partition_key="2024-01-01-00:00",
            instance=instance,
            resources=dagster_resources(),
        )
        assert result.success
        next_run = instance.get_run_by_id(result.run_id)
        assert next_run is not None and next_run.status == dg.DagsterRunStatus.SUCCESS
        assert [c.passed for c in result.get_asset_check_evaluations()] == [True] * len(
            invariants.CHECK_NAMES
        )
        rows = history_rows(TablePaths.of(tmp_path / "warehouse", KILLED).history)
        assert [(r["id"], r["v"], r["_fivetran_active"]) for r in rows] == [(1, 10, True)]
        assert instance.event_log_storage.get_concurrency_info(pool).claimed_slots == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        log.close()
        instance.dispose()
    print(f"kill -9 / monitor / next run: {time.monotonic() - started:.1f}s")


def test_worker_health_check(tmp_path: Path) -> None:
    """The launcher's check: a live pid is RUNNING; a gone or zombie pid is FAILED."""
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_alive(child.pid):  # a zombie until reaped: not alive
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.wait()
    assert not process_alive(child.pid)
