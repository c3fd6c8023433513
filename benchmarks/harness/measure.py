"""How the benchmarks measure: the peak memory of a whole process tree (Python, JVM, Python
workers: ``ru_maxrss`` misses the JVM), the bytes a Delta commit added and removed (read from
the log itself, independent of the code under test), a timed ``materialize()`` and a timed
``dagster asset materialize`` process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from benchmarks.harness.table import BIN, REPO_ROOT, TABLE, TABLE_NAME, changelog_path, history_path
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.session import build_spark_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


# The in-process measurements' session: the 2 cores, a driver that holds a 10M-version table.
LOCAL_CONF = {"spark.driver.memory": "4g", "spark.sql.shuffle.partitions": "4"}


def local_session(app: str, conf: dict[str, str] | None = None) -> SparkSession:
    """local[2] with ``LOCAL_CONF`` (and ``conf`` over it), named ``app``."""
    return build_spark_session("local[2]", {**LOCAL_CONF, **(conf or {})}, app)


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
            sizes = file_sizes(table_path, version - 1)
            out.removed_bytes += sum(sizes[p] for p in missing)
    return out


def file_sizes(table_path: Path, version: int) -> dict[str, int]:
    """The size of every data file of the table at ``version``, by its path (a remove action
    may leave its size out: the snapshot before the commit has it)."""
    from deltalake import DeltaTable

    adds = pa.table(DeltaTable(str(table_path), version=version).get_add_actions(flatten=True))
    paths, sizes = adds.column("path").to_pylist(), adds.column("size_bytes").to_pylist()
    return {p: int(s) for p, s in zip(paths, sizes, strict=True)}


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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), ``q`` in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
