"""Maintenance jobs: one per table, compaction then VACUUM, on the config's schedule.

The op runs in the table's concurrency pool, so it never overlaps a materialization of the
same table. What it did is recorded as an observation of the table's asset (files and bytes
before and after), visible on the asset's page beside its materializations.
"""

import dagster as dg

from cdc_platform.defs.resources import SparkResource
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.maintenance import DEFAULT_RETENTION_HOURS, compact, vacuum
from cdc_platform.lib.warehouse import TablePaths


class MaintenanceConfig(dg.Config):
    retention_hours: int = DEFAULT_RETENTION_HOURS
    vacuum: bool = True


def maintenance_job_name(table: TableConfig) -> str:
    return f"{table.name}_maintenance"


def build_maintenance_job(
    platform: PlatformConfig, table: TableConfig, pool: str
) -> dg.JobDefinition:
    paths = TablePaths.of(platform.warehouse_root, table.name)

    @dg.op(name=f"{table.name}_compact_and_vacuum", pool=pool)
    def compact_and_vacuum(
        context: dg.OpExecutionContext, config: MaintenanceConfig, spark: SparkResource
    ) -> None:
        metadata: dict[str, int | None] = {}
        for c in compact(spark.session(platform.warehouse_root), paths, table.primary_key):
            context.log.info(
                f"{table.name} {c.table}: {c.files_before} -> {c.files_after} files "
                f"({c.files_rewritten} rewritten), {c.bytes_before:,} -> {c.bytes_after:,} bytes"
            )
            metadata |= {
                f"{c.table}_files_before": c.files_before,
                f"{c.table}_files_after": c.files_after,
                f"{c.table}_bytes_before": c.bytes_before,
                f"{c.table}_bytes_after": c.bytes_after,
                f"{c.table}_files_rewritten": c.files_rewritten,
            }
        if config.vacuum:
            removed = vacuum(paths, config.retention_hours, current_table=table.current_table)
            metadata["vacuumed_files"] = len(removed)
        context.log_event(
            dg.AssetObservation(
                asset_key=dg.AssetKey(table.name),
                metadata={"maintenance": "compact + vacuum", **metadata},
            )
        )

    @dg.job(
        name=maintenance_job_name(table),
        description=(
            f"Compact {table.name}'s history table and change log, then VACUUM them"
            + (" and its current table." if table.current_table else ".")
        ),
        tags={"cdc_platform/table": table.name},
    )
    def maintenance() -> None:
        compact_and_vacuum()

    return maintenance
