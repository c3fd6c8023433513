"""A table's history asset: an hourly time-partitioned history (SCD2) table; a materialization
(one partition or a whole range, in one run) calls the pure pipeline (``lib.pipeline``).

Its metadata records what the run read and wrote, the Delta version before it (the checks
scope themselves by it, ``defs.tables.checks``) and the run's cost.
"""

from datetime import timedelta
from typing import Any

import dagster as dg

from cdc_platform.defs.jobs.maintenance_schedules import maintenance_schedule_name
from cdc_platform.defs.jobs.skeleton import pool_name, refused
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history.protected_columns import ProtectedColumnsChangedError
from cdc_platform.lib.history.table_key import PrimaryKeyChangedError
from cdc_platform.lib.landing.decoding.keyring import KeyringError
from cdc_platform.lib.landing.where.layout import hours_between
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize, needs_keyring
from cdc_platform.lib.storage.warehouse import TablePaths

VERSION_BEFORE = "delta_version_before"


def history_asset(platform: PlatformConfig, table: TableConfig) -> dg.AssetsDefinition:
    """The table's history asset: an hour range materialized in one run (``materialize``)."""
    key = dg.AssetKey(table.name)
    paths = TablePaths.of(platform.warehouse_root, table.name)
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


def freshness_policy(table: TableConfig) -> dg.FreshnessPolicy | None:
    """The source's expected cadence as Dagster freshness (the daemon evaluates it): a table
    with no materialization for ``expected_delivery_hours`` warns, for twice as long fails. A
    source that stopped delivering looks like a quiet table otherwise."""
    if table.expected_delivery_hours is None:
        return None
    hours = timedelta(hours=table.expected_delivery_hours)
    return dg.FreshnessPolicy.time_window(fail_window=2 * hours, warn_window=hours)


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
        **m.restated_metadata(),
        "changelog_version": m.changelog_version,
        "commit_attempts": m.attempts,
        "seconds": result.seconds,
        "files_read_natively": len(result.read_natively),
        "files_revoked_skipped": dg.MetadataValue.json(list(result.revoked)),
        "synced_at": result.synced_at.isoformat(),
        **cost,
    }


def _keyed_by(table: TableConfig) -> str:
    if table.keyless:
        return "keyless (each distinct row is keyed by _fivetran_id, a hash of its values)"
    return f"keyed by {', '.join(table.key)}"
