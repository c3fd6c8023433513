"""Freshness, the figure users feel (issue 22, target 6): from a file landing to its events in
the history table, through the deployment as ``deploy/`` wires it.

Everything is set up under ``--work-dir`` (default ``/tmp/cdc_freshness_bench``, emptied at each
start): a DAGSTER_HOME holding ``deploy/dagster.yaml`` with its PostgreSQL storage replaced by
SQLite (run queue, pools, launcher and run monitoring as they are), a config file
(``CDC_PLATFORM_CONFIG``) with one table whose landing sensor ticks every ``--sensor-interval``
seconds, and a landing root and warehouse. A Spark Connect server is started with
``cdc_platform.connect_server`` and the code location reaches it through ``CDC_SPARK_REMOTE`` and
``CDC_SPARK_CONNECT_AUTH`` (``--local``: no server, each run starts its own local[2] Spark). The
code server and the daemon run the ``ExecStart=`` lines of ``deploy/systemd`` (``dagster api grpc
-m cdc_platform.definitions``, waited for by its ``ExecStartPost=`` health check, and
``dagster-daemon run`` on ``deploy/workspace.yaml``); the table's landing sensor is started with
``dagster sensor start`` and waited for until it has ticked once.

Then ``--warmup`` unmeasured hours and ``--hours`` measured ones land ONE AT A TIME, each a new
hour folder of the sensor's lookback window holding one Parquet file of ``--events`` events
(the harness's generator; ``A..B`` draws each hour's count). Each lands at a random point of the
sensor's interval, written under a hidden name and renamed into place (the landing time). The
history table is polled (``cdc_platform.read.as_of_arrow`` at the hour's last millisecond) until
every key of the hour holds its last event; the run is waited for before the next hour lands.
Per hour, from the Dagster instance's records (the sensor's ticks, the run's event log):

- tick: landing -> start of the sensor tick that requested the run (waiting for the interval)
- sensor: landing -> run enqueued (the tick's evaluation included)
- queue: enqueued -> run starting (the daemon's dequeue loop)
- launch: starting -> run started (the run worker's process starts and loads the code)
- start: run started -> the asset's step starts
- merge, checks: the asset step and the checks step
- rest: ``done`` minus the parts from ``sensor`` to ``checks`` (between the steps, the run's end)
- visible: landing -> the history table's commit holding the hour (the mtime of its
  ``_delta_log`` file): the freshness a reader sees, since the checks run after that commit
- done: landing -> run success, checks included

Then p50 and p95 of every column, beside the issue's targets (p50 <= 20 s, p95 <= 40 s with the
sensor at 10 s), what Dagster costs around the two Spark steps (done - merge - checks: about the
floor a no-op asset would leave) and how often the sensor really ticked. Every process it
started is stopped at the end, Ctrl-C included.

Run it alone (2 shared cores: seconds are indicative)::

    .venv/bin/python -m benchmarks.freshness                        # 10 hours over Spark Connect
    .venv/bin/python -m benchmarks.freshness --hours 2 --events 50  # a quick check of the harness
    .venv/bin/python -m benchmarks.freshness --local                # each run starts its own JVM
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from deltalake import DeltaTable

from benchmarks.harness.deployment import (
    DEPLOY,
    POLL_S,
    BenchError,
    Layout,
    Stack,
    run_until_stopped,
    service_env,
    start_code_server,
    start_connect,
    unit_command,
    wait_for,
    write_instance,
)
from benchmarks.harness.generate import EventGenerator, hour_events
from benchmarks.harness.measure import git_head, percentile
from benchmarks.harness.report import log, met, print_table
from benchmarks.harness.table import BIN, HOUR_US
from cdc_platform import connect_server
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tags import PARTITION_TAG
from cdc_platform.lib.config import REPO_ROOT, load_config
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform.read import as_of_arrow

if TYPE_CHECKING:
    from dagster._core.scheduler.instigation import InstigatorTick

TABLE = "freshness"
SENSOR = f"{TABLE}_landing_sensor"
SENSOR_TAG = "dagster/sensor_name"  # Dagster's tag on a sensor's runs
MARKER = ".cdc_freshness_bench"  # a work dir holding it may be emptied
TARGET_P50_S = 20.0
TARGET_P95_S = 40.0
TARGET_SENSOR_INTERVAL_S = 10
RUN_EVENTS = {
    dg.DagsterEventType.RUN_ENQUEUED,
    dg.DagsterEventType.RUN_STARTING,
    dg.DagsterEventType.RUN_START,
    dg.DagsterEventType.RUN_SUCCESS,
    dg.DagsterEventType.STEP_START,
    dg.DagsterEventType.STEP_SUCCESS,
}
COLUMNS = ("tick", "sensor", "queue", "launch", "start", "merge", "checks", "rest")
TOTALS = ("visible", "done")


# --------------------------------------------------------------------------- the services


def start_sensor(stack: Stack) -> None:
    """``dagster sensor start`` on the deployment's workspace (a no-op for a sensor that is
    running by default, as the landing sensors are; it makes sure)."""
    argv = [str(BIN / "dagster"), "sensor", "start", SENSOR]
    argv += ["--workspace", str(DEPLOY / "workspace.yaml")]
    proc = subprocess.run(
        argv, cwd=REPO_ROOT, env=stack.env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise BenchError(f"{shlex.join(argv)} failed:\n{proc.stdout}{proc.stderr}")


# --------------------------------------------------------------------------- the deployment


def prepare_work_dir(work: Path) -> Layout:
    """An empty work dir: a folder this benchmark made before is emptied, any other refused."""
    work = work.resolve()
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).is_file():
            raise BenchError(
                f"{work} is not empty and was not made by this benchmark: choose another"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by benchmarks.freshness; emptied at each start\n")
    layout = Layout.under(work)
    for folder in (layout.home, layout.landing, layout.warehouse):
        folder.mkdir()
    return layout


def write_config(layout: Layout, first_hour: datetime, hours: int, interval: int) -> None:
    """One table; its lookback window holds every hour this run lands (the sensor's ticks list
    only that window), with room for the clock to pass an hour meanwhile."""
    table = {
        "name": TABLE,
        "primary_key": ["id"],
        "start": hour_to_partition_key(first_hour),
        "sensor_interval_seconds": interval,
        "lookback_hours": hours + 2,
    }
    config = {
        "landing_root": str(layout.landing),
        "warehouse_root": str(layout.warehouse),
        "tables": [table],
    }
    layout.config.write_text(json.dumps(config, indent=2))  # JSON is YAML


def wait_first_tick(stack: Stack, instance: dg.DagsterInstance, timeout: float) -> None:
    wait_for(stack, f"a first tick of {SENSOR}", lambda: sensor_ticks(instance), timeout)


# --------------------------------------------------------------------------- landing and polling


@dataclass(frozen=True)
class Expected:
    """What the history table holds, as of the hour's last millisecond, once the hour is in."""

    instant: datetime
    images: dict[int, float]  # key -> amount of its last event, for keys it leaves live
    deleted: frozenset[int]  # keys whose last event in the hour is a delete


@dataclass(frozen=True)
class Landed:
    hour: datetime
    events: int
    at: float  # wall clock (time.time(), as Dagster's records) when the file appeared
    version_before: int  # the history table's version then (-1: no table yet)
    expected: Expected

    @property
    def partition(self) -> str:
        return hour_to_partition_key(self.hour)


def expected_state(events: pa.Table, hour: datetime) -> Expected:
    last: dict[int, dict] = {}
    rows = events.to_pylist()
    for row in sorted(rows, key=lambda r: (r["cdc_commit_timestamp"], r["cdc_change_seq"])):
        last[row["id"]] = row
    images = {k: r["amount"] for k, r in last.items() if r["cdc_operation_type"] != "DELETE"}
    deleted = frozenset(k for k, r in last.items() if r["cdc_operation_type"] == "DELETE")
    instant = hour + timedelta(microseconds=HOUR_US - 1000)
    return Expected(instant, images, deleted)


def history_version(history: Path) -> int:
    if not DeltaTable.is_deltatable(str(history)):
        return -1
    return DeltaTable(str(history)).version()


def land(layout: Layout, hour: datetime, events: pa.Table, history: Path) -> Landed:
    """One Parquet file in the hour's folder, renamed into place: the sensor never sees a
    half-written file (hidden names are not landing data)."""
    folder = hour_folder(layout.landing, TABLE, hour)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"part-{hour:%Y%m%d%H}.parquet"
    pq.write_table(events, folder / f".{name}.tmp")
    before = history_version(history)
    os.replace(folder / f".{name}.tmp", folder / name)
    landed_at = time.time()
    return Landed(hour, events.num_rows, landed_at, before, expected_state(events, hour))


def holds(history: Path, version: int, expected: Expected) -> bool:
    """Whether ``version`` of the history table holds the hour: each of its keys as its last
    event left it, read as of the hour's last millisecond with the project's read API."""
    keys = [*expected.images, *expected.deleted]
    dataset = as_of_arrow(history, expected.instant, version=version)
    rows = dataset.to_table(columns=["id", "amount"], filter=ds.field("id").isin(keys))
    found = dict(zip(rows.column("id").to_pylist(), rows.column("amount").to_pylist(), strict=True))
    return all(found.get(k) == v for k, v in expected.images.items()) and not (
        expected.deleted & found.keys()
    )


def commit_time(history: Path, version: int) -> float:
    """When a commit became visible: the mtime of its ``_delta_log`` file."""
    return (history / "_delta_log" / f"{version:020d}.json").stat().st_mtime


def visible_at(history: Path, landed: Landed) -> float | None:
    """The commit time of the first version holding the hour, or None if none does yet."""
    latest = history_version(history)
    if latest <= landed.version_before or not holds(history, latest, landed.expected):
        return None
    for version in range(landed.version_before + 1, latest + 1):
        if holds(history, version, landed.expected):
            return commit_time(history, version)
    return None


def sensor_runs(instance: dg.DagsterInstance, partition: str) -> list[dg.RunRecord]:
    tags = {SENSOR_TAG: SENSOR, PARTITION_TAG: partition}
    return list(instance.get_run_records(filters=dg.RunsFilter(tags=tags)))


def run_failure(instance: dg.DagsterInstance, run_id: str) -> str:
    """The messages of the run's failure events."""
    lines = [
        e.message or str(e.dagster_event.event_specific_data if e.dagster_event else "")
        for e in instance.all_logs(run_id)
        if e.dagster_event is not None and e.dagster_event.is_failure
    ]
    return "\n".join(lines) or "(no failure event)"


def wait_for_hour(
    stack: Stack, instance: dg.DagsterInstance, history: Path, landed: Landed, timeout: float
) -> tuple[float, str]:
    """Poll until the hour is in the history table and its run has succeeded: (the commit time,
    the run id)."""
    deadline = time.monotonic() + timeout
    seen: float | None = None
    failed = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
    while True:
        stack.check_alive()
        records = sensor_runs(instance, landed.partition)
        for record in records:
            if record.dagster_run.status in failed:
                run_id = record.dagster_run.run_id
                raise BenchError(
                    f"run {run_id} of {landed.partition} ended {record.dagster_run.status.value}:"
                    f"\n{run_failure(instance, run_id)}\n{stack.tails()}"
                )
        if seen is None:
            seen = visible_at(history, landed)
        done = [r for r in records if r.dagster_run.status == dg.DagsterRunStatus.SUCCESS]
        if done and seen is None:
            seen = visible_at(history, landed)  # the run may have ended since the last look
            if seen is None:
                raise BenchError(
                    f"run {done[0].dagster_run.run_id} of {landed.partition} succeeded but the "
                    f"history table does not hold the hour's events"
                )
        if done and seen is not None:
            return seen, done[0].dagster_run.run_id
        if time.monotonic() > deadline:
            what = "its events are not in the history table" if seen is None else "its run"
            runs = [f"{r.dagster_run.run_id} {r.dagster_run.status.value}" for r in records]
            raise BenchError(
                f"hour {landed.partition}: {what} not done {timeout:.0f} s after landing "
                f"(runs: {runs or 'none'})\n{stack.tails()}"
            )
        time.sleep(POLL_S)


# --------------------------------------------------------------------------- the breakdown


def sensor_ticks(
    instance: dg.DagsterInstance, after: float | None = None
) -> Sequence[InstigatorTick]:
    ticks: list[InstigatorTick] = []
    for state in instance.all_instigator_state():
        if state.instigator_name == SENSOR:
            ticks += instance.get_ticks(state.instigator_origin_id, state.selector_id, after=after)
    return ticks


def tick_start(instance: dg.DagsterInstance, run_id: str, after: float) -> float | None:
    """When the tick that requested the run started."""
    for tick in sensor_ticks(instance, after=after - 60):
        if run_id in tick.run_ids:
            return tick.timestamp
    return None


def tick_gaps(instance: dg.DagsterInstance) -> list[float]:
    """Seconds between the starts of the sensor's consecutive ticks."""
    starts = sorted(t.timestamp for t in sensor_ticks(instance))
    return [b - a for a, b in itertools.pairwise(starts)]


def other_runs(instance: dg.DagsterInstance) -> int:
    """Runs that the landing sensor did not request (a schedule's, say)."""
    return sum(r.dagster_run.tags.get(SENSOR_TAG) != SENSOR for r in instance.get_run_records())


def run_timeline(
    instance: dg.DagsterInstance, run_id: str
) -> dict[tuple[str | None, dg.DagsterEventType], float]:
    """(step key or None, event type) -> the first such event's time, from the run's records."""
    out: dict[tuple[str | None, dg.DagsterEventType], float] = {}
    records = instance.get_records_for_run(run_id, of_type=RUN_EVENTS).records
    for record in records:
        entry = record.event_log_entry
        if entry.dagster_event is not None:
            key = (entry.dagster_event.step_key, entry.dagster_event.event_type)
            out.setdefault(key, entry.timestamp)
    return out


@dataclass(frozen=True)
class StepKeys:
    merge: str
    checks: str


def step_keys(config: Path) -> StepKeys:
    """The op names of the table's asset and checks, from the project's own factory."""
    platform = load_config(config)
    defs = build_table_definitions(platform, platform.table(TABLE))
    return StepKeys(defs.asset.node_def.name, defs.checks.node_def.name)


@dataclass(frozen=True)
class HourFigures:
    partition: str
    events: int
    warmup: bool
    seconds: dict[str, float | None]  # COLUMNS and TOTALS


def diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


def breakdown(
    instance: dg.DagsterInstance,
    steps: StepKeys,
    landed: Landed,
    visible: float,
    run_id: str,
    warmup: bool,
) -> HourFigures:
    t = run_timeline(instance, run_id)
    E = dg.DagsterEventType
    enqueued, starting = t.get((None, E.RUN_ENQUEUED)), t.get((None, E.RUN_STARTING))
    started, ended = t.get((None, E.RUN_START)), t.get((None, E.RUN_SUCCESS))
    merge0, merge1 = t.get((steps.merge, E.STEP_START)), t.get((steps.merge, E.STEP_SUCCESS))
    check0, check1 = t.get((steps.checks, E.STEP_START)), t.get((steps.checks, E.STEP_SUCCESS))
    seconds: dict[str, float | None] = {
        "tick": diff(tick_start(instance, run_id, landed.at), landed.at),
        "sensor": diff(enqueued, landed.at),
        "queue": diff(starting, enqueued),
        "launch": diff(started, starting),
        "start": diff(merge0, started),
        "merge": diff(merge1, merge0),
        "checks": diff(check1, check0),
        "visible": visible - landed.at,
        "done": diff(ended, landed.at),
    }
    parts = [seconds[c] for c in COLUMNS[1:-1]]
    done = seconds["done"]
    seconds["rest"] = None if done is None or None in parts else done - sum(p or 0 for p in parts)
    return HourFigures(landed.partition, landed.events, warmup, seconds)


# --------------------------------------------------------------------------- the report


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def column_values(figures: Sequence[HourFigures], name: str) -> list[float]:
    return [v for f in figures if (v := f.seconds[name]) is not None]


def print_hours(figures: Sequence[HourFigures]) -> None:
    headers = ["hour", "events", *COLUMNS, *TOTALS]
    rows = [
        [
            f"{f.partition}{' (warm-up)' if f.warmup else ''}",
            f.events,
            *(fmt(f.seconds[c]) for c in (*COLUMNS, *TOTALS)),
        ]
        for f in figures
    ]
    print_table(headers, rows)


def print_percentiles(figures: Sequence[HourFigures]) -> None:
    rows = []
    for q in (50, 95):
        cells = []
        for name in (*COLUMNS, *TOTALS):
            values = column_values(figures, name)
            cells.append(fmt(percentile(values, q)) if values else "n/a")
        rows.append([f"p{q}", "", *cells])
    print_table(["", "", *COLUMNS, *TOTALS], rows)


def orchestration(figure: HourFigures) -> float | None:
    """What the hour's run cost around its two Spark steps."""
    done, merge, checks = (figure.seconds[n] for n in ("done", "merge", "checks"))
    if done is None or merge is None or checks is None:
        return None
    return done - merge - checks


def print_targets(figures: Sequence[HourFigures], interval: int, spark: str) -> None:
    log(f"\nSpark: {spark}; sensor interval {interval} s; {len(figures)} measured hour(s)")
    if interval != TARGET_SENSOR_INTERVAL_S:
        log(f"  (the targets are set for a sensor at {TARGET_SENSOR_INTERVAL_S} s)")
    labels = {
        "visible": "freshness: landing -> events in the history table",
        "done": "landing -> run done, checks included",
    }
    for name, label in labels.items():
        values = column_values(figures, name)
        p50, p95 = percentile(values, 50), percentile(values, 95)
        log(
            f"  {label}: p50 {p50:.1f} s (target <= {TARGET_P50_S:.0f} s: "
            f"{met(p50 <= TARGET_P50_S)}), p95 {p95:.1f} s (target <= {TARGET_P95_S:.0f} s: "
            f"{met(p95 <= TARGET_P95_S)})"
        )
    floor = [v for f in figures if (v := orchestration(f)) is not None]
    if floor:
        log(
            f"  Dagster around the two Spark steps (done - merge - checks, what a no-op asset "
            f"would cost): p50 {percentile(floor, 50):.1f} s, p95 {percentile(floor, 95):.1f} s"
        )


# --------------------------------------------------------------------------- main


def parse_events(text: str) -> tuple[int, int]:
    """``N`` or ``A..B`` (each hour draws its count from A..B)."""
    low, _, high = text.partition("..")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or A..B, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return bounds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cdc_freshness_bench"))
    parser.add_argument("--hours", type=int, default=10, help="measured hours (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured hours first (default 1)")
    parser.add_argument(
        "--events", type=parse_events, default=(1, 100), help="events per hour: N or A..B"
    )
    parser.add_argument("--keys", type=int, default=1000, help="keys the events draw from")
    parser.add_argument("--sensor-interval", type=int, default=TARGET_SENSOR_INTERVAL_S)
    parser.add_argument("--local", action="store_true", help="local[2] Spark, no Connect server")
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--hour-timeout", type=float, default=600.0, help="seconds per hour")
    args = parser.parse_args(argv)
    if args.hours < 1 or args.warmup < 0:
        parser.error("--hours must be >= 1 and --warmup >= 0")
    return args


def measure(args: argparse.Namespace, stack: Stack, layout: Layout, hours: list[datetime]) -> None:
    """Start the deployment, land the hours one at a time, print the figures."""
    remote, auth = start_connect(stack) if not args.local else (None, None)
    spark = f"Spark Connect at {remote}" if remote else "local mode (each run starts its own JVM)"
    stack.env = service_env(layout, connect_server.free_port(), remote, auth)
    log(f"{spark}; starting the code server and the daemon")
    start_code_server(stack, args.startup_timeout)
    stack.start("daemon", unit_command("cdc-platform-daemon.service", "ExecStart", stack.env))
    start_sensor(stack)
    history = Path(TablePaths.of(load_config(layout.config).warehouse_root, TABLE).history.path)
    steps = step_keys(layout.config)
    rng = random.Random(args.seed)
    gen = EventGenerator(args.keys, args.seed)
    figures: list[HourFigures] = []
    with dg.DagsterInstance.from_config(str(layout.home)) as instance:
        wait_first_tick(stack, instance, args.startup_timeout)
        log(f"{SENSOR} has ticked; landing {len(hours)} hour(s) one at a time")
        for index, hour in enumerate(hours):
            warmup = index < args.warmup
            time.sleep(rng.uniform(0, args.sensor_interval))  # any point of the interval
            events = hour_events(gen, hour, rng.randint(*args.events))
            landed = land(layout, hour, events, history)
            seen, run_id = wait_for_hour(stack, instance, history, landed, args.hour_timeout)
            figure = breakdown(instance, steps, landed, seen, run_id, warmup)
            if len(runs := sensor_runs(instance, landed.partition)) > 1:
                log(f"  note: {len(runs)} runs of {landed.partition}; measured {run_id}")
            figures.append(figure)
            log(
                f"  {figure.partition}{' (warm-up)' if warmup else ''}: {figure.events} events, "
                f"visible {fmt(figure.seconds['visible'])} s, done {fmt(figure.seconds['done'])} s"
            )
        gaps = tick_gaps(instance)
        others = other_runs(instance)
    log("")
    print_hours(figures)
    measured = [f for f in figures if not f.warmup]
    log("")
    print_percentiles(measured)
    print_targets(measured, args.sensor_interval, spark)
    if gaps:
        log(
            f"  {SENSOR} ticked every {percentile(gaps, 50):.1f} s (p50), "
            f"{max(gaps):.1f} s at most, set to {args.sensor_interval} s"
        )
    if others:
        log(f"  WARNING: {others} other run(s) (schedules) ran meanwhile, beside the measured ones")


def hour_slots(count: int, now: datetime) -> list[datetime]:
    """The ``count`` most recent closed hours, oldest first: all in the sensor's lookback."""
    current = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return [current - timedelta(hours=count - i) for i in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        layout = prepare_work_dir(args.work_dir)
    except BenchError as exc:
        log(f"FAILED: {exc}")
        return 1
    hours = hour_slots(args.warmup + args.hours, datetime.now(UTC))
    write_instance(layout.home)
    write_config(layout, hours[0], len(hours), args.sensor_interval)
    log(
        f"cdc_platform freshness (git {git_head()}), {os.cpu_count()} cores, work dir "
        f"{layout.work}; events per hour {args.events[0]}..{args.events[1]}"
    )
    stack = Stack(layout.work)

    def stop() -> None:
        log("stopping the services")
        stack.stop()

    return run_until_stopped(lambda: measure(args, stack, layout, hours), stop)


if __name__ == "__main__":
    sys.exit(main())
