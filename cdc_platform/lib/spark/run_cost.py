"""What one run cost: seconds and Spark jobs per stage, bytes read, bytes each commit rewrote.

A run (``pipeline.materialize``) opens one ``RunCost`` and marks each boundary between its
stages with ``lap(stage)``: the stopwatch closes the stage that was running and opens the next.
Code deeper down (the merge) marks its own stages with the module-level ``lap``, which finds the
run's stopwatch through a context variable and does nothing outside a run, so the merge's
signatures do not change and an operator job that merges outside a run pays nothing.

* **Seconds** are wall-clock, per stage name (a stage entered again, say by a commit retry,
  adds up). Spark is lazy: a stage's seconds are those of the Spark jobs its own actions ran,
  which may compute DataFrames an earlier stage defined.
* **Spark jobs** are counted exactly in a classic session: each stage runs under its own Spark
  job group (``spark.jobGroup.id``, a thread-local property, restored at the end) and the
  status tracker lists the job ids of each group when the stage closes. Over Spark Connect there
  is no SparkContext in this process: ``spark_jobs`` is ``None`` (absent, not zero) and the
  seconds are still there.
* **Bytes rewritten** per Delta table are read back from the Delta log: the sizes of the add
  and remove actions of every commit the table received during the run (the log's versions
  between the first and the last look, by listing ``_delta_log``), independent of what the code
  under measurement says it did. One run writes a table at a time (the table's pool), so those
  commits are the run's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from contextlib import suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cdc_platform.lib.spark.session import is_connect
from cdc_platform.lib.storage.stores import Location

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

JOB_GROUP = "spark.jobGroup.id"
LOG_DIR = "_delta_log"

_current: ContextVar[RunCost | None] = ContextVar("cdc_platform_run_cost", default=None)


def lap(stage: str) -> None:
    """Close the running stage of the current run and open ``stage`` (outside a run: nothing)."""
    cost = _current.get()
    if cost is not None:
        cost.lap(stage)


@dataclass(frozen=True)
class StageCost:
    name: str
    seconds: float
    spark_jobs: int | None  # None: not counted (Spark Connect)


@dataclass(frozen=True)
class TableCost:
    """The commits one Delta table received during the run, from its log."""

    name: str
    commits: int
    bytes_added: int
    bytes_removed: int

    @property
    def bytes_rewritten(self) -> int:
        return self.bytes_added + self.bytes_removed


@dataclass(frozen=True)
class CostReport:
    seconds: float  # the whole run, from the first stage to the last
    stages: tuple[StageCost, ...]
    tables: tuple[TableCost, ...] = ()
    bytes_read: Mapping[str, int] = field(default_factory=dict)  # per table (or "landing")

    @property
    def spark_jobs(self) -> int | None:
        counted = [s.spark_jobs for s in self.stages if s.spark_jobs is not None]
        return sum(counted) if len(counted) == len(self.stages) else None

    def figures(self) -> dict[str, int | float]:
        """Flat numeric figures, ``seconds/<stage>``, ``spark_jobs/<stage>`` (classic Spark
        only), ``bytes_read/<table>``, ``bytes_rewritten/<table>``, ``commits/<table>``, each
        with a ``total``: what the Dagster metadata plots over time."""
        out: dict[str, int | float] = {"seconds/total": round(self.seconds, 3)}
        out.update({f"seconds/{s.name}": round(s.seconds, 3) for s in self.stages})
        jobs = self.spark_jobs
        if jobs is not None:
            out["spark_jobs/total"] = jobs
            out.update({f"spark_jobs/{s.name}": s.spark_jobs or 0 for s in self.stages})
        out["bytes_read/total"] = sum(self.bytes_read.values())
        out.update({f"bytes_read/{t}": n for t, n in self.bytes_read.items()})
        out["bytes_rewritten/total"] = sum(t.bytes_rewritten for t in self.tables)
        out.update({f"bytes_rewritten/{t.name}": t.bytes_rewritten for t in self.tables})
        out["commits/total"] = sum(t.commits for t in self.tables)
        out.update({f"commits/{t.name}": t.commits for t in self.tables})
        return out


class RunCost:
    """The stopwatch of one run: ``with RunCost(spark, tables) as cost: ... cost.lap(...)``,
    then ``cost.report(bytes_read)``. ``tables`` names the Delta tables whose commits count."""

    def __init__(self, spark: SparkSession, tables: Mapping[str, Location] | None = None) -> None:
        self._jobs = None if is_connect(spark) else _JobGroups(spark.sparkContext)
        self._tables = dict(tables or {})
        self._order: list[str] = []
        self._seconds: dict[str, float] = {}
        self._stage: str | None = None
        self._since = 0.0
        self._started = 0.0
        self._ended: float | None = None
        self._versions_before: dict[str, int | None] = {}
        self._table_costs: tuple[TableCost, ...] = ()

    def __enter__(self) -> RunCost:
        self._versions_before = {n: _latest_version(loc) for n, loc in self._tables.items()}
        self._started = self._since = time.monotonic()
        self._token = _current.set(self)
        if self._jobs is not None:
            self._jobs.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._close_stage()
            self._ended = time.monotonic()
        finally:
            _current.reset(self._token)
            if self._jobs is not None:
                self._jobs.stop()
        if exc[0] is None:
            self._table_costs = tuple(
                c
                for n, loc in self._tables.items()
                if (c := _commits_since(n, loc, self._versions_before[n])).commits
            )

    def lap(self, stage: str) -> None:
        """Close the running stage (if any) and open ``stage``."""
        self._close_stage()
        self._stage = stage
        if stage not in self._seconds:
            self._order.append(stage)
            self._seconds[stage] = 0.0
        if self._jobs is not None:
            self._jobs.enter(stage)

    def _close_stage(self) -> None:
        now = time.monotonic()
        if self._stage is not None:
            self._seconds[self._stage] += now - self._since
            if self._jobs is not None:
                self._jobs.leave(self._stage)
        self._stage, self._since = None, now

    def report(self, bytes_read: Mapping[str, int] | None = None) -> CostReport:
        """The figures of the run (after the ``with`` block)."""
        end = self._ended if self._ended is not None else time.monotonic()
        counts = self._jobs.counts() if self._jobs is not None else {}
        return CostReport(
            seconds=end - self._started,
            stages=tuple(
                StageCost(s, self._seconds[s], counts.get(s, 0) if self._jobs else None)
                for s in self._order
            ),
            tables=self._table_costs,
            bytes_read=dict(bytes_read or {}),
        )


class _JobGroups:
    """Spark jobs per stage in a classic session: one job group per stage, read back from the
    status tracker when the stage closes (it keeps only the last ``spark.ui.retainedJobs``)."""

    def __init__(self, sc: SparkContext) -> None:
        self._sc = sc
        self._prefix = f"cdc_platform-run-{uuid.uuid4().hex[:12]}/"
        self._previous: str | None = None
        self._jobs: dict[str, set[int]] = {}

    def start(self) -> None:
        self._previous = self._sc.getLocalProperty(JOB_GROUP)

    def stop(self) -> None:
        self._sc.setLocalProperty(JOB_GROUP, self._previous)  # type: ignore[arg-type]  # None unsets

    def enter(self, stage: str) -> None:
        self._sc.setLocalProperty(JOB_GROUP, self._prefix + stage)

    def leave(self, stage: str) -> None:
        self._wait_for_listeners()
        ids = self._sc.statusTracker().getJobIdsForGroup(self._prefix + stage)
        self._jobs.setdefault(stage, set()).update(ids)

    def counts(self) -> dict[str, int]:
        return {s: len(ids) for s, ids in self._jobs.items()}

    def _wait_for_listeners(self) -> None:
        """Let the status tracker see every job submitted so far (its events are delivered
        asynchronously); best effort, as the method is Spark-internal."""
        jsc = self._sc._jsc
        with suppress(Exception):  # a count a few milliseconds late beats a failed run
            if jsc is not None:
                jsc.sc().listenerBus().waitUntilEmpty()  # pyright: ignore[reportOptionalCall]


# -- bytes each commit rewrote, from the Delta log ---------------------------------------------


def _log_versions(loc: Location) -> list[int]:
    import pyarrow.fs as pafs

    try:
        infos = loc.filesystem().get_file_info(pafs.FileSelector(LOG_DIR, allow_not_found=True))
    except (FileNotFoundError, OSError):
        return []
    names = (info.path.rsplit("/", 1)[-1] for info in infos)
    return sorted(int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit())


def _latest_version(loc: Location) -> int | None:
    versions = _log_versions(loc)
    return versions[-1] if versions else None


def _commits_since(name: str, loc: Location, before: int | None) -> TableCost:
    """The add and remove actions of every commit after version ``before``."""
    fs = None
    added = removed = commits = 0
    for version in _log_versions(loc):
        if before is not None and version <= before:
            continue
        if fs is None:
            fs = loc.filesystem()
        with fs.open_input_stream(f"{LOG_DIR}/{version:020d}.json") as stream:
            lines = stream.read().decode().splitlines()
        sizeless: list[str] = []
        for line in lines:
            action = json.loads(line) if line.strip() else {}
            if "add" in action:
                added += int(action["add"]["size"])
            elif "remove" in action:
                size = action["remove"].get("size")
                if size is None:
                    sizeless.append(action["remove"]["path"])
                else:
                    removed += int(size)
        removed += _sizes_before(loc, version, sizeless)
        commits += 1
    return TableCost(name, commits, added, removed)


def _sizes_before(loc: Location, version: int, paths: list[str]) -> int:
    """The sizes of ``paths`` in the snapshot before ``version`` (a remove without its size)."""
    if not paths:
        return 0
    from cdc_platform.lib.storage import delta

    sizes = {f.path: f.size for f in delta.snapshot_files(delta.open_table(loc, version - 1))}
    return sum(sizes.get(p, 0) for p in paths)
