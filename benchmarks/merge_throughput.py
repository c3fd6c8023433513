"""Merge throughput: an initial backfill, then hourly increments, late files and a replay.

Prints seconds and events/s per step, and the driver's peak memory (which must stay flat as
data grows: nothing table-sized goes through the driver).

    .venv/bin/python -m benchmarks.merge_throughput [--keys 50000] [--events 300000] [--hours 6]
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.session import build_spark_session
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths

START = datetime(2024, 1, 1, tzinfo=UTC)
TABLE = TableConfig(name="bench", primary_key=("id",), start=START)


def write_hour(
    landing: Path, hour: int, keys: int, n: int, seq0: int, rng: random.Random, delay: int = 0
) -> None:
    base = START + timedelta(hours=hour)
    ops = rng.choices(["INSERT", "UPDATE", "DELETE"], weights=[2, 7, 1], k=n)
    tbl = pa.table(
        {
            "id": pa.array([rng.randrange(keys) for _ in range(n)], pa.int64()),
            "status": pa.array(
                [rng.choice(["new", "paid", "shipped", "returned"]) for _ in range(n)]
            ),
            "amount": pa.array([round(rng.uniform(1, 999), 2) for _ in range(n)]),
            "note": pa.array([f"note {rng.randrange(1000)}" for _ in range(n)]),
            "cdc_operation_type": pa.array(ops),
            "cdc_change_seq": pa.array(range(seq0, seq0 + n), pa.int64()),
            "cdc_commit_timestamp": pa.array(
                sorted(
                    base + timedelta(microseconds=rng.randrange(3_600_000_000)) for _ in range(n)
                ),
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    folder = hour_folder(landing, TABLE.name, base + timedelta(hours=delay))
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(tbl, folder / f"part-{hour:03d}-{seq0}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument(
        "--events", type=int, default=300_000, help="events in the initial backfill"
    )
    parser.add_argument("--hours", type=int, default=6)
    args = parser.parse_args()
    rng = random.Random(1)
    root = Path(tempfile.mkdtemp(prefix="cdc_bench_"))
    landing, warehouse = root / "landing", root / "warehouse"
    spark = build_spark_session("local[2]", {"spark.driver.memory": "4g"})
    per_hour = args.events // args.hours
    seq = 1
    for h in range(args.hours):
        write_hour(landing, h, args.keys, per_hour, seq, rng)
        seq += per_hour

    def step(label: str, hours: list[int], events: int) -> None:
        t0 = time.perf_counter()
        r = materialize(
            spark, TABLE, landing, warehouse, [START + timedelta(hours=h) for h in hours]
        )
        s = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"{label:<28} {s:7.2f} s  {events / s if events else 0:>9,.0f} events/s  "
            f"keys {r.merge.keys_affected:>7,}  opened {r.merge.versions_opened:>7,}  "
            f"files -{r.merge.files_removed}/+{r.merge.files_added}  driver peak RSS {rss:,.0f} MiB"
        )

    print(f"{args.events:,} events over {args.keys:,} keys, {args.hours} hourly folders, local[2]")
    step(f"backfill {args.hours} h (one run)", list(range(args.hours)), args.events)
    inc = per_hour // 10
    write_hour(landing, args.hours, args.keys, inc, seq, rng)
    seq += inc
    step("next hour (10% volume)", [args.hours], inc)
    write_hour(
        landing, 1, args.keys, inc // 10, seq, rng, delay=args.hours
    )  # hour 1's events, late
    step("late file in a later folder", [args.hours + 1], inc // 10)
    step("replay, nothing new", [args.hours], 0)
    history = TablePaths.of(warehouse, TABLE.name).history
    print(
        f"history: {delta.read_arrow(history, columns=['id']).num_rows:,} versions, "
        f"Delta version {delta.version_or_none(history)}"
    )
    spark.stop()


if __name__ == "__main__":
    main()
