"""What the operator jobs (un-apply, re-admit, truncate) share: finding the table a run names,
and reporting what the run did to it.

A run that changed a table reports a materialization of the hour partitions it concerns (so
the UI shows the table changed and ``<table>_current`` refreshes), or an observation when no
partition does, and runs the invariants over the keys it recomputed: a failing invariant fails
the run (the run-failure alert fires).
"""

from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg

from cdc_platform.defs.resources import SparkResource
from cdc_platform.lib import invariants
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.landing import hour_to_partition_key
from cdc_platform.lib.warehouse import TablePaths


def table_named(platform: PlatformConfig, name: str) -> TableConfig:
    try:
        return platform.table(name)
    except KeyError:
        known = ", ".join(t.name for t in platform.tables)
        raise dg.Failure(f"no table {name!r} in the config (tables: {known})") from None


def check_and_report(
    context: dg.OpExecutionContext,
    spark: SparkResource,
    platform: PlatformConfig,
    table: TableConfig,
    version_before: int | None,
    hours: tuple[datetime, ...],
    meta: dict[str, Any],
) -> None:
    """Run the invariants over the keys this run recomputed, report the change (with the
    checks' results) and then fail the run if an invariant failed: the commit happened, so
    the UI shows it either way."""
    paths = TablePaths.of(platform.warehouse_root, table.name)
    session = spark.session(platform.warehouse_root)
    scope = invariants.touched_keys(session, paths, table.primary_key, version_before)
    outcomes = invariants.run_checks(
        session, paths, table.primary_key, scope, hide_keys=table.encryption != "none"
    )
    failed = [o for o in outcomes if not o.passed and o.name != invariants.NO_QUARANTINE]
    for o in failed:
        context.log.error(f"{table.name}: check {o.name} failed for {o.failing} key(s) {o.sample}")
    meta = {
        **meta,
        "checks_passed": [o.name for o in outcomes if o.passed],
        "checks_failed": [o.name for o in failed],
    }
    report(context, table, hours, meta)
    if failed:
        raise dg.Failure(
            f"{table.name}: invariants failed after the run: {', '.join(o.name for o in failed)}",
            metadata={o.name: o.failing for o in failed},
        )


def report(
    context: dg.OpExecutionContext,
    table: TableConfig,
    hours: tuple[datetime, ...],
    meta: dict[str, Any],
) -> None:
    # Partitions of the asset only: from the table's start to the last closed hour.
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    hours = tuple(h for h in hours if table.start <= h <= last)
    for hour in hours:
        context.log_event(
            dg.AssetMaterialization(
                asset_key=dg.AssetKey(table.name),
                partition=hour_to_partition_key(hour),
                metadata=meta,
            )
        )
    if not hours:
        context.log_event(dg.AssetObservation(asset_key=dg.AssetKey(table.name), metadata=meta))
