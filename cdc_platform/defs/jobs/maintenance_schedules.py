"""The schedules of ``table_maintenance`` (compaction then VACUUM of one table, named in the
run config: ``defs.jobs.registry``, ``lib.operations.maintenance``).

One job for every table (the Jobs page does not grow with the table count); each table gets a
schedule, ``<table>_maintenance_schedule``, on the config's ``maintenance_schedule``, that
launches this job with the table in its run config, so a table's maintenance can be stopped
on its own. A fleet (``landing_sensor: fleet``) gets one schedule instead,
``cdc_maintenance_schedule``, that starts each table at the same spread minute: 500 schedules
make the Automation page slow and the daemon's loop long. The op holds the table's pool slot
while it works (``defs.jobs.skeleton``), so it never overlaps a materialization or an operator job of the same table. What it did is
recorded as an observation of the table's asset (files and bytes before and after), visible
on the asset's page beside its materializations.

A retention below Delta's default (168 hours) is an explicit choice, ``allow_short_retention``,
checked before the op waits for the slot (``MaintenanceConfig.request``). It is safe here because the
slot keeps the table's own runs from writing meanwhile (files younger than the retention are a
writer's files in flight); it shortens time travel to that many hours.
"""

from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg

from cdc_platform.defs.tags import TABLE_TAG
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.fleet.schedule_spread import (
    due_by,
    spread_daily_cron,
    window_cron,
    window_started,
)

MAINTENANCE_JOB = "table_maintenance"
# Dagster's own tag on a scheduled run (dagster._core.storage.tags): spelled out, not imported
# from a private module.
SCHEDULE_NAME_TAG = "dagster/schedule_name"
# The run queue starts higher priorities first (Dagster's tag): ingestion runs carry none (0),
# maintenance and full-table checks come after them.
PRIORITY_TAG = "dagster/priority"
BACKGROUND_PRIORITY = "-1"
MAINTENANCE_OP = "compact_and_vacuum"
FLEET_MAINTENANCE_SCHEDULE = "cdc_maintenance_schedule"


def maintenance_schedule_name(platform: PlatformConfig, table: TableConfig) -> str:
    if platform.landing_sensor == "fleet":
        return FLEET_MAINTENANCE_SCHEDULE
    return f"{table.name}_maintenance_schedule"


def maintenance_run_config(table: TableConfig) -> dict[str, Any]:
    """The run config of a table's scheduled maintenance (the Launchpad takes the same)."""
    return {"ops": {MAINTENANCE_OP: {"config": {"table": table.name}}}}


def build_maintenance_schedules(
    platform: PlatformConfig, job: dg.JobDefinition
) -> list[dg.ScheduleDefinition]:
    """One schedule per table on the config's ``maintenance_schedule``, moved by a per-table
    offset within ``schedule_window_minutes`` (``lib.fleet.schedule_spread``): each launches ``job``
    for its table (tagged with it, below ingestion's priority in the run queue), and can be
    stopped on its own. A fleet: one schedule for all of them (``_fleet_schedule``)."""
    if platform.landing_sensor == "fleet":
        return [_fleet_schedule(platform, job)] if platform.tables else []
    return [
        dg.ScheduleDefinition(
            name=maintenance_schedule_name(platform, t),
            job=job,
            cron_schedule=spread_daily_cron(
                platform.maintenance_schedule, t.name, platform.schedule_window_minutes
            ),
            execution_timezone="UTC",
            run_config=maintenance_run_config(t),
            tags=_run_tags(t),
            description=f"Compaction and VACUUM of {t.name} ({MAINTENANCE_JOB}).",
            default_status=dg.DefaultScheduleStatus.RUNNING,
        )
        for t in platform.tables
    ]


def _run_tags(table: TableConfig) -> dict[str, str]:
    return {TABLE_TAG: table.name, PRIORITY_TAG: BACKGROUND_PRIORITY}


def _fleet_schedule(platform: PlatformConfig, job: dg.JobDefinition) -> dg.ScheduleDefinition:
    """Every table's maintenance from one schedule, the run a per-table schedule would have
    launched (same run config and tags, one run per table and window). Each tick starts the
    tables whose spread minute has come and that this window has not started yet (one query
    of the runs since it began): Dagster runs only the newest of the ticks a stopped daemon
    missed, and their tables would otherwise wait a day."""
    cron, window = platform.maintenance_schedule, platform.schedule_window_minutes

    @dg.schedule(
        name=FLEET_MAINTENANCE_SCHEDULE,
        job=job,
        cron_schedule=window_cron(cron, window),
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Compaction and VACUUM of each of the {len(platform.tables)} tables "
        f"({MAINTENANCE_JOB}), spread over {window} min from {cron}.",
    )
    def cdc_maintenance_schedule(context: dg.ScheduleEvaluationContext):
        tick = context.scheduled_execution_time.astimezone(UTC)
        due = [t for t in platform.tables if due_by(cron, t.name, window, tick)]
        began = window_started(cron, tick)
        if due:  # the ticks before the window's start ask the run storage nothing
            started = _started_since(context.instance, began)
            due = [t for t in due if t.name not in started]
        if not due:
            return dg.SkipReason(f"no table's maintenance is due at {tick:%H:%M}")
        return [
            dg.RunRequest(
                run_key=f"{t.name}:{began.isoformat()}",
                run_config=maintenance_run_config(t),
                tags=_run_tags(t),
            )
            for t in due
        ]

    return cdc_maintenance_schedule


def _started_since(instance: dg.DagsterInstance, began: datetime) -> set[str]:
    """The tables this schedule launched a run for since ``began``."""
    runs = instance.get_runs(
        filters=dg.RunsFilter(
            job_name=MAINTENANCE_JOB,
            tags={SCHEDULE_NAME_TAG: FLEET_MAINTENANCE_SCHEDULE},
            # Dagster compares strictly (created > after): a run of the window's first tick
            # can be created in its very second.
            created_after=began - timedelta(seconds=1),
        )
    )
    return {run.tags[TABLE_TAG] for run in runs if TABLE_TAG in run.tags}
