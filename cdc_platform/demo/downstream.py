"""A downstream asset of the demo: ``orders_daily``, the live orders and their total as of
each day's end, read from the history table with ``read.as_of_arrow``.

It is what a user builds on a history table, and what the ``cdc_restatements`` sensor keeps
right: when late data restates a past day, that day's partition is requested again
(docs/history-table.md, "Downstream assets").
"""

from datetime import timedelta

import dagster as dg
import pyarrow as pa
from deltalake import write_deltalake

from cdc_platform import read
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.storage.warehouse import TablePaths

DAY_COLUMN = "day"


def daily_totals(platform: PlatformConfig, table: str, amount: str) -> dg.AssetsDefinition:
    """``<table>_daily``: per day, the rows of ``table`` valid at the day's last millisecond,
    counted, with the sum of their ``amount``; one Delta table in the warehouse, a partition a
    day, each run replacing its own day only."""
    config = platform.table(table)
    history = TablePaths.of(platform.warehouse_root, table).history
    target = TablePaths.of(platform.warehouse_root, f"{table}_daily").history

    @dg.asset(
        name=f"{table}_daily",
        deps=[dg.AssetKey(table)],
        partitions_def=dg.DailyPartitionsDefinition(start_date=config.start.strftime("%Y-%m-%d")),
        group_name="downstream",
        # One run at a time: each replaces its day's rows in one Delta table, and concurrent
        # overwrites of one table conflict at commit.
        pool=f"{table}_daily",
        description=f"Live {table} and their total {amount} as of each day's end.",
    )
    def daily(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        window = context.partition_time_window
        at = window.end - timedelta(milliseconds=1)  # the day's last instant
        rows = read.as_of_arrow(history, at).to_table(columns=[amount])
        total = sum(v for v in rows.column(amount).to_pylist() if v is not None)
        day = context.partition_key
        result = pa.table({DAY_COLUMN: [day], "rows": [rows.num_rows], "total": [float(total)]})
        write_deltalake(
            target.uri,
            result,
            mode="overwrite",
            predicate=f"{DAY_COLUMN} = '{day}'",  # a partition key Dagster made: YYYY-MM-DD
            storage_options=target.storage_options,
        )
        return dg.MaterializeResult(
            metadata={"as_of": at.isoformat(), "rows": rows.num_rows, "total": float(total)}
        )

    return daily
