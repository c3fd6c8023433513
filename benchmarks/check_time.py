"""How long the full-table invariant checks take on the demo tables (customers, orders).

Generates the ``make demo`` landing zone in a temp folder, materializes every hour of each table
in one pass, then times ``invariants.run_checks`` over the whole table (no scope), which is what
the scheduled ``cdc_full_table_checks`` job runs. The first run per table is reported apart: it
includes Spark's warm-up. Run: ``.venv/bin/python -m benchmarks.check_time [--hours N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cdc_platform.demo.generate import CUSTOMERS, ORDERS, PRIMARY_KEYS, generate_landing_zone
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import invariants
from cdc_platform.lib.landing.where.layout import all_hour_folders
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.session import build_spark_session
from cdc_platform.lib.storage.delta import read_arrow
from cdc_platform.lib.storage.warehouse import TablePaths

START = datetime(2024, 1, 1, tzinfo=UTC)


def timed_checks(spark, paths: TablePaths, primary_key: tuple[str, ...]):
    """Seconds for one full-table run of every check, and its outcomes."""
    start = time.perf_counter()
    outcomes = invariants.run_checks(spark, paths, primary_key)
    return time.perf_counter() - start, outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=12, help="demo hours (make demo: 12)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per table after the first")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    spark = build_spark_session("local[2]", app_name="check_time")
    try:
        with tempfile.TemporaryDirectory(prefix="check_time_") as tmp:
            landing, warehouse = Path(tmp) / "landing", Path(tmp) / "warehouse"
            written = generate_landing_zone(landing, seed=args.seed, hours=args.hours, start=START)
            print(f"landing zone: {written} events, {args.hours} h, seed {args.seed}")
            header = (
                f"{'table':<10} {'events':>7} {'rows':>6} {'keys':>6} {'mat s':>7} "
                f"{'first s':>8} {'median s':>9} {'min s':>7}  failing"
            )
            print(header)
            for name in (CUSTOMERS, ORDERS):
                table = TableConfig(name=name, primary_key=(PRIMARY_KEYS[name],), start=START)
                hours = [h for h, _ in all_hour_folders(landing, name)]
                assert hours == [START + timedelta(hours=i) for i in range(len(hours))]
                t0 = time.perf_counter()
                result = materialize(spark, table, landing, warehouse, hours)
                mat_s = time.perf_counter() - t0
                paths = TablePaths.of(warehouse, name)
                rows = read_arrow(paths.history, columns=[PRIMARY_KEYS[name]])
                first, outcomes = timed_checks(spark, paths, table.key)
                samples = [timed_checks(spark, paths, table.key)[0] for _ in range(args.reps)]
                failing = [o.name for o in outcomes if not o.passed] or ["none"]
                keys = len(set(rows.column(0).to_pylist()))
                print(
                    f"{name:<10} {result.events_read:>7} {rows.num_rows:>6} {keys:>6} "
                    f"{mat_s:>7.1f} {first:>8.2f} {statistics.median(samples):>9.2f} "
                    f"{min(samples):>7.2f}  {', '.join(failing)}"
                )
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
