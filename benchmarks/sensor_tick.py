"""How long a landing sensor tick takes with a long history: 10,000 hourly folders.

A normal tick must cost O(lookback) folder listings, not O(history); only the periodic full sweep
walks the whole tree. Run: ``.venv/bin/python benchmarks/sensor_tick.py [--folders N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet.sensor_cursor import CursorState, PartitionRequest, evaluate
from cdc_platform.lib.landing.layout import hour_folder

START = datetime(2024, 1, 1, tzinfo=UTC)


def build_tree(root: Path, n_folders: int) -> None:
    """One small file per hour; mtimes are the (past) delivery times, as in a real landing zone."""
    real_end_ns = time.time_ns() - 3600 * 1_000_000_000
    for i in range(n_folders):
        hour = START + timedelta(hours=i)
        folder = hour_folder(root, "orders", hour)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "part-00000.parquet"
        path.write_bytes(b"PAR1 small file")
        mtime = real_end_ns - (n_folders - i) * 3600 * 1_000_000_000
        os.utime(path, ns=(mtime, mtime))


def timed(
    fn: Callable[[], tuple[list[PartitionRequest], CursorState]], reps: int
) -> tuple[float, tuple[list[PartitionRequest], CursorState]]:
    samples = []
    result = fn()  # warm-up (and the result to report)
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folders", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    table = TableConfig(name="orders", primary_key=("id",), start=START, lookback_hours=6)
    with tempfile.TemporaryDirectory(prefix="sensor_tick_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        build_tree(root, args.folders)
        print(f"built {args.folders:,} hour folders in {time.perf_counter() - t0:.1f} s")

        last_hour = START + timedelta(hours=args.folders - 1)
        now = last_hour + timedelta(hours=1, minutes=5)

        t0 = time.perf_counter()
        initial, warm = evaluate(table, root, now, CursorState())
        initial_ms = (time.perf_counter() - t0) * 1000
        n_keys = sum(len(r.partition_keys) for r in initial)
        print(
            f"initial tick (empty cursor, full sweep + backfill): {initial_ms:8.1f} ms, "
            f"{len(initial)} range requests covering {n_keys:,} partitions"
        )
        warm_json = warm.to_json()

        later = now + timedelta(minutes=1)
        normal_ms, (normal_requests, _) = timed(
            lambda: evaluate(table, root, later, warm), args.reps
        )
        assert normal_requests == [], normal_requests
        print(
            f"(a) normal tick, warm cursor, lookback 6h:        {normal_ms:8.2f} ms  (0 requests)"
        )

        late = hour_folder(root, "orders", last_hour - timedelta(hours=3)) / "part-late.parquet"
        late.write_bytes(b"PAR1 late file")
        late_ms, (late_requests, _) = timed(lambda: evaluate(table, root, later, warm), args.reps)
        assert [r.partition_keys for r in late_requests] == [
            ((last_hour - timedelta(hours=3)).strftime("%Y-%m-%d-%H:%M"),)
        ], late_requests
        print(
            f"(b) tick with one new file inside the lookback:  {late_ms:8.2f} ms  "
            f"({late_requests[0].reason!r})"
        )

        old = hour_folder(root, "orders", START + timedelta(hours=100)) / "part-late.parquet"
        old.write_bytes(b"PAR1 very late file")
        sweep_at = now + timedelta(minutes=table.full_sweep_minutes)
        sweep_ms, (sweep_requests, swept) = timed(
            lambda: evaluate(table, root, sweep_at, warm), args.reps
        )
        reasons = sorted({r.reason for r in sweep_requests})
        print(
            f"(c) full sweep tick over {args.folders:,} folders:    {sweep_ms:8.1f} ms  "
            f"({len(sweep_requests)} requests: {reasons})"
        )
        print(
            f"cursor JSON: {len(warm_json):,} bytes after the initial tick "
            f"({len(warm.folders)} folder entries), {len(swept.to_json()):,} bytes after the sweep "
            f"({len(swept.folders)} entries)"
        )
        print(f"(median of {args.reps} repetitions after one warm-up; page cache warm)")


if __name__ == "__main__":
    main()
