"""``<table>_current`` (``current_table: true``): an unpartitioned asset downstream of the
history asset holding its active rows (SCD1), which the ``cdc_current_tables`` automation
sensor refreshes after each history materialization.
"""

from collections.abc import Sequence

import dagster as dg

from cdc_platform.defs.jobs.skeleton import pool_name
from cdc_platform.defs.resources import SparkResource
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history import current_table
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.storage.warehouse import TablePaths, current_table_name

CURRENT_TABLES_SENSOR = "cdc_current_tables"


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
        result = current_table.refresh(
            HistoryTable.of(spark.session(platform.warehouse_root), platform, table)
        )
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


def current_tables_sensor(current: Sequence[dg.AssetsDefinition]) -> list[dg.SensorDefinition]:
    """Runs the current tables' automation conditions; on by default (Dagster's own default
    automation sensor starts stopped). Needs the daemon, as the landing sensors do."""
    if not current:
        return []
    return [
        dg.AutomationConditionSensorDefinition(
            CURRENT_TABLES_SENSOR,
            target=dg.AssetSelection.assets(*current),
            default_status=dg.DefaultSensorStatus.RUNNING,
            minimum_interval_seconds=30,
            description="Refreshes each <table>_current after its history table changes.",
        )
    ]
