"""Scale benchmark (issue 8): merge cost vs history depth, backfill vs DuckDB, fixed cost per run.

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
   query (``bulk_hour.py``'s reference) as a whole ``python`` process from a cold JVM.
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

    cd <repo> && PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --only depth
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --only backfill
    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --only fixed [--spark-remote sc://localhost:15002]

Quick check of the harness itself (minutes, not a measurement)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale.py --scale 0.01 --backfill-hours 24

``--scale`` multiplies every event and key count (sizes, keys, events per hour, the measured
hour, backfill events, the fixed-cost base table); hour counts, the 100-event fixed-cost hour
and the 5 repetitions are not scaled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import cdc_platform
from cdc_platform.lib.columns import TMAX, unix_micros
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.connect import CONNECT_AUTH_ENV, DEFAULT_CONNECT_AUTH
from cdc_platform.lib.spark.deployment import SparkDeployment
from cdc_platform.lib.spark.session import build_spark_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TABLE_NAME = "bench"
START = datetime(2024, 1, 1, tzinfo=UTC)
TABLE = TableConfig(name=TABLE_NAME, primary_key=("id",), start=START)
REPO_ROOT = Path(cdc_platform.__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

US = 1_000_000
HOUR_US = 3600 * US
DAY_US = 24 * HOUR_US
START_US = int(START.timestamp()) * US
TMAX_US = unix_micros(TMAX)
TS_TYPE = pa.timestamp("us", tz="UTC")

DATA_COLUMNS = ("status", "amount", "quantity", "updated_at", "is_priority", "note")
STATUSES = np.array(["new", "paid", "shipped", "returned", "cancelled"])
OPS = np.array(["INSERT", "UPDATE", "DELETE"])
OP_WEIGHTS = (0.04, 0.92, 0.04)
LATE_FRACTION = 0.02
TARGET_DEPTH_RATIO = 1.3
TARGET_BACKFILL_RATIO = 0.5
TARGET_BACKFILL_FLOOR_RATIO = 1.5  # the CLI range run vs one Spark SQL query (issue 22)
TARGET_FIXED_IN_PROCESS_S = 1.0
TARGET_FIXED_CLI_S = 5.0
GENERATOR_VERSION = 1  # bump when the generated data changes, so caches are rebuilt
MB = 1e6


# --------------------------------------------------------------------------- data generation


class EventGenerator:
    """Random CDC events over ``keys`` keys: full row images, deletes carry only the key.

    With ``every_key_first`` the first ``keys`` in-order events give each key its first event
    (in a random order) and only then are keys drawn at random, so a table of ``keys`` events
    already has every key that a deeper one has and they differ by depth alone (random draws
    alone leave a third of the keys unseen after ``keys`` events).
    """

    def __init__(
        self, keys: int, seed: int, first_seq: int = 1, every_key_first: bool = False
    ) -> None:
        self.keys = keys
        self.rng = np.random.default_rng(seed)
        self.next_seq = first_seq
        self.seen = np.zeros(keys, dtype=bool)
        # The keys still to be given their first event, in order (none without every_key_first).
        self.first_order = self.rng.permutation(keys) if every_key_first else np.empty(0, np.int64)
        self.introduced = 0

    def events(
        self, n: int, hour_start_us: int, late: int = 0, late_window_us: tuple[int, int] = (0, 0)
    ) -> pa.Table:
        """``n - late`` events committed in the hour (in order), ``late`` committed in the window
        on keys that already have events."""
        rng = self.rng
        in_order = n - late
        ids = rng.integers(0, self.keys, in_order, dtype=np.int64)
        fresh = self.first_order[self.introduced : self.introduced + in_order]
        ids[: len(fresh)] = fresh
        self.introduced += len(fresh)
        ts = hour_start_us + np.sort(rng.integers(0, HOUR_US, in_order, dtype=np.int64))
        if late:
            existing = np.flatnonzero(self.seen)
            if not len(existing):
                raise ValueError("late events need keys that already have events")
            late_ids = rng.choice(existing, late).astype(np.int64)
            late_ts = np.sort(rng.integers(late_window_us[0], late_window_us[1], late))
            ids = np.concatenate([late_ids, ids])
            ts = np.concatenate([late_ts.astype(np.int64), ts])
        seq = np.arange(self.next_seq, self.next_seq + n, dtype=np.int64)
        self.next_seq += n
        self.seen[ids] = True

        op_idx = rng.choice(3, n, p=OP_WEIGHTS)
        deleted = op_idx == 2
        ts_arr = pa.array(ts, pa.int64()).cast(TS_TYPE)
        note_null = deleted | (rng.random(n) < 0.1)
        notes = np.char.add("note ", rng.integers(0, 1000, n).astype(str))
        return pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "status": pa.array(STATUSES[rng.integers(0, len(STATUSES), n)], mask=deleted),
                "amount": pa.array(np.round(rng.uniform(1, 1000, n), 2), mask=deleted),
                "quantity": pa.array(rng.integers(1, 100, n).astype(np.int32), mask=deleted),
                "updated_at": pa.array(ts, pa.int64(), mask=deleted).cast(TS_TYPE),
                "is_priority": pa.array(rng.random(n) < 0.1, mask=deleted),
                "note": pa.array(notes, mask=note_null),
                "cdc_operation_type": pa.array(OPS[op_idx]),
                "cdc_change_seq": pa.array(seq),
                "cdc_commit_timestamp": ts_arr,
            }
        )


def hour_at(index: int) -> datetime:
    return START + timedelta(hours=index)


def write_hour(landing: Path, index: int, table: pa.Table) -> None:
    folder = hour_folder(landing, TABLE_NAME, hour_at(index))
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / f"part-{index:05d}.parquet")


def split_evenly(total: int, parts: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(total), parts)]


def generate_landing(
    landing: Path, keys: int, events: int, hours: int, seed: int, every_key_first: bool = False
) -> EventGenerator:
    """``events`` in-order events over ``hours`` hourly folders; returns the generator's state."""
    gen = EventGenerator(keys, seed, every_key_first=every_key_first)
    for index, n in enumerate(split_evenly(events, hours)):
        if n:
            write_hour(landing, index, gen.events(n, START_US + index * HOUR_US))
    return gen


def params_key(**params: Any) -> str:
    text = json.dumps({**params, "generator": GENERATOR_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def code_hash() -> str:
    """A digest of ``cdc_platform/lib``: a table built by other code is rebuilt, not reused."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "cdc_platform" / "lib").rglob("*.py")):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class CachedLanding:
    root: Path
    next_seq: int
    seen: np.ndarray
    hours: int
    key: str  # params_key of its landing_params: also names the table built from it


def landing_params(
    keys: int, events: int, hours: int, seed: int, every_key_first: bool = False
) -> dict[str, Any]:
    """What a generated landing zone (and the table built from it) is a function of."""
    params: dict[str, Any] = {"keys": keys, "events": events, "hours": hours, "seed": seed}
    if every_key_first:  # absent otherwise, so the caches of the other sections stay valid
        params["every_key_first"] = True
    return params


def cached_landing(cache_dir: Path, params: dict[str, Any]) -> CachedLanding:
    """Landing files for ``landing_params``, generated once (the marker is written last)."""
    key = params_key(**params)
    root = cache_dir / f"landing-{key}"
    marker = root / "_complete.json"
    events, hours = params["events"], params["hours"]
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.perf_counter()
        gen = generate_landing(root, **params)
        np.save(root / "_seen.npy", gen.seen)
        marker.write_text(json.dumps({"next_seq": gen.next_seq, "hours": hours}))
        log(
            f"  generated {events:,} events in {hours} hour folders ({time.perf_counter() - t0:.1f} s)"
        )
    meta = json.loads(marker.read_text())
    return CachedLanding(root, int(meta["next_seq"]), np.load(root / "_seen.npy"), hours, key)


# --------------------------------------------------------------------------- measuring


def _ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppid_map().items():
        children.setdefault(ppid, []).append(pid)
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeRssSampler:
    """Peak of the summed VmRSS of a process and all its descendants, sampled in a thread.

    VmRSS is read every ``interval`` for the known pids (cheap); the process tree itself is
    re-discovered every ``tree_interval`` (a /proc scan, ~10-30 ms on a busy machine). Pages
    shared between forked Python workers count once per process, as in ``ps``.
    """

    def __init__(self, root_pid: int, interval: float = 0.05, tree_interval: float = 1.0) -> None:
        self.root_pid = root_pid
        self.interval = interval
        self.tree_interval = tree_interval
        self.peak = 0
        self.first = 0  # the tree's RSS when sampling started
        self._pids: list[int] = []
        self._tree_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self, refresh: bool = False) -> int:
        now = time.monotonic()
        if refresh or now - self._tree_at >= self.tree_interval:
            self._pids, self._tree_at = tree_pids(self.root_pid), now
        total = sum(rss_bytes(p) for p in self._pids)
        self.peak = max(self.peak, total)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeRssSampler:
        self.first = self.sample(refresh=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample(refresh=True)


def history_path(warehouse: Path) -> Path:
    """The history table, where the README says it is (not imported: the code may change)."""
    return warehouse / TABLE_NAME


def changelog_path(warehouse: Path) -> Path:
    return warehouse / "_cdc" / TABLE_NAME / "changelog"


def delta_tables(warehouse: Path) -> list[Path]:
    """Every Delta table under the warehouse (a redesign may add some, e.g. per-key state)."""
    found = []
    for folder, dirs, _files in os.walk(warehouse):
        if "_delta_log" in dirs:
            found.append(Path(folder))
            dirs.clear()  # a table's own folders hold no other table
    return sorted(found)


def log_versions(table_path: Path) -> set[int]:
    log_dir = table_path / "_delta_log"
    if not log_dir.is_dir():
        return set()
    return {
        int(p.name[:20])
        for p in log_dir.iterdir()
        if p.name.endswith(".json") and p.name[:20].isdigit()
    }


@dataclass
class CommitBytes:
    """The add and remove actions of some Delta commits, from the log JSON itself."""

    versions: list[int] = field(default_factory=list)
    added_bytes: int = 0
    removed_bytes: int = 0
    files_added: int = 0
    files_removed: int = 0

    @property
    def rewritten_bytes(self) -> int:
        return self.added_bytes + self.removed_bytes


def commit_bytes(table_path: Path, versions: Sequence[int]) -> CommitBytes:
    out = CommitBytes(versions=sorted(versions))
    for version in out.versions:
        missing: list[str] = []
        with open(table_path / "_delta_log" / f"{version:020d}.json") as fh:
            for line in fh:
                action = json.loads(line)
                if "add" in action:
                    out.files_added += 1
                    out.added_bytes += int(action["add"]["size"])
                elif "remove" in action:
                    out.files_removed += 1
                    size = action["remove"].get("size")
                    if size is None:
                        missing.append(action["remove"]["path"])
                    else:
                        out.removed_bytes += int(size)
        if missing:  # a remove without size: look it up in the snapshot before the commit
            from deltalake import DeltaTable

            adds = pa.table(
                DeltaTable(str(table_path), version=version - 1).get_add_actions(flatten=True)
            )
            sizes = dict(
                zip(
                    adds.column("path").to_pylist(),
                    adds.column("size_bytes").to_pylist(),
                    strict=True,
                )
            )
            out.removed_bytes += sum(int(sizes[p]) for p in missing)
    return out


def table_rows(table_path: Path) -> tuple[int, int]:
    """(rows, active rows) of a history table, read with delta-rs."""
    from deltalake import DeltaTable

    t = DeltaTable(str(table_path)).to_pyarrow_table(columns=["_fivetran_active"])
    active = t.column("_fivetran_active")
    return t.num_rows, int(pc.sum(active).as_py() or 0)  # pyright: ignore[reportAttributeAccessIssue]


def table_bytes(table_path: Path) -> int:
    from deltalake import DeltaTable

    adds = pa.table(DeltaTable(str(table_path)).get_add_actions(flatten=True))
    return int(pc.sum(adds.column("size_bytes")).as_py() or 0)  # pyright: ignore[reportAttributeAccessIssue]


@dataclass
class Measurement:
    seconds: float
    peak_rss: int
    rss_before: int
    history: CommitBytes
    changelog: CommitBytes
    other: dict[str, CommitBytes]  # other Delta tables the call committed to
    result: Any


def measured_materialize(
    spark: SparkSession, landing: Path, warehouse: Path, hours: Sequence[datetime]
) -> Measurement:
    before = {t: log_versions(t) for t in delta_tables(warehouse)}
    with TreeRssSampler(os.getpid()) as rss:
        t0 = time.perf_counter()
        result = materialize(spark, TABLE, landing, warehouse, hours)
        seconds = time.perf_counter() - t0
    commits = {
        t: commit_bytes(t, sorted(log_versions(t) - before.get(t, set())))
        for t in delta_tables(warehouse)
    }
    history, changelog = history_path(warehouse), changelog_path(warehouse)
    return Measurement(
        seconds=seconds,
        peak_rss=rss.peak,
        rss_before=rss.first,
        history=commits.get(history, CommitBytes()),
        changelog=commits.get(changelog, CommitBytes()),
        other={
            t.relative_to(warehouse).as_posix(): c
            for t, c in commits.items()
            if t not in (history, changelog) and c.versions
        },
        result=result,
    )


def merge_figure(result: Any, name: str) -> int | None:
    """A figure the merge may report (future fields): on ``result.merge`` or on the result."""
    for holder in (getattr(result, "merge", None), result):
        value = getattr(holder, name, None)
        if value is not None:
            return int(value)
    return None


# --------------------------------------------------------------------------- output


def log(msg: str) -> None:
    print(msg, flush=True)


def fmt_mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MB:,.2f}"


def fmt_ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den else "n/a"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def met(ok: bool) -> str:
    return "met" if ok else "NOT MET"


# --------------------------------------------------------------------------- 1. depth


def size_label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


@dataclass
class DepthRow:
    label: str
    variant: str
    versions: int
    table_bytes: int
    m: Measurement


def build_cached_table(
    spark: SparkSession, cache_dir: Path, landing: CachedLanding
) -> tuple[Path, dict[str, Any]]:
    """The history table built from ``landing`` by ONE range call, cached per code version."""
    warehouse = cache_dir / f"warehouse-{landing.key}-code-{code_hash()}"
    marker = warehouse.parent / f"{warehouse.name}.json"
    if marker.exists() and warehouse.is_dir():
        meta = json.loads(marker.read_text())
        meta["cached"] = True
        return warehouse, meta
    shutil.rmtree(warehouse, ignore_errors=True)
    hours = [hour_at(i) for i in range(landing.hours)]
    t0 = time.perf_counter()
    result = materialize(spark, TABLE, landing.root, warehouse, hours)
    seconds = time.perf_counter() - t0
    history = history_path(warehouse)
    versions, active = table_rows(history)
    meta = {
        "seconds": round(seconds, 2),
        "events": result.events_read,
        "versions": versions,
        "active": active,
        "bytes": table_bytes(history),
    }
    marker.write_text(json.dumps(meta))
    meta["cached"] = False
    return warehouse, meta


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
        warehouse, meta = build_cached_table(spark, cache, landing)
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


def write_config(run_dir: Path, landing: Path, warehouse: Path) -> dict[str, str]:
    """A config file and a Dagster instance for the CLI; returns the env to run it with."""
    config = run_dir / "cdc_platform.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "landing_root": str(landing),
                "warehouse_root": str(warehouse),
                "tables": [
                    {"name": TABLE_NAME, "primary_key": ["id"], "start": TABLE.start_partition_key}
                ],
            },
            indent=2,
        )
    )
    home = run_dir / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env["CDC_PLATFORM_CONFIG"] = str(config)
    env["DAGSTER_HOME"] = str(home)
    return env


@dataclass
class CliRun:
    seconds: float
    peak_rss: int
    log_path: Path


def run_dagster_cli(
    env: dict[str, str],
    run_dir: Path,
    partition_args: list[str],
    name: str,
    target: Sequence[str] = ("-m", "cdc_platform.definitions", "--select", TABLE_NAME),
) -> CliRun:
    cmd = [str(BIN / "dagster"), "asset", "materialize", *target, *partition_args]
    log_path = run_dir / f"{name}.log"
    with open(log_path, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT)
        with TreeRssSampler(proc.pid) as rss:
            code = proc.wait()
        seconds = time.perf_counter() - t0
    if code != 0:
        tail = log_path.read_text().splitlines()[-30:]
        raise RuntimeError(
            f"{' '.join(cmd)} exited with {code}; log {log_path}:\n" + "\n".join(tail)
        )
    return CliRun(seconds, rss.peak, log_path)


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


def describe_steps(figures: dict[str, Any]) -> str:
    steps = [f"{k[5:]} {v:.1f} s" for k, v in figures.items() if k.startswith("step:")]
    inside = figures.get("seconds")
    return (
        f"steps: {', '.join(steps) or 'n/a'}; materialize() inside the asset: "
        f"{f'{inside:.1f} s' if isinstance(inside, int | float) else 'n/a'}"
    )


# --------------------------------------------------------------------------- 2. backfill


REFERENCE_SQL = """
WITH raw AS (
    SELECT id, {cols}, cdc_change_seq AS seq,
           (epoch_us(cdc_commit_timestamp) // 1000) * 1000 AS ms,
           upper(cdc_operation_type) = 'DELETE' AS del,
           row_number() OVER (PARTITION BY id, cdc_change_seq
                              ORDER BY filename, file_row_number) AS copy
    FROM read_parquet('{glob}', hive_partitioning = false, filename = true,
                      file_row_number = true, union_by_name = true)
),
ev AS (SELECT * FROM raw WHERE copy = 1),
-- one step per (key, millisecond): does it hold an image, does it end deleted, which image
step_keys AS (
    SELECT id, ms,
           bool_or(NOT del) AS has_image,
           arg_max(del, seq) AS ends_deleted,
           max(seq) FILTER (WHERE NOT del) AS image_seq
    FROM ev GROUP BY id, ms
),
steps AS (
    SELECT s.id, s.ms, s.has_image, s.ends_deleted, {image_cols}
    FROM step_keys s LEFT JOIN ev e ON e.id = s.id AND e.seq = s.image_seq
),
walked AS (
    SELECT *,
           coalesce(lag(has_image AND NOT ends_deleted) OVER w, false) AS live_before,
           {prev_cols}
    FROM steps WINDOW w AS (PARTITION BY id ORDER BY ms)
),
opened AS (
    SELECT *, has_image AND NOT (live_before AND {same_image}) AS opens FROM walked
),
closed AS (
    SELECT *,
           first_value(CASE WHEN opens THEN ms - 1000 WHEN ends_deleted THEN ms END IGNORE NULLS)
               OVER (PARTITION BY id ORDER BY ms
                     ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS next_close
    FROM opened
)
SELECT id, {cols}, ms AS _fivetran_start,
       CASE WHEN ends_deleted THEN ms
            WHEN next_close IS NOT NULL THEN next_close
            ELSE {tmax} END AS _fivetran_end
FROM closed WHERE opens
"""


def reference_fold(landing: Path, out_path: Path, synced_at: datetime) -> tuple[float, pa.Table]:
    """Fold every landing file with DuckDB SQL and write the result with delta-rs."""
    import duckdb
    from deltalake import write_deltalake

    t0 = time.perf_counter()
    sql = REFERENCE_SQL.format(
        cols=", ".join(DATA_COLUMNS),
        glob=f"{landing / TABLE_NAME}/**/*.parquet",
        image_cols=", ".join(f"e.{c}" for c in DATA_COLUMNS),
        prev_cols=", ".join(f"lag({c}) OVER w AS prev_{c}" for c in DATA_COLUMNS),
        same_image=" AND ".join(f"{c} IS NOT DISTINCT FROM prev_{c}" for c in DATA_COLUMNS),
        tmax=TMAX_US,
    )
    con = duckdb.connect()
    con.execute("SET threads TO 2")
    folded = con.sql(sql).to_arrow_table()
    start = folded.column("_fivetran_start").cast(TS_TYPE)
    end = folded.column("_fivetran_end").cast(TS_TYPE)
    active = pc.equal(folded.column("_fivetran_end"), TMAX_US)  # pyright: ignore[reportAttributeAccessIssue]
    out = folded.select(["id", *DATA_COLUMNS])
    out = out.set_column(
        out.schema.get_field_index("updated_at"), "updated_at", out["updated_at"].cast(TS_TYPE)
    )
    out = out.append_column("_fivetran_start", start)
    out = out.append_column("_fivetran_end", end).append_column("_fivetran_active", active)
    synced = pa.array([synced_at] * out.num_rows, TS_TYPE)
    out = out.append_column("_fivetran_synced", synced)
    write_deltalake(str(out_path), out, mode="overwrite")
    return time.perf_counter() - t0, out


def compare_tables(spark_table: pa.Table, reference: pa.Table) -> str | None:
    """None if equal as sorted row sets (ignoring ``_fivetran_synced``), else what differs."""
    columns = [c for c in reference.column_names if c != "_fivetran_synced"]
    a = spark_table.select(columns)
    b = reference.select(columns).cast(a.schema)
    order = [("id", "ascending"), ("_fivetran_start", "ascending")]
    a, b = a.sort_by(order), b.sort_by(order)
    if a.equals(b):
        return None
    if a.num_rows != b.num_rows:
        return f"{a.num_rows:,} rows vs {b.num_rows:,}"
    for c in columns:
        diff = pc.invert(pc.fill_null(pc.equal(a[c], b[c]), False))  # pyright: ignore[reportAttributeAccessIssue]
        both_null = pc.and_(pc.is_null(a[c]), pc.is_null(b[c]))  # pyright: ignore[reportAttributeAccessIssue]
        diff = pc.and_not(diff, both_null)  # pyright: ignore[reportAttributeAccessIssue]
        idx = pc.indices_nonzero(diff)  # pyright: ignore[reportAttributeAccessIssue]
        if len(idx):
            i = idx[0].as_py()
            return (
                f"{len(idx):,} rows differ in {c}; first: spark {a.slice(i, 1).to_pylist()} "
                f"vs reference {b.slice(i, 1).to_pylist()}"
            )
    return "tables differ (schema or metadata)"


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

    # Spark's own floor (issue 22, target 4): one Spark SQL query over every landed file, as a
    # whole python process from a cold JVM (bulk_hour.py's reference, same query).
    from bulk_hour import measured

    spark_ref = measured("reference", landing.root, run_dir / "spark_reference", None)
    if "failed" in spark_ref:
        raise AssertionError(f"the Spark SQL reference failed: {spark_ref['failed']}")
    floor_ratio = cli.seconds / spark_ref["process_seconds"]
    log(
        f"  Spark SQL reference (one query, cold JVM, whole process): "
        f"{spark_ref['process_seconds']:.1f} s ({spark_ref['seconds']:.1f} s of work), "
        f"{spark_ref['versions']:,} versions; the CLI takes {floor_ratio:.2f}x "
        f"(target <= {TARGET_BACKFILL_FLOOR_RATIO}x: {met(floor_ratio <= TARGET_BACKFILL_FLOOR_RATIO)})"
    )

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
    cached, meta = build_cached_table(spark, cache, landing)
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
    log(
        f"  last CLI run: peak RSS of its process tree {cli[-1].peak_rss / 2**20:,.0f} MiB; "
        f"{describe_steps(meta)}; Spark: "
        + (f"remote {remote}" if remote else "local[2] started by the run")
    )
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


# --------------------------------------------------------------------------- main


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


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
        spark = build_spark_session(
            "local[2]",
            {"spark.driver.memory": "4g", "spark.sql.shuffle.partitions": "4"},
            "scale_bench",
        )
    try:
        yield spark
    finally:
        spark.stop()


def git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


def timed(name: str, run: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    run()
    log(f"  ({name}: {time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
