"""What the applied-files ledger costs its readers over a year of hourly runs, with and without
``table_maintenance``'s compaction (``lib.ledgers.applied_files``).

Each run records its hour with the ledger's own write function (``applied_files.record``, one
commit, one small file). Two ledgers get the same runs: one never compacted, one compacted and
VACUUMed once a day as the maintenance schedule does (``maintenance.compact_applied_files``,
``vacuum``). At each month's end both readers are measured: the sensor's seed (the whole ledger,
``applied``) and a reconcile of the last day's hours (``applied_by_partition``), as the files
the read opens and their bytes (``Ledger.files_read``, the very pruning the read uses) and the
seconds it took. At the end the never-compacted ledger is compacted once, and read again.

Run it alone (2 shared cores: seconds are indicative, files and bytes exact)::

    .venv/bin/python -m benchmarks.applied_files_ledger_cost                 # a year: 8,760 runs
    .venv/bin/python -m benchmarks.applied_files_ledger_cost --hours 744     # a month
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cdc_platform.lib.landing.where.layout import LandingFile, hour_to_partition_key
from cdc_platform.lib.ledgers import applied_files
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.operations.maintenance import compact_applied_files, vacuum
from cdc_platform.lib.storage.warehouse import TablePaths

START = datetime(2024, 1, 1, tzinfo=UTC)
MONTH_HOURS = 730


def record_run(paths: TablePaths, landing: Path, hour: int, files: int) -> str:
    """One hourly run's record: ``files`` landing files of the hour."""
    at = START + timedelta(hours=hour)
    key = hour_to_partition_key(at)
    rows = [
        applied_files.AppliedFile(
            key, LandingFile(str(landing / f"t/{key}/part-{j:05d}.parquet"), 4096 + j, hour)
        )
        for j in range(files)
    ]
    applied_files.record(applied_files.of_table(paths), landing, [key], rows, f"run-{hour}", at)
    return key


def measured(read: Callable[[], object], files: list) -> str:
    started = time.perf_counter()
    read()
    seconds = time.perf_counter() - started
    return f"{len(files):>6} files {sum(f.size for f in files):>11,} B {seconds:>7.3f} s"


def report(label: str, paths: TablePaths, due: list[str]) -> None:
    path = applied_files.of_table(paths)
    ledger = Ledger(path, applied_files.SCHEMA)
    seed = measured(lambda: applied_files.applied(path), ledger.files_read())
    hours = ("partition", due)
    recon = measured(
        lambda: applied_files.applied_by_partition(path, due), ledger.files_read(hours)
    )
    print(f"  {label:<24} seed: {seed}   reconcile {len(due)} h: {recon}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=8760, help="hourly runs (a year: 8760)")
    parser.add_argument("--files-per-hour", type=int, default=3)
    parser.add_argument("--reconcile-hours", type=int, default=24)
    parser.add_argument("--compact-every", type=int, default=24, help="hours between compactions")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="applied_files_bench_"))
    try:
        landing = root / "landing"
        landing.mkdir()
        plain = TablePaths.of(root / "plain", "t")
        kept = TablePaths.of(root / "maintained", "t")
        keys: list[str] = []
        started = time.perf_counter()
        for hour in range(args.hours):
            keys.append(record_run(plain, landing, hour, args.files_per_hour))
            record_run(kept, landing, hour, args.files_per_hour)
            if (hour + 1) % args.compact_every == 0:
                compact_applied_files(kept)
                vacuum(kept, retention_hours=0, enforce_retention_duration=False)
            if (hour + 1) % MONTH_HOURS == 0 or hour + 1 == args.hours:
                print(
                    f"after {hour + 1} runs ({time.perf_counter() - started:.0f} s of writing):",
                    flush=True,
                )
                due = keys[-args.reconcile_hours :]
                report("never compacted", plain, due)
                report(f"compacted every {args.compact_every} h", kept, due)
        due = keys[-args.reconcile_hours :]
        before = {"seed": applied_files.applied(applied_files.of_table(plain))}
        done = compact_applied_files(plain)
        vacuum(plain, retention_hours=0, enforce_retention_duration=False)
        print(
            f"one compaction of the never-compacted ledger: {done.files_before} -> "
            f"{done.files_after} files, {done.bytes_before:,} -> {done.bytes_after:,} bytes"
        )
        report("after that compaction", plain, due)
        assert applied_files.applied(applied_files.of_table(plain)) == before["seed"]
        print("the seed read gives the same rows before and after the compaction")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
