"""``merge_plan``: a dry run of materializing a range of hours of one table.

Launched from the UI (Jobs → ``merge_plan`` → Launchpad) with the table and the first and last
partition to plan; it waits for the table's pool slot like the operator jobs
(``defs.operations``). Nothing is committed: the plan (``lib.operations.plan``) runs the real pipeline on a
temporary shadow of the table. Its figures are logged as an observation of the table's asset,
next to its materializations, so the plan and the real run that follows compare side by side.
"""

from typing import Any

import dagster as dg
from pydantic import Field

from cdc_platform.defs.operations import TableRunConfig, operator_run, table_named
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.landing.where.layout import hours_between, partition_key_to_hour
from cdc_platform.lib.operations.plan import MergePlan, plan

PLAN_JOB = "merge_plan"
PLAN_OP = "plan_merge"


class PlanConfig(TableRunConfig):
    first_partition: str = Field(description="First hourly partition, e.g. 2024-01-01-05:00.")
    last_partition: str | None = Field(default=None, description="Last one; default: the first.")


def plan_metadata(p: MergePlan) -> dict[str, Any]:
    o, m = p.outcome, p.outcome.merge
    return {
        "dry_run": True,
        "files_read": o.files_read,
        "events_new": o.events_new,
        "files_quarantined": len(o.quarantined),
        "quarantined": dg.MetadataValue.json(
            [{"file": q.file, "row": q.row, "reason": q.reason} for q in o.quarantined]
        ),
        "keys_affected": m.keys_affected,
        "versions_opened": m.versions_opened,
        "versions_closed": m.versions_closed,
        "files_removed": m.files_removed,
        "bytes_removed": m.bytes_removed,
        "files_added": m.files_added,
        "bytes_added": m.bytes_added,
        "late_events": p.late_events,
        "late_keys": p.late_keys,
        "oldest_late_event": p.oldest_late_event.isoformat() if p.oldest_late_event else None,
        "late_reach_hours": (
            round(p.reaches_back_seconds / 3600, 3) if p.reaches_back_seconds is not None else None
        ),
    }


def build_plan_job(platform: PlatformConfig) -> dg.JobDefinition:
    @dg.op(name=PLAN_OP)
    def plan_merge(
        context: dg.OpExecutionContext,
        config: PlanConfig,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        table_named(platform, config.table)  # an unknown table is refused first
        try:
            first = partition_key_to_hour(config.first_partition)
            last = partition_key_to_hour(config.last_partition or config.first_partition)
        except ValueError as exc:
            raise dg.Failure(f"partitions are spelled like 2024-01-01-05:00: {exc}") from None
        if last < first:
            raise dg.Failure(f"last_partition {config.last_partition} is before first_partition")
        hours = list(hours_between(first, last))
        # In the table's pool: nothing writes the table, or VACUUMs the files the plan's
        # shadow links to, while the plan reads it.
        with operator_run(context, platform, config, spark, keyring, refuse=()) as run:
            table = run.table
            result = plan(
                run.session,
                table,
                platform.landing_root,
                platform.warehouse_root,
                hours,
                run.keyring(),
            )
        metadata = plan_metadata(result)
        context.log.info(
            f"{table.name}: plan for {len(hours)} hour(s): {metadata['keys_affected']} keys, "
            f"{metadata['versions_opened']} versions opened, {metadata['files_removed']} files "
            f"({metadata['bytes_removed']:,} bytes) removed, {metadata['files_added']} added "
            f"({metadata['bytes_added']:,} bytes), {metadata['late_events']} late events"
        )
        context.log_event(dg.AssetObservation(asset_key=dg.AssetKey(table.name), metadata=metadata))

    @dg.job(
        name=PLAN_JOB,
        description="Dry run: what materializing a range of hours of a table would change "
        "(figures logged on the table's asset; nothing committed).",
    )
    def merge_plan() -> None:
        plan_merge()

    return merge_plan
