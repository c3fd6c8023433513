"""One factory: a table's config in, its asset, checks and landing sensor out.

The asset is an hourly time-partitioned history table; a materialization (one partition or a
whole range, in one run) calls the pure pipeline. The checks are the SCD2 invariants, run in
Spark after every materialization on the keys it touched, and over everything on a schedule.

With ``current_table: true`` a table also gets ``<table>_current``: an unpartitioned asset
downstream of the history asset holding its active rows (SCD1), which the
``cdc_current_tables`` automation sensor refreshes after each history materialization.

With a ``discover:`` template in the config, every unlisted plain-Parquet table folder of the
landing zone gets the same definitions (``lib.landing.discovery``, read when the code location loads);
the ``cdc_new_tables`` sensor reports every unlisted folder (``defs.discovery``).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg

from cdc_platform.defs.alerts import ALERT_RESOURCE_KEY, alert_webhook_from_env, metadata_int
from cdc_platform.defs.check_alerts import build_check_failure_alert_sensor
from cdc_platform.defs.discovery import build_new_tables_sensor
from cdc_platform.defs.fleet import build_fleet_landing_sensor
from cdc_platform.defs.lifecycle import build_lifecycle_jobs
from cdc_platform.defs.maintenance import (
    BACKGROUND_PRIORITY,
    PRIORITY_TAG,
    build_maintenance_job,
    build_maintenance_schedules,
    maintenance_schedule_name,
)
from cdc_platform.defs.operations import pool_name, refused
from cdc_platform.defs.plans import build_plan_job
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.defs.revocations import build_revocation_jobs
from cdc_platform.defs.run_alerts import CHECKS_STEP_SUFFIX, build_run_failure_alert_sensor
from cdc_platform.defs.sensors import TABLE_TAG, build_landing_sensor
from cdc_platform.defs.source_alerts import build_source_alert_sensor
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history import current_table, invariants
from cdc_platform.lib.history.protected_columns import ProtectedColumnsChangedError
from cdc_platform.lib.history.table_key import PrimaryKeyChangedError
from cdc_platform.lib.landing.discovery import with_discovered_tables
from cdc_platform.lib.landing.decoding.keyring import KeyringError
from cdc_platform.lib.landing.where.layout import hours_between
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize, needs_keyring
from cdc_platform.lib.storage.warehouse import TablePaths, current_table_name

if TYPE_CHECKING:  # what define_asset_job returns (not exported by name)
    from dagster._core.definitions.unresolved_asset_job_definition import (
        UnresolvedAssetJobDefinition,
    )

VERSION_BEFORE = "delta_version_before"
# Checks that warn: a failure fails no run and holds back no <table>_current (not blocking).
# A set-aside file is expected input handling (the rest of its hour is applied); it is alerted
# once per file, and the current table keeps following the history meanwhile.
WARN_CHECKS = frozenset({invariants.NO_QUARANTINE})
CURRENT_TABLES_SENSOR = "cdc_current_tables"


@dataclass(frozen=True)
class TableDefinitions:
    asset: dg.AssetsDefinition
    checks: dg.AssetChecksDefinition
    sensor: dg.SensorDefinition | None  # None with `landing_sensor: fleet` (defs.fleet)
    current: dg.AssetsDefinition | None = None  # `<table>_current`, if the config asks for it


# The checks' scope after a run that left no file of the table from before it (a first load,
# a rebuild).
WHOLE_TABLE_WRITTEN = "whole table (no file from before this run is left)"
WHOLE_TABLE_AFTER_FAILURE = "whole table (a blocking check failed before this run)"


def build_table_definitions(platform: PlatformConfig, table: TableConfig) -> TableDefinitions:
    key = dg.AssetKey(table.name)
    paths = TablePaths.of(platform.warehouse_root, table.name)
    history_table = _history_asset(platform, table, key, paths)
    history_checks = _history_checks(platform, table, key, paths)
    sensor = (
        build_landing_sensor(
            table, platform.landing_root, history_table, warehouse_root=platform.warehouse_root
        )
        if platform.landing_sensor == "per_table"
        else None
    )
    current = build_current_table_asset(platform, table) if table.current_table else None
    return TableDefinitions(history_table, history_checks, sensor, current)


def _history_asset(
    platform: PlatformConfig, table: TableConfig, key: dg.AssetKey, paths: TablePaths
) -> dg.AssetsDefinition:
    """The table's history asset: an hour range materialized in one run (``materialize``)."""
    partitions = dg.HourlyPartitionsDefinition(start_date=table.start_partition_key, timezone="UTC")

    @dg.multi_asset(
        name=table.name,
        specs=[
            dg.AssetSpec(
                key,
                partitions_def=partitions,
                group_name=table.group,
                kinds={"spark", "delta"},
                # What tells 200 tables apart comes first: the catalog shows one line of it.
                description=(
                    f"History (SCD2) of {table.name}, {_keyed_by(table)}: "
                    f"Delta table `{paths.history}`, built from the CDC files in "
                    f"`{platform.landing_root / table.name}`."
                ),
                metadata={
                    "primary_key": list(table.key),
                    "table_path": dg.MetadataValue.path(str(paths.history)),
                    # The asset page cannot link an op job's schedule: name it here.
                    "maintenance_schedule": maintenance_schedule_name(platform, table),
                },
                freshness_policy=freshness_policy(table),
            )
        ],
        backfill_policy=dg.BackfillPolicy.single_run(),
        pool=pool_name(table),
    )
    def history_table(
        context: dg.AssetExecutionContext, spark: SparkResource, keyring: KeyringResource
    ) -> dg.MaterializeResult:
        window = context.partition_time_window
        hours = list(hours_between(window.start, window.end - timedelta(hours=1)))
        context.log.info(
            f"{table.name}: applying {len(hours)} hour folder(s) {context.partition_key_range}"
        )
        # Records the files it applied too (``lib.ledgers.applied_files``): a file that lands later
        # is picked up by the sensor as usual.
        # The config's key, hashed or blocked columns are not the table's; no salt to hash.
        with refused(PrimaryKeyChangedError, ProtectedColumnsChangedError, KeyringError):
            result = materialize(
                spark.session(platform.warehouse_root),
                table,
                platform.landing_root,
                platform.warehouse_root,
                hours,
                keyring.load() if needs_keyring(table, platform.warehouse_root) else None,
                run_id=context.run.run_id,
            )
        for q in result.quarantined:
            context.log.warning(f"{table.name}: set aside {q.file}: {q.reason}")
        for f in result.revoked:
            context.log.warning(f"{table.name}: not read, un-applied (readmit_files): {f}")
        return dg.MaterializeResult(metadata=materialization_metadata(result))

    return history_table


def _history_checks(
    platform: PlatformConfig, table: TableConfig, key: dg.AssetKey, paths: TablePaths
) -> dg.AssetChecksDefinition:
    """The SCD2 invariants (docs/HISTORY_MODE.md section 6) as one multi-asset check: the run's
    keys after a materialization, the whole table after a failure or when run alone."""
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
                    # the files set aside: the check alert names each once (defs.check_alerts)
                    **(
                        {"files": dg.MetadataValue.json(list(o.files))}
                        if o.name == invariants.NO_QUARANTINE
                        else {}
                    ),
                },
            )

    return history_checks


def freshness_policy(table: TableConfig) -> dg.FreshnessPolicy | None:
    """The source's expected cadence as Dagster freshness (the daemon evaluates it): a table
    with no materialization for ``expected_delivery_hours`` warns, for twice as long fails. A
    source that stopped delivering looks like a quiet table otherwise."""
    if table.expected_delivery_hours is None:
        return None
    hours = timedelta(hours=table.expected_delivery_hours)
    return dg.FreshnessPolicy.time_window(fail_window=2 * hours, warn_window=hours)


def current_table_condition() -> dg.AutomationCondition:
    """Eager, except that it waits only for the history table to exist, and never refreshes
    from a history whose latest blocking checks failed (readers keep its last good state).

    ``AutomationCondition.eager()`` holds back while *any* upstream partition is missing; an
    unpartitioned asset depends on every hourly partition of the history asset, most of which
    (hours with no files) are never materialized, so eager would never run it.
    """
    return (
        dg.AutomationCondition.in_latest_time_window()
        & (
            dg.AutomationCondition.newly_missing() | dg.AutomationCondition.any_deps_updated()
        ).since_last_handled()
        & dg.AutomationCondition.any_deps_match(~dg.AutomationCondition.missing()).with_label(
            "history_table_exists"
        )
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
        & dg.AutomationCondition.all_deps_blocking_checks_passed()
    ).with_label("eager_after_history")


def build_current_table_asset(platform: PlatformConfig, table: TableConfig) -> dg.AssetsDefinition:
    """``<table>_current``: the history table's active rows, rewritten whole on each refresh."""
    paths = TablePaths.of(platform.warehouse_root, table.name)

    @dg.asset(
        key=dg.AssetKey(current_table_name(table.name)),
        deps=[dg.AssetKey(table.name)],
        group_name=table.group,
        kinds={"spark", "delta"},
        description=(
            f"Current (SCD1) rows of {table.name}, one per live key (key and data columns "
            f"only), refreshed after the history table: Delta table `{paths.current}`."
        ),
        metadata={
            "primary_key": list(table.key),
            "table_path": dg.MetadataValue.path(str(paths.current)),
        },
        automation_condition=current_table_condition(),
        pool=pool_name(table),
    )
    def current_rows(
        context: dg.AssetExecutionContext, spark: SparkResource
    ) -> dg.MaterializeResult:
        result = current_table.refresh(spark.session(platform.warehouse_root), paths, table.key)
        context.log.info(
            f"{table.name}: current table has {result.rows} row(s) "
            f"(history version {result.history_version})"
        )
        return dg.MaterializeResult(
            metadata={
                # Dagster's standard row-count key (the UI charts it across materializations)
                "dagster/row_count": result.rows,
                "delta_version": result.version,
                "history_version": result.history_version,
                "files_added": result.files_added,
                "files_removed": result.files_removed,
                "commit_attempts": result.attempts,
            }
        )

    return current_rows


def materialization_metadata(result: MaterializationOutcome) -> dict[str, Any]:
    m = result.merge
    # The run's cost as flat numeric entries (``cost/seconds/<stage>``, ``cost/spark_jobs/...``,
    # ``cost/bytes_read/<table>``, ``cost/bytes_rewritten/<table>``, ``cost/commits/<table>``):
    # the UI plots each over the table's materializations. Over Spark Connect the job counts
    # are absent (this process has no SparkContext to count them), and a note says so.
    cost: dict[str, Any] = {}
    if result.cost is not None:
        cost = {
            f"cost/{name}": dg.MetadataValue.float(float(v))
            if name.startswith("seconds/")
            else dg.MetadataValue.int(int(v))
            for name, v in result.cost.figures().items()
        }
        if result.cost.spark_jobs is None:
            cost["cost/spark_jobs_note"] = "not counted over Spark Connect (no SparkContext here)"
    quarantined = [
        {"file": q.file, "partition": q.partition, "row": q.row, "reason": q.reason}
        for q in result.quarantined
    ]
    return {
        "files_read": result.files_read,
        "events_read": result.events_read,
        "events_new": result.events_new,
        "files_quarantined": len(result.quarantined),
        "quarantined": dg.MetadataValue.json(quarantined),
        "keys_affected": m.keys_affected,
        "versions_opened": m.versions_opened,
        "versions_closed": m.versions_closed,
        "rows_written": m.rows_written,
        "files_added": m.files_added,
        "files_removed": m.files_removed,
        # None (a null metadata value) when there is no such version (nothing committed yet).
        "delta_version": m.history_version,
        VERSION_BEFORE: result.history_version_before,
        "changelog_version": m.changelog_version,
        "commit_attempts": m.attempts,
        "seconds": result.seconds,
        "files_read_natively": len(result.read_natively),
        "files_revoked_skipped": dg.MetadataValue.json(list(result.revoked)),
        "synced_at": result.synced_at.isoformat(),
        **cost,
    }


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


def full_checks_schedule(
    platform: PlatformConfig,
    job: "dg.JobDefinition | UnresolvedAssetJobDefinition",
    tables: Sequence[TableDefinitions],
) -> dg.ScheduleDefinition:
    """Every invariant over every table, as one run per table (a failing or slow table holds no
    other back), each tagged with its table and below ingestion's priority in the run queue."""

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
        for t in tables:
            name = t.asset.key.to_user_string()
            yield dg.RunRequest(
                run_key=f"{name}:{stamp}",
                asset_check_keys=list(t.checks.check_keys),
                asset_selection=[],
                tags={TABLE_TAG: name, PRIORITY_TAG: BACKGROUND_PRIORITY},
            )

    return cdc_full_table_checks_schedule


def _landing_sensors(
    platform: PlatformConfig, tables: Sequence[TableDefinitions]
) -> list[dg.SensorDefinition]:
    """A sensor per table, or (``landing_sensor: fleet``) one sensor for all of them."""
    if platform.landing_sensor == "per_table":
        return [t.sensor for t in tables if t.sensor is not None]
    if not tables:
        return []
    assets = {t.asset.key.to_user_string(): t.asset for t in tables}
    return [
        build_fleet_landing_sensor(
            platform.tables,
            platform.landing_root,
            platform.warehouse_root,
            assets,
            platform.tables_per_run,
        )
    ]


def build_definitions(platform: PlatformConfig) -> dg.Definitions:
    """Everything the code location serves, for every table in the config, plus (with a
    ``discover:`` template) every unlisted plain-Parquet table folder of the landing zone."""
    listed = platform
    platform = with_discovered_tables(listed)
    discovered = [t.name for t in platform.tables[len(listed.tables) :]]
    tables = [build_table_definitions(platform, t) for t in platform.tables]
    # No table at all (a discover: config over an empty landing zone): no check job and no
    # schedule, which would launch a run with nothing in it every day.
    check_job = (
        dg.define_asset_job(
            "cdc_full_table_checks",
            selection=dg.AssetSelection.checks(*[t.checks for t in tables]),
            description="Every invariant over every history table (not just the keys a run touched).",
        )
        if tables
        else None
    )
    # One job each, the table named in the run config (as the operator jobs): the Jobs page
    # lists the same jobs whatever the table count; each table keeps its own schedule.
    maintenance_job = build_maintenance_job(platform)
    current_assets = [t.current for t in tables if t.current is not None]
    # Runs the current tables' automation conditions; on by default (Dagster's own default
    # automation sensor starts stopped). Needs the daemon, as the landing sensors do.
    current_sensor = (
        [
            dg.AutomationConditionSensorDefinition(
                CURRENT_TABLES_SENSOR,
                target=dg.AssetSelection.assets(*current_assets),
                default_status=dg.DefaultSensorStatus.RUNNING,
                minimum_interval_seconds=30,
                description="Refreshes each <table>_current after its history table changes.",
            )
        ]
        if current_assets
        else []
    )
    sensors = [
        *_landing_sensors(platform, tables),
        *current_sensor,
        build_check_failure_alert_sensor([k for t in tables for k in t.checks.check_keys]),
        build_run_failure_alert_sensor(),
        build_new_tables_sensor(listed, discovered),
    ]
    watched = [s.name for s in sensors]
    return dg.Definitions(
        assets=[*(t.asset for t in tables), *current_assets],
        asset_checks=[t.checks for t in tables],
        sensors=[*sensors, build_source_alert_sensor(platform.tables, watched)],
        jobs=[
            *([check_job] if check_job else []),
            maintenance_job,
            build_plan_job(platform),
            *build_revocation_jobs(platform),
            *build_lifecycle_jobs(platform),
        ],
        # One process per run: the asset step and its checks share one Spark session (one JVM)
        # instead of starting a JVM per step; Spark, not Dagster, parallelizes the work.
        executor=dg.in_process_executor,
        schedules=[
            *([full_checks_schedule(platform, check_job, tables)] if check_job else []),
            *build_maintenance_schedules(platform, maintenance_job),
        ],
        resources={
            # Where Spark runs and which keyring is read: the deployment's environment only.
            "spark": SparkResource(),
            "keyring": KeyringResource(),
            ALERT_RESOURCE_KEY: alert_webhook_from_env(),
        },
    )


def _keyed_by(table: TableConfig) -> str:
    if table.keyless:
        return "keyless (each distinct row is keyed by _fivetran_id, a hash of its values)"
    return f"keyed by {', '.join(table.key)}"
