"""The code location at 200 tables: the jobs do not grow with the table count.

Maintenance and the merge plan are one job each, like the operator jobs: the table is named in
the run config, refused with a short message when it is not one of the config's, and the job
holds that table's pool slot while it works. Each table keeps its maintenance schedule, which
launches the one job with the table in its run config. No Spark here: the Definitions are only
built, and the runs that go further than the table lookup get a Spark resource without Spark.
(``benchmarks/ui_at_scale.py`` looks at the same code location in a browser.)
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.test_utils import freeze_time
from dagster._utils.schedules import cron_string_iterator

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.jobs import skeleton
from cdc_platform.defs.jobs.maintenance_schedules import (
    FLEET_MAINTENANCE_SCHEDULE,
    MAINTENANCE_JOB,
    MAINTENANCE_OP,
    maintenance_run_config,
)
from cdc_platform.defs.jobs.registry import PLAN_JOB, PLAN_OP
from cdc_platform.defs.resources import SparkResource
from cdc_platform.defs.tags import TABLE_TAG
from cdc_platform.lib.config import PlatformConfig, load_config
from cdc_platform.lib.fleet.schedule_spread import (
    STEP_MINUTES,
    due_by,
    offset_minutes,
    spread_daily_cron,
    window_started,
)
from cdc_platform.lib.operations import maintenance
from cdc_platform_tests.helpers import dagster_resources

# The jobs the Jobs page lists, whatever the table count.
JOBS = {
    "cdc_full_table_checks",
    MAINTENANCE_JOB,
    PLAN_JOB,
    "unapply_files",
    "readmit_files",
    "truncate_table",
    "adopt_table",
    "resync_table",
    "rekey_table",
    "protect_columns",
    "erase_key",
}
POOL_OVERRIDES = {"concurrency": {"pools": {"default_limit": 1, "granularity": "op"}}}


def platform_with(tmp_path: Path, n: int) -> PlatformConfig:
    folder = tmp_path / f"tables_{n}"
    (folder / "landing").mkdir(parents=True)
    tables = "".join(
        f'  - name: t{i:03d}\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
        + ("    current_table: true\n" if i % 3 == 0 else "")
        + (f"    group: domain_{i % 10}\n" if i % 2 else "")
        for i in range(n)
    )
    config = folder / "cdc_platform.yaml"
    config.write_text(f"landing_root: landing\nwarehouse_root: warehouse\ntables:\n{tables}")
    return load_config(config)


def listed_jobs(defs: dg.Definitions) -> set[str]:
    """The jobs the UI lists: Dagster's implicit asset jobs (``__ASSET_JOB``, one
    ``__anonymous_asset_job_<sensor>`` per sensor that targets an asset) are hidden there."""
    return {j.name for j in defs.get_repository_def().get_all_jobs() if not j.name.startswith("__")}


def test_the_jobs_do_not_grow_with_the_table_count(tmp_path):
    few, many = platform_with(tmp_path, 2), platform_with(tmp_path, 200)
    assert listed_jobs(build_definitions(few)) == listed_jobs(build_definitions(many)) == JOBS

    repo = build_definitions(many).get_repository_def()
    # Each table keeps its maintenance schedule: the one job, the table in its run config.
    schedules = {s.name: s for s in repo.schedule_defs if s.name.endswith("_maintenance_schedule")}
    assert len(schedules) == 200
    starts = set()
    for table in many.tables:
        schedule = schedules[f"{table.name}_maintenance_schedule"]
        assert schedule.job_name == MAINTENANCE_JOB
        # Spread over the window after maintenance_schedule (04:30), not all at one minute.
        minute, hour, *rest = str(schedule.cron_schedule).split()
        start = int(hour) * 60 + int(minute)
        assert rest == ["*", "*", "*"] and 270 <= start < 270 + many.schedule_window_minutes
        starts.add(start)
        assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
        with dg.build_schedule_context() as context:
            data = schedule.evaluate_tick(context)
        (request,) = data.run_requests or []
        assert request.run_config == {"ops": {MAINTENANCE_OP: {"config": {"table": table.name}}}}
        assert request.tags[TABLE_TAG] == table.name
        assert request.tags["dagster/priority"] == "-1"  # after ingestion in the run queue
        dg.validate_run_config(repo.get_job(MAINTENANCE_JOB), request.run_config)
    assert len(starts) > 80  # 200 names over 120 minutes

    # The full-table checks: one run per table, its checks only, after ingestion in the queue.
    checks = repo.get_schedule_def("cdc_full_table_checks_schedule")
    with dg.build_schedule_context(
        scheduled_execution_time=datetime(2024, 1, 2, 3, tzinfo=UTC)
    ) as context:
        requests = checks.evaluate_tick(context).run_requests or []
    assert [r.tags[TABLE_TAG] for r in requests] == [t.name for t in many.tables]
    for request, table in zip(requests, many.tables, strict=True):
        assert request.asset_selection == []
        assert {k.asset_key.to_user_string() for k in request.asset_check_keys or []} == {
            table.name
        }
        assert request.tags["dagster/priority"] == "-1"
    assert len({r.run_key for r in requests}) == 200


def _launched(
    instance: dg.DagsterInstance, repo: Any, schedule: Any, tick: datetime
) -> list[dg.RunRequest]:
    """One tick of ``schedule`` at ``tick``, its runs created then, as the daemon would."""
    with freeze_time(tick):
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=tick) as ctx:
            requests = list(schedule.evaluate_tick(ctx).run_requests or [])
        for request in requests:
            instance.create_run_for_job(
                repo.get_job(MAINTENANCE_JOB), run_config=request.run_config, tags=request.tags
            )
    return requests


@pytest.mark.parametrize(
    ("cron", "window", "lead_minutes"),
    # A day-long window's ticks are 288 a day; test_a_day_long_window_... covers its edge.
    [("30 4 * * *", 120, 60), ("50 23 * * *", 45, 60)],
)
def test_a_fleet_has_one_maintenance_schedule_starting_each_table_once_a_window(
    tmp_path, cron, window, lead_minutes
):
    """``landing_sensor: fleet``: one schedule, whose ticks over two days (from the hour before
    a window, whose ticks start nobody) launch each table's maintenance once per window,
    within one step after the minute its own schedule would have had (a window crossing
    midnight too)."""
    fleet = replace(
        platform_with(tmp_path, 60),
        landing_sensor="fleet",
        maintenance_schedule=cron,
        schedule_window_minutes=window,
    )
    repo = build_definitions(fleet).get_repository_def()
    assert [s.name for s in repo.schedule_defs if "maintenance" in s.name] == [
        FLEET_MAINTENANCE_SCHEDULE
    ]
    schedule = repo.get_schedule_def(FLEET_MAINTENANCE_SCHEDULE)
    began = window_started(cron, datetime(2024, 1, 2, 12, tzinfo=UTC))
    first = began - timedelta(minutes=lead_minutes)
    started: dict[str, list[datetime]] = {t.name: [] for t in fleet.tables}
    with dg.instance_for_test() as instance:
        for tick in cron_string_iterator(first.timestamp(), str(schedule.cron_schedule), "UTC"):
            if tick >= began + timedelta(days=2):
                break
            for request in _launched(instance, repo, schedule, tick):
                assert tick >= began, f"{request.tags[TABLE_TAG]} started before its window"
                started[request.tags[TABLE_TAG]].append(tick)
                assert request.run_config == maintenance_run_config(
                    fleet.table(request.tags[TABLE_TAG])
                )
                assert request.tags["dagster/priority"] == "-1"
    for table in fleet.tables:
        own = spread_daily_cron(cron, table.name, window)
        minute, hour = (int(f) for f in own.split()[:2])
        assert len(started[table.name]) == 2, (table.name, started[table.name])
        for tick in started[table.name]:
            late = (tick.hour * 60 + tick.minute) - (hour * 60 + minute)
            assert 0 <= late % (24 * 60) < STEP_MINUTES, (table.name, own, tick)
    assert len({tick for ticks in started.values() for tick in ticks}) > 8  # spread


def test_a_day_long_window_places_every_table_before_its_last_tick():
    """Offsets past the last 5-minute tick of a 1,440-minute window would never be due."""
    name = next(n for n in (f"t{i}" for i in range(100_000)) if _raw_offset(n) >= 1436)
    assert offset_minutes(name, 1440) == 24 * 60 - STEP_MINUTES
    began = datetime(2024, 1, 2, tzinfo=UTC)
    assert due_by("0 0 * * *", name, 1440, began + timedelta(minutes=24 * 60 - STEP_MINUTES))


def _raw_offset(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % 1440


def test_the_fleet_maintenance_schedule_catches_up_the_ticks_a_stopped_daemon_missed(tmp_path):
    """Dagster runs only the newest missed tick: that tick starts every table whose minute
    has passed in the window, and the next tick none of them again."""
    fleet = replace(platform_with(tmp_path, 60), landing_sensor="fleet")
    repo = build_definitions(fleet).get_repository_def()
    schedule = repo.get_schedule_def(FLEET_MAINTENANCE_SCHEDULE)
    began = window_started(fleet.maintenance_schedule, datetime(2024, 1, 2, 12, tzinfo=UTC))
    halfway = began + timedelta(minutes=fleet.schedule_window_minutes // 2)
    with dg.instance_for_test() as instance:
        first = {r.tags[TABLE_TAG] for r in _launched(instance, repo, schedule, halfway)}
        after = [r.tags[TABLE_TAG] for r in _launched(instance, repo, schedule, halfway)]
        end = began + timedelta(minutes=fleet.schedule_window_minutes + STEP_MINUTES)
        rest = {r.tags[TABLE_TAG] for r in _launched(instance, repo, schedule, end)}
    assert 15 < len(first) < 45 and after == []  # the first half, once
    assert first | rest == {t.name for t in fleet.tables} and not first & rest


def _run(
    job: dg.JobDefinition, op: str, config: dict[str, Any], **kwargs: Any
) -> dg.ExecuteInProcessResult:
    return job.execute_in_process(
        run_config={"ops": {op: {"config": config}}}, raise_on_error=False, **kwargs
    )


def _failure(result: dg.ExecuteInProcessResult) -> str:
    (step_failure,) = [e for e in result.all_events if e.is_step_failure]
    return step_failure.event_specific_data.error.message  # type: ignore[union-attr]


def test_tables_fall_into_their_configured_asset_groups(tmp_path):
    """The asset graph shows a group as one box: at 200 tables, the config's groups keep it
    navigable; a table without one (and its current table) stays in the default group."""
    platform = platform_with(tmp_path, 200)
    graph = build_definitions(platform).resolve_asset_graph()
    groups = {key.to_user_string(): graph.get(key).group_name for key in graph.get_all_asset_keys()}
    for table in platform.tables:
        assert groups[table.name] == table.group
        assert table.group == (
            f"domain_{int(table.name[1:]) % 10}" if int(table.name[1:]) % 2 else "cdc_history"
        )
        if table.current_table:
            assert groups[f"{table.name}_current"] == table.group
    assert set(groups.values()) == {"cdc_history", *(f"domain_{d}" for d in (1, 3, 5, 7, 9))}


@pytest.mark.parametrize(
    ("job_name", "op", "extra"),
    [(MAINTENANCE_JOB, MAINTENANCE_OP, {}), (PLAN_JOB, PLAN_OP, {"first_partition": "x"})],
)
def test_an_unknown_table_is_refused_with_a_short_message(tmp_path, job_name, op, extra):
    """Refused before anything is read or waited for; among 200 tables the message names the
    closest few, not all of them; a hostile name is shown shortened and quoted."""
    defs = build_definitions(platform_with(tmp_path, 200))
    job = defs.resolve_job_def(job_name)
    resources = dagster_resources()
    result = _run(job, op, {"table": "t0077", **extra}, resources=resources)
    assert not result.success
    message = _failure(result)
    assert "no table 't0077' in the config (tables: 200 tables, closest: " in message
    assert "t077" in message and "the asset catalog lists them" in message
    assert "t150" not in message and len(message) < 2000

    hostile = "x`; " + "a" * 5000 + "\n"
    result = _run(job, op, {"table": hostile, **extra}, resources=resources)
    assert not result.success
    message = _failure(result)
    assert "no table 'x`; aaaa" in message and "a" * 200 not in message

    # With a few tables, all of them are named, as the operator jobs always did.
    few = build_definitions(platform_with(tmp_path, 2)).resolve_job_def(job_name)
    result = _run(few, op, {"table": "nope", **extra}, resources=resources)
    assert "no table 'nope' in the config (tables: t000, t001)" in _failure(result)


class NoSpark(SparkResource):
    """A Spark resource whose session is never used (the library calls are replaced)."""

    def session(self, warehouse: Any = None) -> Any:
        return None


def test_maintenance_holds_the_tables_pool_slot_and_tags_the_run(tmp_path, monkeypatch):
    """Launched for one table, the run waits for that table's pool slot (another run holds
    it: the maintenance gives up, naming it), then works holding it, tagged with the table
    and recording what it did on the table's asset."""
    platform = platform_with(tmp_path, 3)
    job = build_definitions(platform).resolve_job_def(MAINTENANCE_JOB)
    calls: list[tuple[str, list[str]]] = []
    pool = "cdc_table_t001"
    resources = {"spark": NoSpark()}
    with dg.instance_for_test(overrides=POOL_OVERRIDES) as instance:
        storage = instance.event_log_storage

        def vacuum(
            paths: Any, retention_hours: int, current_table: bool, enforce_retention_duration: bool
        ) -> list[str]:
            held = storage.get_concurrency_info(pool).claimed_slots
            calls.append((str(paths.history), [s.run_id for s in held]))
            return ["a", "b"]

        monkeypatch.setattr(maintenance, "compact", lambda table: [])
        monkeypatch.setattr(maintenance, "vacuum", vacuum)
        storage.initialize_concurrency_limit_to_default(pool)
        assert storage.claim_concurrency_slot(pool, "sensor-run", "t001", 0).is_claimed
        with monkeypatch.context() as m:
            m.setattr(skeleton, "POOL_WAIT_SECONDS", 0.5)
            m.setattr(skeleton, "_POLL_SECONDS", 0.1)
            failed = _run(
                job, MAINTENANCE_OP, {"table": "t001"}, resources=resources, instance=instance
            )
        assert not failed.success and calls == []
        assert "still being written by run(s) sensor-run" in _failure(failed)

        storage.free_concurrency_slot_for_step("sensor-run", "t001")
        ok = _run(job, MAINTENANCE_OP, {"table": "t001"}, resources=resources, instance=instance)
        assert ok.success
        assert calls == [(str(platform.warehouse_root / "t001"), [ok.run_id])]
        assert storage.get_concurrency_info(pool).claimed_slots == []
        run = instance.get_run_by_id(ok.run_id)
        assert run is not None and run.tags[TABLE_TAG] == "t001"
        (record,) = instance.fetch_observations(dg.AssetKey("t001"), limit=5).records
        assert record.asset_observation is not None
        assert record.asset_observation.metadata["vacuumed_files"].value == 2


def test_the_merge_plan_waits_for_the_tables_pool_slot(tmp_path, monkeypatch):
    """The plan's shadow links to the table's files: it reads only while nothing writes or
    VACUUMs the table. A bad partition is refused before waiting."""
    job = build_definitions(platform_with(tmp_path, 2)).resolve_job_def(PLAN_JOB)
    pool = "cdc_table_t000"
    with dg.instance_for_test(overrides=POOL_OVERRIDES) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default(pool)
        assert storage.claim_concurrency_slot(pool, "backfill", "t000", 0).is_claimed
        monkeypatch.setattr(skeleton, "POOL_WAIT_SECONDS", 0.5)
        monkeypatch.setattr(skeleton, "_POLL_SECONDS", 0.1)
        config = {"table": "t000", "first_partition": "2024-01-01-05:00"}
        kwargs: dict[str, Any] = {"resources": {"spark": NoSpark()}, "instance": instance}
        waited = _run(job, PLAN_OP, config, **kwargs)
        assert "still being written by run(s) backfill" in _failure(waited)
        bad = _run(job, PLAN_OP, {**config, "first_partition": "2024-13-01-05:00"}, **kwargs)
        assert "partitions are spelled like" in _failure(bad)
        run = instance.get_run_by_id(waited.run_id)
        assert run is not None and run.tags[TABLE_TAG] == "t000"
