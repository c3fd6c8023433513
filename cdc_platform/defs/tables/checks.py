"""A table's checks: the SCD2 invariants (docs/HISTORY_MODE.md section 6), run in Spark after
every materialization on the keys it touched, and over every table on a schedule.
"""

from collections.abc import Iterable, Sequence
from typing import Any

import dagster as dg

from cdc_platform.defs.alerts.runs import CHECKS_STEP_SUFFIX
from cdc_platform.defs.alerts.webhook import metadata_int
from cdc_platform.defs.jobs.maintenance_schedules import BACKGROUND_PRIORITY, PRIORITY_TAG
from cdc_platform.defs.resources import SparkResource
from cdc_platform.defs.tables.history import VERSION_BEFORE
from cdc_platform.defs.tags import TABLE_TAG
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history import invariants
from cdc_platform.lib.storage.warehouse import TablePaths

# Checks that warn: a failure fails no run and holds back no <table>_current (not blocking).
# A set-aside file is expected input handling (the rest of its hour is applied); it is alerted
# once per file, and the current table keeps following the history meanwhile.
WARN_CHECKS = frozenset({invariants.NO_QUARANTINE})

# The checks' scope after a run that left no file of the table from before it (a first load,
# a rebuild).
WHOLE_TABLE_WRITTEN = "whole table (no file from before this run is left)"
WHOLE_TABLE_AFTER_FAILURE = "whole table (a blocking check failed before this run)"
FULL_CHECKS_JOB = "cdc_full_table_checks"


def history_checks(platform: PlatformConfig, table: TableConfig) -> dg.AssetChecksDefinition:
    """The SCD2 invariants (docs/HISTORY_MODE.md section 6) as one multi-asset check: the run's
    keys after a materialization, the whole table after a failure or when run alone."""
    key = dg.AssetKey(table.name)
    paths = TablePaths.of(platform.warehouse_root, table.name)
    check_specs = [
        dg.AssetCheckSpec(
            name,
            asset=key,
            blocking=name not in WARN_CHECKS,
            description=invariants.DESCRIPTIONS[name],
        )
        for name in invariants.CHECK_NAMES
    ]

    blocking_keys = [dg.AssetCheckKey(key, s.name) for s in check_specs if s.blocking]

    @dg.multi_asset_check(
        specs=check_specs, name=f"{table.name}{CHECKS_STEP_SUFFIX}", can_subset=False
    )
    def history_checks(
        context: dg.AssetCheckExecutionContext, spark: SparkResource
    ) -> Iterable[dg.AssetCheckResult]:
        """Results only: the check alert sensor reads them from the instance and posts alerts."""
        materialized_here, since = _version_before_this_run(context, key)
        session = spark.session(platform.warehouse_root)
        # After a failed blocking check the whole table is checked again, until it passes: a
        # run's own keys passing says nothing of the failure elsewhere (the current table's
        # gate would open on a history that is still wrong).
        failed_before = _a_blocking_check_failed_before(context, blocking_keys)
        scope = (
            invariants.touched_keys(session, paths, table.key, since)
            if materialized_here and not failed_before
            else None
        )
        scope_label = (
            "keys touched by this run"
            if scope is not None
            else WHOLE_TABLE_AFTER_FAILURE
            if failed_before
            else WHOLE_TABLE_WRITTEN
            if materialized_here
            else "whole table"
        )
        hide_keys = table.encryption != "none"  # decrypted key values stay out of the UI
        for o in invariants.run_checks(session, paths, table.key, scope, hide_keys=hide_keys):
            if not o.passed:
                context.log.error(f"{table.name}: check {o.name} failed for {o.failing} key(s)")
            yield dg.AssetCheckResult(
                asset_key=key,
                check_name=o.name,
                passed=o.passed,
                severity=(
                    dg.AssetCheckSeverity.WARN
                    if o.name in WARN_CHECKS
                    else dg.AssetCheckSeverity.ERROR
                ),
                metadata={
                    "failing_keys": o.failing,
                    "sample": dg.MetadataValue.json(_jsonable(o.sample)),
                    "checked_keys": o.checked_keys,  # None (null) when not counted
                    "scope": scope_label,
                    **({"detail": o.detail} if o.detail else {}),
                    # the files set aside: the check alert names each once (defs.alerts.checks)
                    **(
                        {"files": dg.MetadataValue.json(list(o.files))}
                        if o.name == invariants.NO_QUARANTINE
                        else {}
                    ),
                },
            )

    return history_checks


def _version_before_this_run(
    context: dg.AssetCheckExecutionContext, key: dg.AssetKey
) -> tuple[bool, int | None]:
    """(whether this run materialized the table, its version before that; None: no table)."""
    event = context.instance.get_latest_materialization_event(key)
    if event is None or event.run_id != context.run.run_id or event.asset_materialization is None:
        return False, None
    value = event.asset_materialization.metadata.get(VERSION_BEFORE)
    return True, (
        metadata_int(value.value) if value is not None and value.value is not None else None
    )


def _a_blocking_check_failed_before(
    context: dg.AssetCheckExecutionContext, keys: Sequence[dg.AssetCheckKey]
) -> bool:
    """Whether the latest result before this run of any of ``keys`` was a failure. Completed
    executions only: every queued or running run of the table has a PLANNED record of each
    check, which would otherwise hide the failure behind it."""
    from dagster._core.storage.asset_check_execution_record import (
        COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES,
        AssetCheckExecutionRecordStatus,
    )

    storage = context.instance.event_log_storage
    for check_key in keys:
        history = storage.get_asset_check_execution_history(
            check_key, limit=2, status=COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES
        )
        earlier = [r for r in history if r.run_id != context.run.run_id]
        if earlier and earlier[0].status == AssetCheckExecutionRecordStatus.FAILED:
            return True
    return False


def _jsonable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def full_checks(
    platform: PlatformConfig, checks: Sequence[dg.AssetChecksDefinition]
) -> dg.Definitions:
    """The check job and its schedule: every invariant over every table, as one run per table
    (a failing or slow table holds no other back), each tagged with its table and below
    ingestion's priority in the run queue. No table at all (a discover: config over an empty
    landing zone): no job and no schedule, which would launch a run with nothing in it every day.
    """
    if not checks:
        return dg.Definitions()
    job = dg.define_asset_job(
        FULL_CHECKS_JOB,
        selection=dg.AssetSelection.checks(*checks),
        description="Every invariant over every history table (not just the keys a run touched).",
    )

    @dg.schedule(
        name="cdc_full_table_checks_schedule",
        job=job,
        cron_schedule=platform.check_schedule,
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Every invariant over every history table, one run per table.",
    )
    def cdc_full_table_checks_schedule(context: dg.ScheduleEvaluationContext):
        tick = context.scheduled_execution_time
        stamp = tick.isoformat() if tick is not None else "now"
        for c in checks:
            name = next(iter(c.check_keys)).asset_key.to_user_string()
            yield dg.RunRequest(
                run_key=f"{name}:{stamp}",
                asset_check_keys=list(c.check_keys),
                asset_selection=[],
                tags={TABLE_TAG: name, PRIORITY_TAG: BACKGROUND_PRIORITY},
            )

    return dg.Definitions(jobs=[job], schedules=[cdc_full_table_checks_schedule])
