"""The merge at scale (issue 8): its cost vs history depth, a backfill vs DuckDB, the fixed cost.

Prints figures, never asserts a time (it does assert that the backfill and the DuckDB reference
agree). Only public entry points are used: ``cdc_platform.lib.pipeline.materialize`` and the
Dagster CLI, so it measures the current merge and any redesign of it alike.

1. **Depth** (``--only depth``). History tables of about 100k, 1M and 10M versions over the
   same 100k keys (deeper history, not more keys), built from hourly landing folders of ~10k
   events (so depth = more hours) by ONE range ``materialize()`` call (timed, not measured).
   The first ``--keys`` events give every key its first event, so every size has the same
   live keys (~96%: the others' only event so far is a delete) and the sizes differ by depth
   alone (random keys alone would leave a third unseen at 100k, and the live segment, which an
   in-order hour rewrites, 1.6x smaller). The figures print the largest size against each
   smaller one; the target compares it with the smallest.
   Built tables are cached under ``--work-dir``, keyed by the parameters and by a hash of
   ``cdc_platform/lib`` (a table written by other code is rebuilt); every measured run works
   on a copy. Then one hour of 10k events is applied to each size twice, as separate rows:
   ``late`` (~98% in order, ~2% late events committed 2-3 days earlier on existing keys) and
   ``in-order`` (no late events). Per row: wall time of the ``materialize()`` call, bytes read
   from the change log and the history table (``changelog_bytes_read`` /
   ``history_bytes_read`` on the merge result when the code provides them, else n/a), bytes
   the history commit rewrote (sizes of its remove + add actions, read from
   ``_delta_log/<version>.json``, independent of the code under test), bytes the change-log
   commit added, removes + adds of any other Delta table under the warehouse ("other": the
   quarantine, or state tables a redesign adds), files touched (removes) and added, and the
   peak RSS of the whole process tree (Python + JVM + Python workers, VmRSS from /proc every
   50 ms; ``ru_maxrss`` misses the JVM). One unmeasured warm-up call comes first (a session's
   first merge is slower, which would flatter the ratio). Tables are found where the README
   puts them (``<warehouse>/bench``, ``<warehouse>/_cdc/bench/changelog``).
   **Target: time and bytes rewritten at 10M versions <= 1.3x those at 100k.**
2. **Backfill** (``--only backfill``). 720 hourly folders (30 days), 1M events over 100k keys,
   one range run through ``dagster asset materialize ... --partition-range first...last``
   (whole process timed; the run's step durations and the asset's own ``seconds`` are read back
   from the Dagster instance), then the same files folded by a single-node reference (DuckDB SQL
   window functions + ``deltalake.write_deltalake``). Both must give the same number of
   versions and active rows (and, up to ``--compare-limit`` events, the same rows ignoring
   ``_fivetran_synced``). **Target: Spark throughput >= 0.5x the reference's (parity is the
   goal).** Then Spark's own floor (issue 22, target 4): the same files folded by one Spark SQL
   query (``bulk_hour_cost``'s reference) as a whole ``python`` process from a cold JVM.
   **Target: the CLI range run within 1.5x of it.**
3. **Fixed cost** (``--only fixed``). With a warm in-process Spark session, ``materialize()`` of
   a 100-event hour into an existing table (median of 5, after one warm-up), and the whole
   ``dagster asset materialize`` process for a 100-event hour (median of ``--cli-runs``).
   **Targets: <= 1 s in-process, <= 5 s for the CLI process.** ``--spark-remote sc://host:port``
   (with ``--only fixed``) runs both over that Spark Connect server: the in-process calls use a
   session on it instead of local[2], and it is exported as ``CDC_SPARK_REMOTE`` to the Dagster
   CLI. Without the flag a ``CDC_SPARK_REMOTE`` of the shell is ignored (every run is local[2]),
   so a figure is never labelled with the wrong engine. For scale, the
   same CLI command on the same instance for an asset that does nothing (the process's floor:
   Python and Dagster start-up, the run's event log) is timed too.

Full run (the shared machine has 2 cores: run it alone; builds are cached for reruns)::

    cd <repo> && .venv/bin/python -m benchmarks.merge_at_scale
    .venv/bin/python -m benchmarks.merge_at_scale --only depth
    .venv/bin/python -m benchmarks.merge_at_scale --only backfill
    .venv/bin/python -m benchmarks.merge_at_scale --only fixed [--spark-remote sc://localhost:15002]

Quick check of the harness itself (minutes, not a measurement)::

    .venv/bin/python -m benchmarks.merge_at_scale --scale 0.01 --backfill-hours 24

``--scale`` multiplies every event and key count (sizes, keys, events per hour, the measured
hour, backfill events, the fixed-cost base table); hour counts, the 100-event fixed-cost hour
and the 5 repetitions are not scaled.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cdc_platform
from benchmarks.bulk_hour_cost import measured
from benchmarks.harness.generate import (
    CachedLanding,
    EventGenerator,
    build_cached_table,
    cached_landing,
    code_hash,
    landing_params,
    scaled,
    write_config,
    write_hour,
)
from benchmarks.harness.measure import (
    CliRun,
    Measurement,
    git_head,
    local_session,
    measured_materialize,
    merge_figure,
    run_dagster_cli,
    table_rows,
)
from benchmarks.harness.reference import compare_tables, reference_fold
from benchmarks.harness.report import (
    MB,
    describe_steps,
    fmt_mb,
    fmt_ratio,
    log,
    met,
    print_table,
    size_label,
    timed,
)
from benchmarks.harness.table import (
    DAY_US,
    HOUR_US,
    REPO_ROOT,
    START_US,
    TABLE_NAME,
    history_path,
    hour_at,
)
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.spark.connect import CONNECT_AUTH_ENV, DEFAULT_CONNECT_AUTH
from cdc_platform.lib.spark.deployment import SparkDeployment

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


LATE_FRACTION = 0.02
TARGET_DEPTH_RATIO = 1.3
TARGET_BACKFILL_RATIO = 0.5
TARGET_BACKFILL_FLOOR_RATIO = 1.5  # the CLI range run vs one Spark SQL query (issue 22)
TARGET_FIXED_IN_PROCESS_S = 1.0
TARGET_FIXED_CLI_S = 5.0


# --------------------------------------------------------------------------- 1. depth


@dataclass
class DepthRow:
    label: str
    variant: str
    versions: int
    table_bytes: int
    m: Measurement


def apply_hour(
    spark: SparkSession,
    cache: Path,
    warehouse: Path,
    landing: CachedLanding,
    args: argparse.Namespace,
    hours: int,
    name: str,
    n_late: int,
    keep: bool,
) -> Measurement:
    """Apply the measured hour (the same events every time) to a fresh copy of ``warehouse``."""
    keys = scaled(args.keys, args.scale)
    run_dir = cache / f"run-{size_label(landing.next_seq - 1)}-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_warehouse, run_landing = run_dir / "warehouse", run_dir / "landing"
    shutil.copytree(warehouse, run_warehouse)
    gen = EventGenerator(keys, args.seed + 1000 + hours, first_seq=landing.next_seq)
    gen.seen = landing.seen.copy()
    start = START_US + hours * HOUR_US
    window = (start - 3 * DAY_US, start - 2 * DAY_US)
    n = scaled(args.hour_events, args.scale)
    write_hour(run_landing, hours, gen.events(n, start, n_late, window))
    m = measured_materialize(spark, run_landing, run_warehouse, [hour_at(hours)])
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return m


def run_depth(spark: SparkSession, args: argparse.Namespace, work: Path) -> None:
    keys = scaled(args.keys, args.scale)
    eph = scaled(args.events_per_hour, args.scale)
    hour_events = scaled(args.hour_events, args.scale)
    late = max(1, round(hour_events * LATE_FRACTION))
    sizes = [scaled(s, args.scale) for s in args.sizes]
    log(
        f"\n== 1. Depth: history over the same {keys:,} keys, {eph:,} events/hour; measured hour "
        f"{hour_events:,} events ('late': {late:,} of them committed 2-3 days earlier on existing keys)"
    )
    cache = work / "depth"
    cache.mkdir(parents=True, exist_ok=True)
    rows: list[DepthRow] = []
    for size in sizes:
        label = size_label(size)
        hours = max(1, math.ceil(size / eph))
        landing = cached_landing(
            cache, landing_params(keys, size, hours, args.seed, every_key_first=True)
        )
        warehouse, meta = build_cached_table(spark, landing)
        log(
            f"  {label}: {meta['versions']:,} versions ({meta['active']:,} active), "
            f"{meta['bytes'] / MB:,.1f} MB of history from {meta['events']:,} events in {hours} hours; "
            f"build (one range call) {meta['seconds']:.1f} s{' (cached)' if meta['cached'] else ''}"
        )
        if not rows:  # the first call of a session is slower (JIT, caches): never measure it
            w = apply_hour(
                spark, cache, warehouse, landing, args, hours, "warm-up", late, keep=False
            )
            log(f"  warm-up call (not counted): {w.seconds:.2f} s")
        for variant in ("late", "in-order"):
            n_late = late if variant == "late" else 0
            runs = [
                apply_hour(
                    spark, cache, warehouse, landing, args, hours, variant, n_late, args.keep
                )
                for _ in range(args.depth_repeats)
            ]
            m = sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]  # the median run
            rows.append(DepthRow(label, variant, meta["versions"], meta["bytes"], m))
            log(f"  {label} {variant}: " + " ".join(f"{r.seconds:.2f}" for r in runs) + " s")

    print_depth_rows(rows)
    print_depth_ratios(rows, sizes)


def print_depth_rows(rows: Sequence[DepthRow]) -> None:
    """One line a measured call: its time, bytes read and rewritten, files and memory."""
    print()
    print_table(
        [
            "size",
            "hour",
            "versions",
            "history MB",
            "seconds",
            "CL read MB",
            "hist read MB",
            "rewritten MB",
            "(removed+added)",
            "CL added MB",
            "other MB",
            "files touched",
            "files added",
            "RSS before MiB",
            "peak RSS MiB",
        ],
        [
            [
                r.label,
                r.variant,
                f"{r.versions:,}",
                fmt_mb(r.table_bytes),
                f"{r.m.seconds:.2f}",
                fmt_mb(merge_figure(r.m.result, "changelog_bytes_read")),
                fmt_mb(merge_figure(r.m.result, "history_bytes_read")),
                fmt_mb(r.m.history.rewritten_bytes),
                f"{fmt_mb(r.m.history.removed_bytes)}+{fmt_mb(r.m.history.added_bytes)}",
                fmt_mb(r.m.changelog.added_bytes),
                fmt_mb(sum(c.rewritten_bytes for c in r.m.other.values())),
                r.m.history.files_removed,
                r.m.history.files_added,
                f"{r.m.rss_before / 2**20:,.0f}",
                f"{r.m.peak_rss / 2**20:,.0f}",
            ]
            for r in rows
        ],
    )
    log(
        "  RSS: VmRSS summed over this process tree (Python, JVM, Python workers); the JVM keeps "
        "its heap, so the peak includes the session's earlier high-water mark (see RSS before)"
    )
    others = sorted({name for r in rows for name in r.m.other})
    if others:
        log(f"  other MB: removes + adds of the other Delta tables the call committed to: {others}")
    commits = {len(r.m.history.versions) for r in rows}
    if commits != {1}:
        log(f"  note: history commits per measured call: {sorted(commits)} (figures sum them)")


def print_depth_ratios(rows: Sequence[DepthRow], sizes: Sequence[int]) -> None:
    """The largest size against each smaller one; the target compares it with the smallest."""
    hi = size_label(sizes[-1])
    for i, smaller in enumerate(sizes[:-1]):
        lo = size_label(smaller)
        target = i == 0  # the target compares with the smallest size
        print()
        for variant in ("late", "in-order"):
            small = next(r for r in rows if r.label == lo and r.variant == variant)
            big = next(r for r in rows if r.label == hi and r.variant == variant)
            for what, a, b in (
                ("time", big.m.seconds, small.m.seconds),
                ("bytes rewritten", big.m.history.rewritten_bytes, small.m.history.rewritten_bytes),
            ):
                ok = b > 0 and a / b <= TARGET_DEPTH_RATIO
                log(
                    f"  {variant:<8} {what:<16} {hi}/{lo} = {fmt_ratio(a, b):>7}"
                    + (f"  (target <= {TARGET_DEPTH_RATIO}x): {met(ok)}" if target else "")
                )


# --------------------------------------------------------------------------- CLI helpers


# The Dagster CLI's own cost: the same command and instance, an asset that does nothing.
NOOP_DEFINITIONS = '''"""An asset that does nothing: what `dagster asset materialize` costs by itself."""

import dagster as dg


@dg.asset(pool="noop")  # the table's asset claims its pool's slot too
def noop() -> None:
    """Nothing to do."""


defs = dg.Definitions(assets=[noop], executor=dg.in_process_executor)  # as the project's
'''


def run_dagster_noop(env: dict[str, str], run_dir: Path, name: str) -> CliRun:
    """``dagster asset materialize`` of a no-op asset with the run's instance and the project's
    executor (in-process): the floor under any materialization's process time (Python and
    Dagster start-up, the run's event log)."""
    module = run_dir / "noop_definitions.py"
    module.write_text(NOOP_DEFINITIONS)
    return run_dagster_cli(env, run_dir, [], name, ("-f", str(module), "--select", "noop"))


def latest_run_figures(home: Path) -> dict[str, Any]:
    """From the CLI's instance: the table's latest materialization metadata, and the seconds of
    each step of the latest run (key ``step:<name>``). Empty if the instance cannot be read."""
    try:
        import dagster as dg

        with dg.DagsterInstance.from_config(str(home)) as instance:
            out: dict[str, Any] = {}
            event = instance.get_latest_materialization_event(dg.AssetKey(TABLE_NAME))
            if event is not None and event.asset_materialization is not None:
                out.update({k: v.value for k, v in event.asset_materialization.metadata.items()})
            runs = instance.get_runs(limit=1)
            if runs:
                for stat in instance.get_run_step_stats(runs[0].run_id):
                    if stat.start_time and stat.end_time:
                        out[f"step:{stat.step_key}"] = stat.end_time - stat.start_time
            return out
    except Exception as exc:  # figures only: never fail the benchmark on this
        log(f"  (could not read the run from the Dagster instance: {exc})")
        return {}


# --------------------------------------------------------------------------- 2. backfill


def spark_floor(landing_root: Path, run_dir: Path, cli_seconds: float) -> None:
    """Spark's own floor (issue 22, target 4): one Spark SQL query over every landed file, as a
    whole python process from a cold JVM (bulk_hour_cost's reference, same query), against the
    CLI's range run."""
    spark_ref = measured("reference", landing_root, run_dir / "spark_reference", None)
    if "failed" in spark_ref:
        raise AssertionError(f"the Spark SQL reference failed: {spark_ref['failed']}")
    floor_ratio = cli_seconds / spark_ref["process_seconds"]
    log(
        f"  Spark SQL reference (one query, cold JVM, whole process): "
        f"{spark_ref['process_seconds']:.1f} s ({spark_ref['seconds']:.1f} s of work), "
        f"{spark_ref['versions']:,} versions; the CLI takes {floor_ratio:.2f}x "
        f"(target <= {TARGET_BACKFILL_FLOOR_RATIO}x: {met(floor_ratio <= TARGET_BACKFILL_FLOOR_RATIO)})"
    )


def run_backfill(args: argparse.Namespace, work: Path) -> None:
    keys = scaled(args.backfill_keys, args.scale)
    events = scaled(args.backfill_events, args.scale)
    hours = args.backfill_hours
    log(f"\n== 2. Backfill: {events:,} events over {keys:,} keys in {hours} hourly folders")
    cache = work / "backfill"
    cache.mkdir(parents=True, exist_ok=True)
    landing = cached_landing(cache, landing_params(keys, events, hours, args.seed))
    run_dir = cache / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    warehouse = run_dir / "warehouse"
    env = write_config(run_dir, landing.root, warehouse)
    first, last = hour_to_partition_key(hour_at(0)), hour_to_partition_key(hour_at(hours - 1))
    log(f"  dagster asset materialize --select {TABLE_NAME} --partition-range {first}...{last}")
    cli = run_dagster_cli(env, run_dir, ["--partition-range", f"{first}...{last}"], "backfill")
    history = history_path(warehouse)
    versions, active = table_rows(history)
    meta = latest_run_figures(run_dir / "dagster_home")
    log(
        f"  Dagster CLI: {cli.seconds:.1f} s whole process, peak RSS of its tree "
        f"{cli.peak_rss / 2**20:,.0f} MiB; events_read {meta.get('events_read', 'n/a')}, "
        f"delta_version {meta.get('delta_version', 'n/a')}\n  {describe_steps(meta)}"
    )

    ref_path = run_dir / "reference"
    ref_seconds, reference = reference_fold(landing.root, ref_path, datetime.now(UTC))
    ref_versions, ref_active = table_rows(ref_path)
    log(f"  DuckDB reference fold + write_deltalake: {ref_seconds:.1f} s")

    spark_floor(landing.root, run_dir, cli.seconds)

    spark_tput, ref_tput = events / cli.seconds, events / ref_seconds
    ratio = spark_tput / ref_tput
    print()
    print_table(
        ["engine", "seconds", "events/s", "versions", "active"],
        [
            [
                "Spark (Dagster CLI)",
                f"{cli.seconds:.1f}",
                f"{spark_tput:,.0f}",
                f"{versions:,}",
                f"{active:,}",
            ],
            [
                "DuckDB + delta-rs",
                f"{ref_seconds:.1f}",
                f"{ref_tput:,.0f}",
                f"{ref_versions:,}",
                f"{ref_active:,}",
            ],
        ],
    )
    log(
        f"  throughput ratio Spark/reference = {ratio:.3f} (target >= {TARGET_BACKFILL_RATIO}): {met(ratio >= TARGET_BACKFILL_RATIO)}"
    )
    problems = []
    if (versions, active) != (ref_versions, ref_active):
        problems.append(
            f"versions/active differ: {versions:,}/{active:,} vs {ref_versions:,}/{ref_active:,}"
        )
    if events <= args.compare_limit:
        from deltalake import DeltaTable

        diff = compare_tables(DeltaTable(str(history)).to_pyarrow_table(), reference)
        if diff:
            problems.append(f"rows differ: {diff}")
        else:
            log(f"  same rows as the reference ({versions:,} versions, ignoring _fivetran_synced)")
    if problems:
        raise AssertionError("backfill and reference disagree: " + "; ".join(problems))
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


# --------------------------------------------------------------------------- 3. fixed cost


def print_fixed(
    small: int,
    remote: str | None,
    in_process: Sequence[float],
    cli: Sequence[CliRun],
    noop: Sequence[CliRun],
) -> None:
    """The medians against their targets, beside the no-op asset's (the CLI's floor)."""
    med_in, med_cli = statistics.median(in_process), statistics.median(c.seconds for c in cli)
    med_noop = statistics.median(c.seconds for c in noop)
    print()
    print_table(
        ["what", "median s", "runs (s)", "target", ""],
        [
            [
                f"materialize() in-process, warm Spark{' Connect' if remote else ''}, {small} events",
                f"{med_in:.2f}",
                " ".join(f"{s:.2f}" for s in in_process),
                f"<= {TARGET_FIXED_IN_PROCESS_S:g} s",
                met(med_in <= TARGET_FIXED_IN_PROCESS_S),
            ],
            [
                f"dagster asset materialize process, {small} events",
                f"{med_cli:.2f}",
                " ".join(f"{c.seconds:.2f}" for c in cli),
                f"<= {TARGET_FIXED_CLI_S:g} s",
                met(med_cli <= TARGET_FIXED_CLI_S),
            ],
            [
                "dagster asset materialize process, a no-op asset",
                f"{med_noop:.2f}",
                " ".join(f"{c.seconds:.2f}" for c in noop),
                "(the CLI's floor)",
                "",
            ],
        ],
    )


def run_fixed(spark: SparkSession, args: argparse.Namespace, work: Path) -> None:
    keys = scaled(args.keys, args.scale)
    base_events = scaled(args.fixed_base_events, args.scale)
    eph = scaled(args.events_per_hour, args.scale)
    small = args.fixed_events
    remote = args.spark_remote
    log(
        f"\n== 3. Fixed cost: {small}-event hours into a table built from {base_events:,} events "
        f"over {keys:,} keys"
    )
    if remote:
        log(
            f"  over Spark Connect at {remote}: the in-process calls and the CLI (CDC_SPARK_REMOTE)"
        )
    cache = work / "fixed"
    cache.mkdir(parents=True, exist_ok=True)
    base_hours = max(1, math.ceil(base_events / eph))
    landing = cached_landing(cache, landing_params(keys, base_events, base_hours, args.seed))
    cached, meta = build_cached_table(spark, landing)
    log(
        f"  base table: {meta['versions']:,} versions, build {meta['seconds']:.1f} s{' (cached)' if meta['cached'] else ''}"
    )

    run_dir = cache / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    warehouse, run_landing = run_dir / "warehouse", run_dir / "landing"
    shutil.copytree(cached, warehouse)
    gen = EventGenerator(keys, args.seed + 2000, first_seq=landing.next_seq)
    gen.seen = landing.seen.copy()
    next_hour = base_hours

    def small_hour() -> int:
        nonlocal next_hour
        index = next_hour
        next_hour += 1
        write_hour(run_landing, index, gen.events(small, START_US + index * HOUR_US))
        return index

    in_process: list[float] = []
    for attempt in range(args.fixed_repeats + 1):
        index = small_hour()
        m = measured_materialize(spark, run_landing, warehouse, [hour_at(index)])
        if attempt:  # the first call warms up the session
            in_process.append(m.seconds)
    env = write_config(run_dir, run_landing, warehouse)
    cli: list[CliRun] = []
    for n in range(args.cli_runs):
        index = small_hour()
        cli.append(
            run_dagster_cli(
                env, run_dir, ["--partition", hour_to_partition_key(hour_at(index))], f"fixed-{n}"
            )
        )
    meta = latest_run_figures(run_dir / "dagster_home")  # before the no-op runs: the latest run
    noop = [run_dagster_noop(env, run_dir, f"noop-{n}") for n in range(args.cli_runs)]

    print_fixed(small, remote, in_process, cli, noop)
    log(
        f"  last CLI run: peak RSS of its process tree {cli[-1].peak_rss / 2**20:,.0f} MiB; "
        f"{describe_steps(meta)}; Spark: "
        + (f"remote {remote}" if remote else "local[2] started by the run")
    )
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--only", choices=("depth", "backfill", "fixed"), help="run one section")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every event/key count")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/cdc_scale_bench"))
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--keep", action="store_true", help="keep the measured copies and run dirs")
    g = p.add_argument_group("depth")
    g.add_argument(
        "--sizes",
        type=lambda s: [int(float(x)) for x in s.split(",")],
        default=[100_000, 1_000_000, 10_000_000],
        help="history sizes in events (comma-separated; ~95%% become versions)",
    )
    g.add_argument("--keys", type=int, default=100_000)
    g.add_argument("--events-per-hour", type=int, default=10_000)
    g.add_argument("--hour-events", type=int, default=10_000, help="events of the measured hour")
    g.add_argument(
        "--depth-repeats", type=int, default=1, help="measured runs per row (the median is shown)"
    )
    g = p.add_argument_group("backfill")
    g.add_argument("--backfill-hours", type=int, default=720)
    g.add_argument("--backfill-events", type=int, default=1_000_000)
    g.add_argument("--backfill-keys", type=int, default=100_000)
    g.add_argument(
        "--compare-limit",
        type=int,
        default=2_000_000,
        help="compare every row with the reference up to this many events",
    )
    g = p.add_argument_group("fixed cost")
    g.add_argument(
        "--fixed-events", type=int, default=100, help="events of a small hour (not scaled)"
    )
    g.add_argument("--fixed-base-events", type=int, default=100_000)
    g.add_argument("--fixed-repeats", type=int, default=5)
    g.add_argument("--cli-runs", type=int, default=3)
    g.add_argument(
        "--spark-remote",
        help="sc://host:port: run the fixed-cost section over Spark Connect (needs --only fixed)",
    )
    return p.parse_args(argv)


@contextmanager
def spark_session(needed: bool, remote: str | None) -> Iterator[SparkSession | None]:
    """local[2] in this process, or a session on the Spark Connect server at ``remote``."""
    if not needed:
        yield None
        return
    if remote:
        spark = SparkDeployment.from_env().session(
            {"spark.sql.shuffle.partitions": "4"}, "scale_bench"
        )
    else:
        spark = local_session("scale_bench")
    try:
        yield spark
    finally:
        spark.stop()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.spark_remote and args.only != "fixed":
        # Depth and backfill measure the memory of this process tree, which holds no server.
        raise SystemExit("--spark-remote measures the fixed-cost section: add --only fixed")
    # Only the flag selects Connect: the in-process calls and the Dagster CLI then agree.
    os.environ.pop("CDC_SPARK_REMOTE", None)
    if args.spark_remote:
        os.environ["CDC_SPARK_REMOTE"] = args.spark_remote
        # `make spark-connect`'s auth file, unless the shell names another (the CLI runs elsewhere).
        os.environ.setdefault(CONNECT_AUTH_ENV, str(REPO_ROOT / DEFAULT_CONNECT_AUTH))
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    script_repo = Path(__file__).resolve().parents[1]
    log(
        f"cdc_platform {cdc_platform.__file__} (git {git_head()}, lib hash {code_hash()}), "
        f"scale {args.scale:g}, work dir {work}, {os.cpu_count()} cores"
    )
    if script_repo != REPO_ROOT:
        log(f"WARNING: this script is in {script_repo} but measures the package in {REPO_ROOT}")
    sections: dict[str, Callable[[SparkSession | None], None]] = {
        "depth": lambda s: run_depth(s, args, work),  # type: ignore[arg-type]
        "backfill": lambda s: run_backfill(args, work),
        "fixed": lambda s: run_fixed(s, args, work),  # type: ignore[arg-type]
    }
    chosen = [args.only] if args.only else list(sections)
    # The backfill's Dagster run starts its own Spark: run it first, with no idle JVM beside it.
    if "backfill" in chosen:
        timed("backfill", lambda: sections["backfill"](None))
    with spark_session(any(c != "backfill" for c in chosen), args.spark_remote) as spark:
        for name in chosen:
            if name != "backfill":
                timed(name, lambda name=name: sections[name](spark))


if __name__ == "__main__":
    main()
