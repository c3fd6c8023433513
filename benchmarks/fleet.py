"""A fleet of tables on one machine (issue 32, item 6): what idling costs, how fast a burst of
landed hours drains, and whether the UI keeps up.

Each part starts the deployment as ``deploy/`` wires it (``benchmarks.harness.deployment``:
``deploy/dagster.yaml`` with SQLite instead of PostgreSQL, the code server and the daemon from
the systemd units' command lines) over a config of N tables named like a real landing zone's:

- **idle** (``--idle 200,500``): N tables, no new file. After every landing sensor has ticked
  once, ``--idle-minutes`` are measured: CPU seconds a minute of the daemon's and the code
  server's process trees (``/proc``: user + system, their reaped children included), every
  sensor tick's duration (p50/p95, from the instance's tick records), and the event-log
  statements one tick of each kind of sensor runs (evaluated in this process against the same
  instance, counted with a SQLAlchemy hook). Target: the daemon and the code server together
  under 10% of one core at 500 tables.
- **burst** (``--burst 200``): a Spark Connect server too (its UI on, to count Spark jobs); once
  every sensor has ticked, one ``--events``-event hour lands in each table in the same second.
  Then: the time until the last table's history commit holding it (the drain), p50/p95/max per
  table, the time until the last run ended (its checks too), runs launched, Spark jobs, peak
  RSS of every process (this one, the daemon, the code server and its runs, the Connect
  server's JVM). **Headroom** = 60 minutes / the drain with checks. Target: >= 10 at 200
  tables. After the stack stops, the reference: one fresh process (JVM start included) folds
  the same hours with one Spark SQL query each, one table after another (``--no-reference``
  skips it). Target: the history drain within 2.5x of it. With ``--profile DIR`` the
  run workers are sampled with py-spy and the Connect server keeps its event log there: where
  a table's time went, per bucket and by call (``harness.profile``).
- **ui** (``--ui 500``): ``dagster-webserver`` over N tables; the Assets, Automation and Runs
  pages are loaded in headless Chromium (``apt-get install chromium``) over its DevTools
  protocol: a page's time runs from the navigation to the answer of the last GraphQL query
  its load made (its data on screen), the median of 3 after a first visit. Target < 3 s.

Each part runs in each ``--landing-sensor`` mode (``per_table``: a sensor and a run per table;
``fleet``: one sensor, runs of ``--tables-per-run`` tables), so the two designs are compared in
one sitting; ``--burst-modes 200:fleet,40:per_table,40:fleet`` picks sizes per mode (a
200-table burst one run per table-hour takes most of an hour here).

Run it alone on the machine (2 shared cores: seconds are indicative, counts exact)::

    .venv/bin/python -m benchmarks.fleet                                  # everything (~2 h)
    .venv/bin/python -m benchmarks.fleet --idle 20 --idle-minutes 1 --burst 5 --ui 0  # harness
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import sqlalchemy
import sqlalchemy.event
import yaml
from dagster._core.definitions.run_request import InstigatorType
from websockets.sync.client import connect

from benchmarks.harness import profile
from benchmarks.harness.deployment import (
    BenchError,
    Layout,
    Stack,
    graphql,
    run_until_stopped,
    service_env,
    start_code_server,
    start_connect,
    stop_group,
    unit_command,
    wait_for,
    wait_until_loaded,
    write_instance,
)
from benchmarks.harness.generate import EventGenerator, hour_events, table_names
from benchmarks.harness.measure import git_head, percentile, rss_bytes, tree_pids
from benchmarks.harness.report import log, met, print_table
from benchmarks.harness.table import REPO_ROOT
from cdc_platform import connect_server
from cdc_platform.definitions import build_definitions
from cdc_platform.defs.alerts.webhook import ALERT_RESOURCE_KEY, AlertWebhookResource
from cdc_platform.defs.sensors.all_tables import FLEET_SENSOR, FleetCursor
from cdc_platform.lib.config import CONFIG_ENV_VAR, load_config
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.storage.warehouse import TablePaths

TARGET_IDLE_CORE_SHARE = 0.10  # of one core, daemon + code server, at 500 tables
TARGET_HEADROOM = 10.0  # 60 minutes / the burst's drain with its checks, at 200 tables
TARGET_REFERENCE_RATIO = 2.5  # the history drain against a plain Spark loop over the same hours
TARGET_PAGE_S = 3.0
RUN_WORKER = (
    "spawn_main"  # a run worker: the code server spawns one process a run (its main thread)
)
UI_PAGES = {"Assets": "/assets", "Automation": "/automation", "Runs": "/runs"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class Mode:
    """How landed hours become runs: ``per_table`` (a sensor and a run per table) or ``fleet``
    (one sensor, runs of up to ``tables_per_run`` tables)."""

    landing_sensor: str
    tables_per_run: int = 1

    def __str__(self) -> str:
        if self.landing_sensor == "per_table":
            return "per_table"
        return f"fleet, {self.tables_per_run} tables a run"


def prepare(
    work: Path,
    name: str,
    tables: int,
    start: datetime,
    mode: Mode,
    sensor_threads: int = 0,
) -> Layout:
    """A fresh layout under ``work/name``: instance, config of ``tables`` tables (every table's
    landing folder made, empty), landing root and warehouse. ``sensor_threads``: the daemon
    evaluates sensors in that many threads (Dagster's ``sensors: use_threads``)."""
    root = work / name
    if root.exists():
        shutil.rmtree(root)
    layout = Layout.under(root)
    for folder in (layout.home, layout.landing, layout.warehouse):
        folder.mkdir(parents=True)
    write_instance(layout.home)
    if sensor_threads:
        instance = yaml.safe_load((layout.home / "dagster.yaml").read_text())
        instance["sensors"] = {"use_threads": True, "num_workers": sensor_threads}
        (layout.home / "dagster.yaml").write_text(yaml.safe_dump(instance, sort_keys=False))
    names = table_names(tables)
    for table in names:
        (layout.landing / table).mkdir()
    config = {
        "landing_root": str(layout.landing),
        "warehouse_root": str(layout.warehouse),
        "landing_sensor": mode.landing_sensor,
        "tables_per_run": mode.tables_per_run,
        "tables": [
            {"name": t, "primary_key": ["id"], "start": hour_to_partition_key(start)} for t in names
        ],
    }
    layout.config.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return layout


def a_day_ago() -> datetime:
    """A table's first partition: on the hour, a day back."""
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=1)


def start_services(stack: Stack, layout: Layout, remote: tuple[str, Path] | None) -> None:
    stack.env = service_env(layout, connect_server.free_port(), *(remote or (None, None)))
    stack.env.pop("CDC_ALERT_WEBHOOK_URL", None)
    start_code_server(stack, 600)
    stack.start("daemon", unit_command("cdc-platform-daemon.service", "ExecStart", stack.env))


def is_landing_sensor(name: str) -> bool:
    return name.endswith("_landing_sensor") or name == FLEET_SENSOR


def landing_sensor_states(instance: dg.DagsterInstance) -> list[Any]:
    states = instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
    return [s for s in states if is_landing_sensor(s.name)]


def tables_ticked_since(instance: dg.DagsterInstance, since: float) -> int:
    """How many tables a landing sensor has looked at in a tick that started after ``since``:
    per-table sensors, one each; the fleet sensor, the tables whose cursor it stored."""
    states = landing_sensor_states(instance)
    ids = [s.selector_id for s in states]
    latest = instance.get_batch_ticks(ids, limit=1) if ids else {}
    fleet = [s for s in states if s.name == FLEET_SENSOR]
    if not fleet:
        return sum(1 for ticks in latest.values() if ticks and ticks[0].timestamp >= since)
    raw = fleet[0].instigator_data.cursor if fleet[0].instigator_data else None
    ticks = latest.get(fleet[0].selector_id) or []
    if not raw or not ticks or ticks[0].timestamp < since:
        return 0
    epoch = FleetCursor.from_json(raw)
    keys = {epoch.key(t) for t in load_config_names(instance)}
    return len(instance.run_storage.get_cursor_values(keys))


def load_config_names(instance: dg.DagsterInstance) -> list[str]:
    return [t.name for t in load_config(os.environ[CONFIG_ENV_VAR]).tables]


def wait_all_ticked(stack: Stack, instance: dg.DagsterInstance, tables: int, since: float) -> None:
    log(f"  waiting until a landing sensor has looked at each of the {tables} tables")
    os.environ[CONFIG_ENV_VAR] = stack.env[CONFIG_ENV_VAR]
    wait_for(
        stack,
        "every table's landing tick",
        lambda: tables_ticked_since(instance, since) >= tables,
        900,
    )
    # The tick that seeded the last tables reports their backlog, once (500 events to store);
    # idling starts when each landing sensor has finished a tick begun after it.
    seeded = time.time()
    wait_for(
        stack, "a landing tick after the seeding", lambda: all_ticked_after(instance, seeded), 300
    )


def all_ticked_after(instance: dg.DagsterInstance, since: float) -> bool:
    states = landing_sensor_states(instance)
    latest = instance.get_batch_ticks([s.selector_id for s in states], limit=1)
    return all(
        ticks and ticks[0].timestamp >= since and ticks[0].end_timestamp
        for ticks in (latest.get(s.selector_id) for s in states)
    )


# --------------------------------------------------------------------------- measuring


def cpu_seconds(root: int) -> float:
    """User + system CPU of a process tree, its reaped children included (``/proc/*/stat``)."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / CLOCK_TICKS


def tick_durations(instance: dg.DagsterInstance, since: float) -> list[float]:
    durations = []
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, after=since)
        durations += [t.end_timestamp - t.timestamp for t in ticks if t.end_timestamp]
    return durations


class StatementCounter:
    """SQL statements on Dagster's event log tables, from every engine in this process."""

    def __init__(self) -> None:
        self.count = 0
        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        if "event_logs" in sql or "asset_check_executions" in sql:
            self.count += 1

    def close(self) -> None:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", self._seen)


def queries_per_tick(layout: Layout) -> dict[str, int]:
    """Event-log statements of one steady tick of each kind of sensor (the second tick of each,
    the first having set its cursor), at this fleet's size and against its instance."""
    defs = build_definitions(load_config(layout.config))
    repo = defs.get_repository_def()
    kinds = {
        "landing sensor": next(s for s in repo.sensor_defs if is_landing_sensor(s.name)),
        **{s.name: s for s in repo.sensor_defs if s.name.startswith("cdc_") and "alert" in s.name},
    }
    out = {}
    with dg.DagsterInstance.from_config(str(layout.home)) as instance:
        for label, sensor in kinds.items():
            resources = {ALERT_RESOURCE_KEY: AlertWebhookResource()} if "alert" in label else {}
            cursor = None
            counter = StatementCounter()
            try:
                for _ in range(2):
                    counter.count = 0
                    context = dg.build_sensor_context(
                        instance=instance, cursor=cursor, resources=resources, repository_def=repo
                    )
                    cursor = sensor.evaluate_tick(context).cursor
            finally:
                counter.close()
            out[label] = counter.count
    return out


# --------------------------------------------------------------------------- idle


@dataclass
class IdleFigures:
    mode: Mode
    tables: int
    threads: int  # the daemon's sensor threads (0: sensors evaluated one after another)
    minutes: float
    daemon_cpu: float  # CPU seconds a minute
    code_cpu: float
    ticks: list[float]
    queries: dict[str, int]

    @property
    def core_share(self) -> float:
        return (self.daemon_cpu + self.code_cpu) / 60


def idle(args: argparse.Namespace, mode: Mode, tables: int, threads: int) -> IdleFigures:
    name = f"idle-{mode.landing_sensor}-{tables}-{threads}"
    layout = prepare(args.work_dir, name, tables, a_day_ago(), mode, threads)
    stack = Stack(layout.work)
    log(
        f"idle, {tables} tables, {mode}, sensor threads {threads or 'off'}: starting the code "
        "server and the daemon (no Spark)"
    )
    try:
        started = time.time()
        start_services(stack, layout, None)
        daemon, code = (s.proc.pid for s in stack.services[::-1])
        with dg.DagsterInstance.from_config(str(layout.home)) as instance:
            wait_all_ticked(stack, instance, tables, started)
            t0, cpu0 = time.time(), (cpu_seconds(daemon), cpu_seconds(code))
            log(f"  measuring {args.idle_minutes:g} minute(s)")
            time.sleep(args.idle_minutes * 60)
            stack.check_alive()
            minutes = (time.time() - t0) / 60
            cpu1 = (cpu_seconds(daemon), cpu_seconds(code))
            ticks = tick_durations(instance, t0)
        queries = queries_per_tick(layout)
    finally:
        stack.stop()
    return IdleFigures(
        mode,
        tables,
        threads,
        minutes,
        (cpu1[0] - cpu0[0]) / minutes,
        (cpu1[1] - cpu0[1]) / minutes,
        ticks,
        queries,
    )


def print_idle(figures: Sequence[IdleFigures]) -> None:
    rows = [
        [
            f.mode,
            f.tables,
            f.threads or "off",
            f"{f.minutes:.1f}",
            f"{f.daemon_cpu:.2f}",
            f"{f.code_cpu:.2f}",
            f"{f.core_share:.1%}",
            len(f.ticks),
            f"{percentile(f.ticks, 50) * 1000:.0f}" if f.ticks else "n/a",
            f"{percentile(f.ticks, 95) * 1000:.0f}" if f.ticks else "n/a",
        ]
        for f in figures
    ]
    print_table(
        ["landing sensor", "tables", "sensor threads", "min", "daemon cpu s/min", "code server cpu s/min", "of one core", "ticks",
         "tick p50 ms", "tick p95 ms"],
        rows,
    )  # fmt: skip
    for f in figures:
        per = ", ".join(f"{k} {v}" for k, v in f.queries.items())
        log(f"  {f.tables} tables, {f.mode}, event-log statements in one tick: {per}")
    big = [f for f in figures if f.tables >= 500]
    for f in big:
        log(
            f"  target: daemon + code server under {TARGET_IDLE_CORE_SHARE:.0%} of one core at "
            f"{f.tables} tables ({f.mode}): {f.core_share:.1%}, "
            f"{met(f.core_share < TARGET_IDLE_CORE_SHARE)}"
        )


# --------------------------------------------------------------------------- burst


class RssPeak:
    """Peak summed RSS of some process trees, sampled each second in a thread."""

    def __init__(self, roots: Callable[[], list[int]]) -> None:
        self.roots, self.peak = roots, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = {p for root in self.roots() for p in tree_pids(root)}
            self.peak = max(self.peak, sum(rss_bytes(p) for p in pids))
            self._stop.wait(1.0)

    @contextmanager
    def sampling(self) -> Iterator[RssPeak]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def spark_jobs(ui_port: int) -> int | None:
    """Jobs the Connect server's Spark ran (the highest job id + 1, from its UI's REST API)."""
    base = f"http://127.0.0.1:{ui_port}/api/v1/applications"
    try:
        with urllib.request.urlopen(base, timeout=30) as r:
            (app,) = json.loads(r.read())
        with urllib.request.urlopen(f"{base}/{app['id']}/jobs", timeout=60) as r:
            jobs = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return max((j["jobId"] for j in jobs), default=-1) + 1


def commit_time(history: Path) -> float | None:
    """When the history table's first commit adding rows landed (the table is new: that is
    the hour), from the mtime of its log entry."""
    log_dir = history / "_delta_log"
    try:
        entries = sorted(p for p in log_dir.iterdir() if p.suffix == ".json")
    except OSError:
        return None
    for entry in entries:
        if '"add"' in entry.read_text():
            return entry.stat().st_mtime
    return None


@dataclass
class BurstFigures:
    mode: Mode
    tables: int
    events: int
    latencies: list[float]  # landing -> visible, per table
    runs: int
    spark_jobs: int | None
    peak_rss: int
    checked: float  # landing -> the last run's end (history and checks)
    failed_runs: int
    reference: float | None  # the plain Spark loop over the same hours, seconds

    @property
    def drain(self) -> float:
        return max(self.latencies)

    @property
    def headroom(self) -> float:
        return 3600 / self.drain


def land_all(layout: Layout, names: Sequence[str], hour: datetime, events: int, seed: int) -> float:
    """One ``events``-event Parquet file per table in ``hour``, written under hidden names, then
    renamed into place together; the landing time."""
    gen = EventGenerator(events * 10, seed)
    staged = []
    for table in names:
        folder = hour_folder(layout.landing, table, hour)
        folder.mkdir(parents=True)
        pq.write_table(hour_events(gen, hour, events), folder / ".part-0.parquet.tmp")
        staged.append(folder)
    landed = time.time()
    for folder in staged:
        os.replace(folder / ".part-0.parquet.tmp", folder / "part-0.parquet")
    return landed


def burst(args: argparse.Namespace, mode: Mode, tables: int) -> BurstFigures:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    name = f"burst-{mode.landing_sensor}-{tables}"
    layout = prepare(args.work_dir, name, tables, hour - timedelta(hours=2), mode)
    names = table_names(tables)
    warehouse = load_config(layout.config).warehouse_root
    histories = {t: Path(TablePaths.of(warehouse, t).history.path) for t in names}
    stack = Stack(layout.work)
    ui_port = connect_server.free_port()
    log(f"burst, {tables} tables x {args.events} events, {mode}: starting Spark Connect, the "
        "code server and the daemon")  # fmt: skip
    try:
        spark_ui = {"spark.ui.enabled": "true", "spark.ui.port": str(ui_port)}  # to count jobs
        events = args.profile / name if args.profile else None
        if events is not None:
            events.mkdir(parents=True, exist_ok=True)
            spark_ui |= {"spark.eventLog.enabled": "true", "spark.eventLog.dir": events.as_uri()}
        start_services(stack, layout, start_connect(stack, spark_ui))
        assert stack.connect is not None
        port, state = stack.connect
        started = time.time()

        def roots() -> list[int]:
            server = connect_server.server_pid(state, port)
            return [os.getpid(), *([server] if server else [])]

        with dg.DagsterInstance.from_config(str(layout.home)) as instance:
            wait_all_ticked(stack, instance, tables, started)
            jobs_before = spark_jobs(ui_port)
            code_server = stack.services[0].proc.pid  # it launches the runs (their workers)
            sampled = (
                profile.Sampler(code_server, events / "runs.txt", subprocesses=True)
                if events is not None
                else nullcontext()
            )
            with RssPeak(roots).sampling() as rss, sampled:
                landed = land_all(layout, names, hour, args.events, args.seed)
                since_ms = int(landed * 1000)
                log(f"  landed {tables} hours at {datetime.fromtimestamp(landed, UTC):%H:%M:%S}")
                seen: dict[str, float] = {}
                scanned, progress = [0.0], [0]

                def drained() -> bool:
                    """Every 5 s (the commits' mtimes are the figures, not this poll's)."""
                    if time.monotonic() - scanned[0] < 5:
                        return False
                    scanned[0] = time.monotonic()
                    for table, history in histories.items():
                        if table not in seen and (at := commit_time(history)) is not None:
                            seen[table] = at - landed
                    if int(time.time() - landed) // 60 > progress[0]:
                        progress[0] = int(time.time() - landed) // 60
                        log(f"  {progress[0]} min: {len(seen)} of {len(histories)} visible")
                    return len(seen) == len(histories)

                wait_for(stack, "every table's history commit", drained, args.burst_timeout)
                # Then the runs' ends: each table's checks run in its run, after its commit.
                ended = runs_ended(instance, landed)
                last: list[tuple[float, int] | None] = [None]

                def all_ended() -> bool:
                    last[0] = ended()  # kept: the figures are those the wait saw
                    return last[0] is not None

                wait_for(stack, "every run's end", all_ended, args.burst_timeout)
                checked, failed = last[0] or (0.0, 0)
            runs = instance.get_runs_count()
            jobs_after = spark_jobs(ui_port)
    finally:
        stack.stop()
    if events is not None:
        print_profile(events, since_ms, tables, checked)
    jobs = None if jobs_before is None or jobs_after is None else jobs_after - jobs_before
    reference = plain_spark_loop(layout, names, hour) if args.reference else None
    return BurstFigures(
        mode, tables, args.events, list(seen.values()), runs, jobs, rss.peak, checked, failed,
        reference,
    )  # fmt: skip


def runs_ended(
    instance: dg.DagsterInstance, landed: float
) -> Callable[[], tuple[float, int] | None]:
    """Once every run created since ``landed`` has ended: (landing -> the last run's end, in
    seconds; how many did not succeed), else None. Asked after every history commit is
    visible, so every run of the burst exists by then."""
    after = datetime.fromtimestamp(landed, UTC)

    def ended() -> tuple[float, int] | None:
        records = instance.get_run_records(filters=dg.RunsFilter(created_after=after))
        if not records or any(r.end_time is None for r in records):
            return None
        failed = sum(r.dagster_run.status != dg.DagsterRunStatus.SUCCESS for r in records)
        return max(r.end_time or 0.0 for r in records) - landed, failed

    return ended


PLAIN_LOOP = """
import sys, time
from pathlib import Path
from pyspark.sql import functions as F
from benchmarks.harness.measure import local_session
from benchmarks.harness.reference import spark_fold_sql

landing, hour, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
spark = local_session("fleet_reference")
for table in sys.argv[4:]:
    folder = landing / table / hour
    spark.read.parquet(str(folder)).select(
        "*",
        F.col("_metadata.file_path").alias("source_file"),
        F.col("_metadata.row_index").alias("source_row"),
    ).createOrReplaceTempView("landing")
    spark.sql(spark_fold_sql()).write.mode("overwrite").parquet(str(out / table))
spark.stop()
"""


def plain_spark_loop(layout: Layout, names: Sequence[str], hour: datetime) -> float:
    """The reference for a burst (same sitting, after it): one fresh process, JVM start
    included, folding each table's landed hour with one Spark SQL query and writing it as
    Parquet, one table after another. Seconds."""
    folder = hour_folder(layout.landing, names[0], hour).relative_to(layout.landing / names[0])
    with tempfile.TemporaryDirectory(prefix="fleet-reference-") as out:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", PLAIN_LOOP, str(layout.landing), str(folder), out, *names],
            check=True,
            cwd=REPO_ROOT,
        )
        return time.perf_counter() - t0


def print_profile(events: Path, since_ms: int, tables: int, drain: float) -> None:
    """Where the burst's run workers spent their time (``harness.profile``), per table: their
    main threads sampled, the Connect server's jobs from its event log."""
    stacks = profile.read_stacks(events / "runs.txt")
    jobs = profile.spark_jobs(profile.event_log_files(events), lambda _stage: "runs", since_ms)
    seconds = profile.split(stacks, RUN_WORKER)
    title = f"the burst's runs ({tables} tables; their last end {drain:.0f} s after landing)"
    profile.print_split(title, seconds, jobs.get("runs"), tables, unit="table")
    profile.print_calls(title, profile.jvm_calls(stacks, RUN_WORKER), tables, unit="table")


def print_burst(f: BurstFigures) -> None:
    lat = f.latencies
    log(
        f"  {f.tables} tables x {f.events} events, {f.mode}: drained in {f.drain:.0f} s "
        f"({f.drain / 60:.1f} min); per table p50 {percentile(lat, 50):.0f} s, "
        f"p95 {percentile(lat, 95):.0f} s, max {max(lat):.0f} s; runs launched {f.runs}; "
        f"Spark jobs {f.spark_jobs if f.spark_jobs is not None else 'n/a'}; "
        f"peak RSS of every process {f.peak_rss / 2**30:.2f} GiB"
    )
    headroom = 3600 / f.checked if f.checked else 0.0
    log(
        f"  history and checks: the last run ended {f.checked:.0f} s after the landing "
        f"({f.failed_runs} run(s) did not succeed); headroom = 60 min / that = {headroom:.1f} "
        f"(target >= {TARGET_HEADROOM:g} at 200 tables: {met(headroom >= TARGET_HEADROOM)}); "
        f"history alone: {f.drain / f.tables:.1f} s a table, headroom {f.headroom:.1f}"
    )
    if f.reference:
        ratio = f.drain / f.reference
        log(
            f"  plain Spark loop over the same {f.tables} hours, one fresh process: "
            f"{f.reference:.0f} s; the history drain is {ratio:.1f}x it, with checks "
            f"{f.checked / f.reference:.1f}x (target <= {TARGET_REFERENCE_RATIO:g}x: "
            f"{met(ratio <= TARGET_REFERENCE_RATIO)})"
        )


# --------------------------------------------------------------------------- ui


class Browser:
    """Headless Chromium driven over its DevTools protocol: a page counts as loaded once its
    load event fired and none of the UI's GraphQL queries (its data) was in flight for
    ``QUIET_S``; its time runs from the navigation to the last query's answer (or the load
    event, if later)."""

    QUIET_S = 1.0

    def __init__(self, chromium: str, profile: Path) -> None:
        self.port = connect_server.free_port()
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
             f"--remote-debugging-port={self.port}", "--window-size=1600,1000", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.ws = connect(self._page_socket(), max_size=None).__enter__()
        self.next_id = 0
        for method in ("Network.enable", "Page.enable"):
            self._send(method)

    def _page_socket(self) -> str:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list") as r:
                    pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError("Chromium's DevTools endpoint did not come up")
            time.sleep(0.2)

    def _send(self, method: str, **params: Any) -> None:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))

    def load(self, url: str, timeout: float = 120.0) -> float:
        started = last = time.monotonic()
        in_flight: dict[str, str] = {}
        loaded = False
        self._send("Page.navigate", url=url)
        while time.monotonic() - started < timeout:
            if loaded and not in_flight and time.monotonic() - last >= self.QUIET_S:
                return last - started
            try:
                message = json.loads(self.ws.recv(timeout=0.2))
            except TimeoutError:
                continue
            method, params = message.get("method"), message.get("params") or {}
            if method == "Network.requestWillBeSent" and "/graphql" in params["request"]["url"]:
                in_flight[params["requestId"]] = params["request"]["url"]
            elif method in ("Network.loadingFinished", "Network.loadingFailed"):
                if in_flight.pop(params["requestId"], None) is not None:
                    last = time.monotonic()
            elif method == "Page.loadEventFired":
                loaded, last = True, max(last, time.monotonic())
        pending = ", ".join(sorted(in_flight.values())[:5])
        raise BenchError(f"{url}: not loaded within {timeout:.0f} s (loaded {loaded}; {pending})")

    def close(self) -> None:
        self.ws.__exit__(None, None, None)
        stop_group(self.proc, grace_s=10)


def ui(args: argparse.Namespace, mode: Mode) -> dict[str, float] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        log("ui: not measured: no chromium (Debian: apt-get install chromium)")
        return None
    layout = prepare(
        args.work_dir, f"ui-{mode.landing_sensor}-{args.ui}", args.ui, a_day_ago(), mode
    )
    stack = Stack(layout.work)
    port = connect_server.free_port()
    base = f"http://127.0.0.1:{port}"
    log(f"ui, {args.ui} tables, {mode}: starting dagster-webserver")
    try:
        stack.env = service_env(layout, connect_server.free_port(), None, None)
        server = stack.start(
            "webserver",
            [str(Path(sys.executable).with_name("dagster-webserver")), "-h", "127.0.0.1",
             "-p", str(port), "-w", str(REPO_ROOT / "workspace.yaml")],
        )  # fmt: skip
        wait_until_loaded(base, server.proc, server.log_path)
        graphql(base, "mutation { setNuxSeen }")
        with tempfile.TemporaryDirectory() as tmp:
            browser = Browser(chromium, Path(tmp) / "profile")
            try:
                pages = {}
                for name, path in UI_PAGES.items():
                    browser.load(base + path)  # the first visit: the server's caches warm
                    pages[name] = statistics.median(browser.load(base + path) for _ in range(3))
            finally:
                browser.close()
    finally:
        stack.stop()
    return pages


def print_ui(tables: int, mode: Mode, pages: dict[str, float]) -> None:
    for name, seconds in pages.items():
        log(
            f"  {name} page at {tables} tables, {mode}: {seconds:.1f} s (target < {TARGET_PAGE_S:g} s: "
            f"{met(seconds < TARGET_PAGE_S)})"
        )


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cdc_fleet_bench"))
    parser.add_argument("--idle", default="200,500", help="fleet sizes to idle, comma-separated")
    parser.add_argument("--idle-minutes", type=float, default=5.0)
    parser.add_argument(
        "--sensor-threads",
        default="0,4",
        help="the daemon's sensor threads to idle the largest fleet with (0: off), comma-separated",
    )
    parser.add_argument(
        "--landing-sensor",
        default="per_table,fleet",
        help="the landing_sensor modes to idle and burst with, comma-separated",
    )
    parser.add_argument("--tables-per-run", type=int, default=20, help="in fleet mode")
    parser.add_argument(
        "--burst",
        default="200",
        help="tables in the burst, comma-separated sizes (0 or empty: skip); each size runs in "
        "each mode of --burst-modes",
    )
    parser.add_argument(
        "--burst-modes",
        default=None,
        help="the modes of the bursts (default: --landing-sensor); a size:mode item runs that "
        "size in that mode only, e.g. 200:fleet,40:per_table,40:fleet",
    )
    parser.add_argument("--events", type=int, default=100, help="events in each table's hour")
    parser.add_argument("--burst-timeout", type=float, default=3 * 3600.0, help="seconds")
    parser.add_argument("--ui", type=int, default=500, help="tables for the UI pages (0: skip)")
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the plain Spark loop over each burst's hours",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="sample the burst's run workers (py-spy) and keep the Connect server's event log "
        "here; prints where the time went, per table",
    )
    args = parser.parse_args(argv)
    args.idle_sizes = [int(n) for n in args.idle.split(",") if n.strip() and int(n) > 0]
    args.threads = [int(n) for n in args.sensor_threads.split(",") if n.strip()] or [0]
    modes = {m: Mode(m, args.tables_per_run if m == "fleet" else 1) for m in ("per_table", "fleet")}
    args.modes = [modes[m.strip()] for m in args.landing_sensor.split(",") if m.strip()]
    args.bursts = []
    for item in (args.burst_modes or "").split(",") if args.burst_modes else []:
        size, _, mode = item.partition(":")
        args.bursts.append((modes[mode.strip()], int(size)))
    if not args.burst_modes:
        sizes = [int(n) for n in str(args.burst).split(",") if n.strip() and int(n) > 0]
        args.bursts = [(m, n) for n in sizes for m in args.modes]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    log(f"cdc_platform fleet (git {git_head()}), {os.cpu_count()} cores, work dir {args.work_dir}")

    def measure() -> None:
        # Every size in each mode; the largest with each number of sensor threads too.
        runs = [(m, n, args.threads[0]) for m in args.modes for n in args.idle_sizes]
        if args.idle_sizes:
            big = max(args.idle_sizes)
            runs += [(m, big, t) for m in args.modes for t in args.threads[1:]]
        idles = [idle(args, m, n, t) for m, n, t in runs]
        if idles:
            log("\nidle: no new file")
            print_idle(idles)
        bursts = [burst(args, m, n) for m, n in args.bursts]
        if bursts:
            log("\nburst: one hour lands in every table at once")
            for figures in bursts:
                print_burst(figures)
        uis = [(m, ui(args, m)) for m in args.modes] if args.ui else []
        if any(pages is not None for _, pages in uis):
            log("\nui: headless Chromium, navigation to the page's last GraphQL answer")
            for mode, pages in uis:
                if pages is not None:
                    print_ui(args.ui, mode, pages)

    return run_until_stopped(measure)


if __name__ == "__main__":
    sys.exit(main())
