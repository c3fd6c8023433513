"""What a bulk hour costs (issue 22, target 9): an initial load dumped into one hour folder.

One hour folder of ``--files`` Parquet files holding ``--events`` events over ``--keys`` keys
(default 2M events over 1M keys in 4 files, about 37 MB: every key gets its first event, then
keys are drawn at random), generated once under ``--work-dir`` with the harness's generator
(``benchmarks.harness.generate``).
Then, each in a fresh ``python`` process (a cold JVM, nothing shared):

* **platform**: ``materialize()`` of that hour into an empty warehouse, on the shipped
  defaults (``build_spark_session("local[2]")`` with no settings of its own: the driver's
  memory is the platform's default, ``lib.spark.session.default_driver_memory``, unless the shell's
  ``spark-defaults.conf`` or ``--driver-memory`` says otherwise);
* **reference**: the plainest Spark a data engineer would write for the same work: one Spark
  SQL query over the hour's files (window functions: one version per key and millisecond,
  consecutive equal images merged, deletes close; the DuckDB reference of
  ``merge_at_scale``, in Spark SQL: ``benchmarks.harness.reference``) written as Parquet, in a session with the same settings (same driver memory, same
  encrypted shuffle), so the ratio is the platform's work against Spark's floor.

Prints the seconds of each (the whole process, and the work inside it), the ratio, the peak
RSS of each process tree (Python + the JVM + Python workers, summed VmRSS sampled from /proc
every 50 ms) and the versions each produced (they must agree; ``--compare`` checks every row,
ignoring ``_fivetran_synced``). Never asserts a time. A 20M-event hour must finish too
(``--events 20000000``: Spark spills, it must never run out of memory).

    .venv/bin/python -m benchmarks.bulk_hour_cost
    .venv/bin/python -m benchmarks.bulk_hour_cost --events 20000000
    .venv/bin/python -m benchmarks.bulk_hour_cost --only platform --driver-memory 1g

The machine is shared with two cores: run it alone, and read a figure as indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from benchmarks.harness.generate import GENERATOR_VERSION, EventGenerator, split_evenly
from benchmarks.harness.measure import TreeRssSampler
from benchmarks.harness.reference import compare_tables, spark_fold_sql
from benchmarks.harness.report import MB, log
from benchmarks.harness.table import REPO_ROOT, START_US, TABLE, TABLE_NAME, hour_at
from cdc_platform.lib.landing.where.layout import hour_folder

# --------------------------------------------------------------------------- the hour


def bulk_hour(work: Path, events: int, keys: int, files: int, seed: int) -> Path:
    """The landing root holding the bulk hour, generated once per parameters."""
    name = f"landing-e{events}-k{keys}-f{files}-s{seed}-g{GENERATOR_VERSION}"
    root = work / name
    marker = root / "_complete"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    folder = hour_folder(root, TABLE_NAME, hour_at(0))
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    gen = EventGenerator(keys, seed, every_key_first=True)
    for i, n in enumerate(split_evenly(events, files)):
        pq.write_table(gen.events(n, START_US), folder / f"part-{i:05d}.parquet")
    marker.write_text("")
    size = sum(p.stat().st_size for p in folder.iterdir())
    log(
        f"generated {events:,} events over {keys:,} keys in {files} files, {size / MB:.0f} MB "
        f"({time.perf_counter() - t0:.1f} s): {folder}"
    )
    return root


# --------------------------------------------------------------------------- the children


def session(driver_memory: str | None, app: str) -> Any:
    from cdc_platform.lib.spark.session import build_spark_session

    conf = {"spark.driver.memory": driver_memory} if driver_memory else None
    return build_spark_session("local[2]", conf, app)


def run_platform(landing: Path, out: Path, driver_memory: str | None) -> dict[str, Any]:
    from cdc_platform.lib.pipeline import materialize

    spark = session(driver_memory, "bulk_hour_platform")
    memory = spark.sparkContext.getConf().get("spark.driver.memory", "1g (Spark's default)")
    t0 = time.perf_counter()
    outcome = materialize(spark, TABLE, landing, out, [hour_at(0)])
    seconds = time.perf_counter() - t0
    spark.stop()
    return {
        "seconds": seconds,
        "driver_memory": memory,
        "events": outcome.events_read,
        "versions": outcome.merge.rows_written,
        "keys": outcome.merge.keys_affected,
    }


def run_reference(landing: Path, out: Path, driver_memory: str | None) -> dict[str, Any]:
    from pyspark.sql import functions as F

    spark = session(driver_memory, "bulk_hour_reference")
    memory = spark.sparkContext.getConf().get("spark.driver.memory", "1g (Spark's default)")
    t0 = time.perf_counter()
    # Every hour folder of the table (one for the bulk hour, 720 for merge_at_scale's backfill).
    table_root = str(landing / TABLE_NAME)
    spark.read.option("recursiveFileLookup", "true").parquet(table_root).select(
        "*",
        F.col("_metadata.file_path").alias("source_file"),
        F.col("_metadata.row_index").alias("source_row"),
    ).createOrReplaceTempView("landing")
    spark.sql(spark_fold_sql()).write.mode("overwrite").parquet(str(out))
    seconds = time.perf_counter() - t0
    spark.stop()
    versions = sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("*.parquet"))
    return {"seconds": seconds, "driver_memory": memory, "versions": versions}


# --------------------------------------------------------------------------- measuring


def measured(which: str, landing: Path, out: Path, driver_memory: str | None) -> dict[str, Any]:
    """Run one side in a fresh process; its figures, whole-process seconds and peak tree RSS."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "benchmarks.bulk_hour_cost", "--child", which]
    cmd += ["--landing", str(landing), "--out", str(out)]
    if driver_memory:
        cmd += ["--driver-memory", driver_memory]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    with TreeRssSampler(proc.pid) as rss:
        stdout, _ = proc.communicate()
    whole = time.perf_counter() - t0
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"failed": f"exit {proc.returncode}", "process_seconds": whole, "peak": rss.peak}
    return {**json.loads(lines[-1]), "process_seconds": whole, "peak": rss.peak}


def report(platform: dict[str, Any] | None, reference: dict[str, Any] | None) -> None:
    rows = [("platform materialize()", platform), ("plain Spark SQL reference", reference)]
    log("")
    log(f"{'':28}{'work s':>9}{'process s':>11}{'peak RSS':>11}{'versions':>12}  driver memory")
    for name, r in rows:
        if r is None:
            continue
        if "failed" in r:
            log(f"{name:28}{'FAILED':>9}{r['process_seconds']:>11.1f}{r['peak'] / MB:>8.0f} MB")
            continue
        log(
            f"{name:28}{r['seconds']:>9.1f}{r['process_seconds']:>11.1f}"
            f"{r['peak'] / MB:>8.0f} MB{r['versions']:>12,}  {r['driver_memory']}"
        )
    if platform and reference and "failed" not in platform and "failed" not in reference:
        log(
            f"ratio platform / reference: {platform['seconds'] / reference['seconds']:.2f}x "
            f"(work), {platform['process_seconds'] / reference['process_seconds']:.2f}x "
            "(whole processes); target 2x"
        )


def compare(platform_out: Path, reference_out: Path) -> None:
    from deltalake import DeltaTable

    history = DeltaTable(str(platform_out / TABLE_NAME))
    ours = history.to_pyarrow_table()
    ref = pq.read_table(reference_out)
    ref = ref.select([c for c in ref.column_names if c in ours.column_names])
    diff = compare_tables(ours.select(ref.column_names), ref)
    log("rows: " + (diff or "the platform's history table equals the reference, row by row"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--events", type=int, default=2_000_000)
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/cdc_bulk_hour_bench"))
    p.add_argument("--only", choices=("platform", "reference"), help="run one side")
    p.add_argument(
        "--driver-memory", help="spark.driver.memory for both sides (default: the platform's)"
    )
    p.add_argument("--compare", action="store_true", help="compare every row (after timing)")
    p.add_argument("--keep", action="store_true", help="keep the outputs under --work-dir")
    p.add_argument("--child", choices=("platform", "reference"), help=argparse.SUPPRESS)
    p.add_argument("--landing", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run = run_platform if args.child == "platform" else run_reference
        print(json.dumps(run(args.landing, args.out, args.driver_memory)), flush=True)
        return
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    landing = bulk_hour(work, args.events, args.keys, args.files, args.seed)
    log(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load {os.getloadavg()}")
    platform_out, reference_out = work / "platform", work / "reference"
    platform = reference = None
    if args.only != "reference":
        platform = measured("platform", landing, platform_out, args.driver_memory)
        log(f"platform: {json.dumps(platform)}")
    if args.only != "platform":
        reference = measured("reference", landing, reference_out, args.driver_memory)
        log(f"reference: {json.dumps(reference)}")
    report(platform, reference)
    if args.compare and platform and reference and "failed" not in platform | reference:
        compare(platform_out, reference_out)
    if not args.keep:
        shutil.rmtree(platform_out, ignore_errors=True)
        shutil.rmtree(reference_out, ignore_errors=True)


if __name__ == "__main__":
    main()
