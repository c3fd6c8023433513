"""What a small hour costs, stage by stage, against plain Spark doing the same work (issue 22,
targets 1 and 2: the small-hour reference and the Spark jobs per stage).

A history table of about ``--versions`` versions is built once by one range ``materialize()``
(the harness's generator and cache: rerunning is free until ``cdc_platform/lib`` changes). In
one warm local[2] session, after one unmeasured warm-up hour, ``--repeats`` hours of
``--hour-events`` events are each applied with ``materialize()``; every run's own cost
(``lib.spark.run_cost``: the figures the Dagster metadata records) is printed per stage: seconds
(median over the repeats) and Spark jobs (exact, counted per stage by job group).

Beside it, the **small-hour reference**: the plainest Spark for the same work, in the same warm
session, its jobs counted the same way (a ``RunCost`` with a lap per step): read the hour
folder, take the live rows of its keys from the history table's files (broadcast semi-join on
the hour's keys), fold them with the hour's events (one window per key: each image opens a
version that the key's next event ends) and write the keys' new versions, as Parquet, to a
temporary folder. Then the ratios, and the targets of issue 22 (within 2x the reference's time,
at most 12 Spark jobs).

``--profile DIR`` turns on Spark's event log for the session (``spark.eventLog.enabled``): every
job carries its stage's job group (``cdc_platform-run-<id>/<stage>``), so the profile shows
which stage ran which job. It also samples this process with py-spy over the measured hours
(``harness.profile``) and prints where their wall time went: each stage's seconds beside its
jobs', the driver's samples by bucket (the JVM, delta-rs, Arrow, the platform's Python) and
its longest waits on Spark by call. The log's path and the command that opens it in Spark's
history server are printed at the end.

Run it alone (2 shared cores: seconds are indicative, job counts exact)::

    .venv/bin/python -m benchmarks.run_cost                       # ~100k versions
    .venv/bin/python -m benchmarks.run_cost --versions 20000 --repeats 2
    .venv/bin/python -m benchmarks.run_cost --profile /tmp/cdc_profile
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import profile
from benchmarks.harness.generate import (
    EventGenerator,
    build_cached_table,
    cached_hours,
    write_hour,
)
from benchmarks.harness.measure import local_session
from benchmarks.harness.report import log, print_table
from benchmarks.harness.table import DATA_COLUMNS, HOUR_US, START_US, TABLE, TMAX_US, hour_at
from cdc_platform.lib.history import invariants
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize
from cdc_platform.lib.spark.run_cost import CostReport, RunCost
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TARGET_TIME_RATIO = 2.0
TARGET_JOBS = 12
TARGET_CHECK_SECONDS = 2.0


def reference_hour(spark: SparkSession, hour_dir: Path, history: Path, out: Path) -> CostReport:
    """The plainest Spark for a small hour: read it, semi-join the live rows of its keys,
    fold, write the keys' new versions. Counted by the same stopwatch as a run."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    with RunCost(spark) as cost:
        cost.lap("read_hour")
        events = spark.read.parquet(str(hour_dir)).select(
            "id",
            *DATA_COLUMNS,
            F.col("cdc_operation_type").alias("op"),
            F.col("cdc_change_seq").alias("seq"),
            F.col("cdc_commit_timestamp").alias("ts"),
        )
        cost.lap("live_rows")
        files = delta.absolute_paths(history, delta.snapshot_files(delta.open_table(history)))
        live = (
            spark.read.parquet(*files)
            .filter(F.col("_fivetran_active"))
            .join(F.broadcast(events.select("id").distinct()), "id", "left_semi")
            .select(
                "id",
                *DATA_COLUMNS,
                F.lit("INSERT").alias("op"),
                F.lit(-1).cast("long").alias("seq"),
                F.col("_fivetran_start").alias("ts"),
            )
        )
        cost.lap("fold_write")
        by_key = Window.partitionBy("id").orderBy("ts", "seq")
        next_ts = F.lead("ts").over(by_key)
        folded = (
            events.unionByName(live)
            .withColumn("next_ts", next_ts)
            .filter(F.col("op") != "DELETE")
            .select(
                "id",
                *DATA_COLUMNS,
                F.col("ts").alias("_fivetran_start"),
                F.coalesce(
                    F.timestamp_micros(F.unix_micros("next_ts") - 1000),
                    F.timestamp_micros(F.lit(TMAX_US)),
                ).alias("_fivetran_end"),
                F.col("next_ts").isNull().alias("_fivetran_active"),
            )
        )
        folded.write.mode("overwrite").parquet(str(out))
    return cost.report()


def hourly_checks(spark: SparkSession, paths: TablePaths, since: int | None) -> CostReport:
    """The checks step that follows an hourly run, as the asset check runs them: every
    invariant over the keys the run touched (``invariants.touched_keys`` since the history
    version before the run), with the same stopwatch as a run."""
    with RunCost(spark) as cost:
        cost.lap("scope")
        scope = invariants.touched_keys(spark, paths, TABLE.key, since)
        cost.lap("checks")
        outcomes = invariants.run_checks(spark, paths, TABLE.key, scope)
    failed = [o.name for o in outcomes if not o.passed]
    if failed:
        raise SystemExit(f"an invariant failed after a benchmark run: {failed}")
    return cost.report()


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def print_stages(runs: Sequence[CostReport]) -> None:
    names = list(dict.fromkeys(s.name for r in runs for s in r.stages))
    seconds = {n: [s.seconds for r in runs for s in r.stages if s.name == n] for n in names}
    log(f"{'stage':<22} {'median s':>9} {'Spark jobs':>11}")
    for n in names:
        jobs = distinct_counts(s.spark_jobs for r in runs for s in r.stages if s.name == n)
        log(f"{n:<22} {median(seconds[n]):>9.3f} {jobs:>11}")
    jobs = distinct_counts(r.spark_jobs for r in runs)
    log(f"{'total':<22} {median([r.seconds for r in runs]):>9.3f} {jobs:>11}")


class DeltaOpens:
    """Counts the Delta logs a run reads while it is active: every ``DeltaTable`` opened (a
    snapshot loaded from its log) and every ``is_deltatable`` check (a listing of the log),
    whichever module makes them. Exact, unlike seconds: the table handle's figure (issue 33)."""

    def __init__(self) -> None:
        self.opened = 0
        self.checked = 0

    def __enter__(self) -> DeltaOpens:
        from deltalake import DeltaTable

        self._init, self._is = DeltaTable.__init__, DeltaTable.is_deltatable
        real_init, real_is = self._init, self._is

        def counted_init(table: Any, *args: Any, **kwargs: Any) -> None:
            self.opened += 1
            real_init(table, *args, **kwargs)

        def counted_is(*args: Any, **kwargs: Any) -> bool:
            self.checked += 1
            return real_is(*args, **kwargs)

        DeltaTable.__init__ = counted_init  # type: ignore[method-assign]
        DeltaTable.is_deltatable = staticmethod(counted_is)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from deltalake import DeltaTable

        DeltaTable.__init__ = self._init  # type: ignore[method-assign]
        DeltaTable.is_deltatable = staticmethod(self._is)  # type: ignore[method-assign]


def distinct_counts(counts: Iterable[int | None]) -> str:
    """The job counts the runs saw, "a/b" if they differ ("-": not counted)."""
    seen = {-1 if c is None else c for c in counts}
    return "/".join("-" if c < 0 else str(c) for c in sorted(seen))


def print_report(
    hour_events: int,
    ours: Sequence[CostReport],
    checks: Sequence[CostReport],
    refs: Sequence[CostReport],
    opens: Sequence[tuple[int, int]],
) -> None:
    """Stage by stage: the runs, their checks and the plain-Spark reference, then the ratios
    against the targets and what the last run read and rewrote."""
    log(f"\nmaterialize() of a {hour_events}-event hour, warm local[2], {len(ours)} runs:")
    print_stages(ours)
    log("\nthe checks that follow each run (scoped to the keys it touched):")
    print_stages(checks)
    check_s = median([r.seconds for r in checks])
    log(
        f"checks: {check_s:.2f} s (target <= {TARGET_CHECK_SECONDS:g} s warm: "
        f"{'met' if check_s <= TARGET_CHECK_SECONDS else 'NOT met'})"
    )
    log("\nsmall-hour reference (plain Spark, same session, same hours):")
    print_stages(refs)
    mine, ref_s = median([r.seconds for r in ours]), median([r.seconds for r in refs])
    jobs, ref_jobs = ours[-1].spark_jobs or 0, refs[-1].spark_jobs or 0
    log(
        f"\nratio: {mine / ref_s:.1f}x the reference's time ({mine:.2f} s vs {ref_s:.2f} s; "
        f"target <= {TARGET_TIME_RATIO:g}x: {'met' if mine <= TARGET_TIME_RATIO * ref_s else 'NOT met'}), "
        f"{jobs / max(ref_jobs, 1):.1f}x its Spark jobs ({jobs} vs {ref_jobs}; target <= "
        f"{TARGET_JOBS}: {'met' if jobs <= TARGET_JOBS else 'NOT met'})"
    )
    figures = ours[-1].figures()
    log(
        "last run: bytes read "
        + ", ".join(f"{k[11:]} {v:,}" for k, v in figures.items() if k.startswith("bytes_read/"))
        + "; bytes rewritten "
        + ", ".join(f"{k[16:]} {v:,}" for k, v in figures.items() if k.startswith("bytes_rewrit"))
        + f"; commits {figures['commits/total']}"
    )
    log(
        "Delta logs read per run (DeltaTable opened, is_deltatable checks): "
        + ", ".join(f"{o}+{c}" for o, c in opens)
    )


REFERENCE_STAGES = frozenset({"read_hour", "live_rows", "fold_write"})
CHECK_STAGES = frozenset({"scope", "checks"})


def window_of(stage: str) -> str | None:
    """Which measured window a job group's stage belongs to (None: a job outside a run)."""
    return (
        None
        if not stage
        else "reference"
        if stage in REFERENCE_STAGES
        else "checks"
        if stage in CHECK_STAGES
        else "materialize"
    )


def print_stage_jobs(
    jobs: dict[str, profile.Jobs], ours: Sequence[CostReport], checks: Sequence[CostReport]
) -> None:
    """Each stage's wall seconds beside its Spark jobs' (from the event log): what a stage
    spends outside a job is planning, analysis and round trips to the JVM."""
    runs = len(ours)
    rows = []
    for report in (ours, checks):
        for name in dict.fromkeys(st.name for r in report for st in r.stages):
            wall = sum(st.seconds for r in report for st in r.stages if st.name == name) / runs
            ran = jobs.get(name, profile.Jobs(0, 0.0))
            in_jobs = ran.seconds / runs
            rows.append([name, f"{wall:.3f}", f"{ran.count / runs:g}", f"{in_jobs:.3f}",
                         f"{wall - in_jobs:.3f}"])  # fmt: skip
    log(f"\neach stage's wall time and its Spark jobs' (event log), seconds per run ({runs} runs)")
    print_table(["stage", "wall s", "jobs", "in jobs s", "outside a job s"], rows)


def print_profile(
    driver: Path,
    event_logs: Sequence[Path],
    since_ms: int,
    ours: Sequence[CostReport],
    checks: Sequence[CostReport],
    refs: Sequence[CostReport],
) -> None:
    """The measured runs' wall time split by where it went (``harness.profile``)."""
    if not driver.exists():
        log("\nno profile: no measured hour was sampled (--repeats 0)")
        return
    stacks = profile.read_stacks(driver)
    files = [f for p in event_logs for f in profile.event_log_files(p)]
    jobs = profile.spark_jobs(files, window_of, since_ms)
    print_stage_jobs(profile.spark_jobs(files, lambda st: st or None, since_ms), ours, checks)
    for title, frame, window, runs in (
        ("materialize() of a small hour", "materialize", "materialize", ours),
        ("its checks", "hourly_checks", "checks", checks),
        ("the plain-Spark reference", "reference_hour", "reference", refs),
    ):
        wall = sum(r.seconds for r in runs) / len(runs)  # a mean, as the samples are
        seconds = profile.split(stacks, frame)
        profile.print_split(title, seconds, jobs.get(window), len(runs), wall)
        profile.print_calls(title, profile.jvm_calls(stacks, frame), len(runs))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--versions", type=int, default=100_000, help="events of the built table")
    p.add_argument("--keys", type=int, default=100_000, help="(at most --versions)")
    p.add_argument("--hour-events", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="measured hours (after one warm-up)")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/cdc_run_cost_bench"))
    p.add_argument("--profile", type=Path, help="write Spark's event log here")
    p.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting for this sitting (e.g. spark.sql.adaptive.enabled=false)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    keys = min(args.keys, args.versions)
    conf = dict(item.split("=", 1) for item in args.conf)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        conf |= {"spark.eventLog.enabled": "true", "spark.eventLog.dir": args.profile.as_uri()}
    spark = local_session("run_cost_bench", conf)
    landing = cached_hours(args.work_dir, keys, args.versions, args.seed)
    hours = landing.hours
    t0 = time.perf_counter()
    built, meta = build_cached_table(spark, landing)
    log(
        f"table: {meta['versions']:,} versions over {keys:,} keys, built in {meta['seconds']:.1f} s"
        f"{' (cached)' if meta['cached'] else ''} ({time.perf_counter() - t0:.1f} s now)"
    )
    run = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    warehouse, run_landing = run / "warehouse", run / "landing"
    shutil.copytree(built, warehouse)
    history = TablePaths.of(warehouse, TABLE.name).history.path
    gen = EventGenerator(keys, args.seed + 3000, first_seq=landing.next_seq)
    gen.seen = landing.seen.copy()

    paths = TablePaths.of(warehouse, TABLE.name)

    def small_hour(index: int) -> MaterializationOutcome:
        write_hour(run_landing, index, gen.events(args.hour_events, START_US + index * HOUR_US))
        return materialize(spark, TABLE, run_landing, warehouse, [hour_at(index)])

    ours: list[CostReport] = []
    refs: list[CostReport] = []
    checks: list[CostReport] = []
    opens: list[tuple[int, int]] = []
    spied = ExitStack()  # the driver's samples (--profile): the measured runs only
    since_ms = 0
    for attempt in range(args.repeats + 1):
        index = hours + attempt
        if attempt == 1 and args.profile:
            spied.enter_context(profile.Sampler(os.getpid(), args.profile / "driver.txt"))
            since_ms = int(time.time() * 1000)
        before = delta.open_table(history).version()
        with DeltaOpens() as counted:
            outcome = small_hour(index)
        checked = hourly_checks(spark, paths, before)
        ref = reference_hour(
            spark,
            hour_folder(run_landing, TABLE.name, hour_at(index)),
            history,
            run / f"reference-{index}",
        )
        if attempt and outcome.cost is not None:  # the first of each warms the session up
            opens.append((counted.opened, counted.checked))
            ours.append(outcome.cost)
            refs.append(ref)
            checks.append(checked)
    spied.close()
    print_report(args.hour_events, ours, checks, refs, opens)
    import pyspark

    app = spark.sparkContext.applicationId
    spark.stop()
    shutil.rmtree(run, ignore_errors=True)
    if args.profile:
        logs = sorted(args.profile.glob(f"*{app}*"))  # a folder when the log rolls
        print_profile(args.profile / "driver.txt", logs, since_ms, ours, checks, refs)
        log(
            f"\nevent log: {', '.join(map(str, logs)) or args.profile} (jobs tagged by job group "
            f"cdc_platform-run-<id>/<stage>). Open it with Spark's history server:\n"
            f"  SPARK_HISTORY_OPTS=-Dspark.history.fs.logDirectory={args.profile.as_uri()} "
            f"{Path(pyspark.__file__).parent / 'bin' / 'spark-class'} "
            "org.apache.spark.deploy.history.HistoryServer   # then http://localhost:18080"
        )


if __name__ == "__main__":
    main()
