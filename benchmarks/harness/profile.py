"""Where a run's wall time goes: the driver's Python sampled by py-spy, Spark's jobs read from
its event log, both cut to the same windows and printed as one table.

``Sampler`` records one process (this one, or a run's) with ``py-spy record --idle``: a thread
blocked on a socket is sampled too, so the time the driver waits on the JVM is counted, not
lost. Each sample of a window (a stack through one of its ``frames``, say ``small_hour``) is
put in one bucket by the innermost frame of a known library: py4j (the driver waiting on the
JVM: Spark jobs, planning, analysis), delta-rs, Arrow, Dagster, PySpark's own Python (results,
serializers), and else the platform's own Python. The event log (``spark.eventLog.enabled``)
gives the Spark jobs of each job group: their count and seconds, so the JVM's time outside a
job (planning, analysis, py4j round trips) is the py4j bucket less the jobs' seconds.

Samples are seconds at the sampling rate (``RATE``); figures are indicative like every second
here, counts exact.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.report import log, print_table

RATE = 100  # samples a second
JOB_GROUP = "spark.jobGroup.id"

# (bucket, how a frame's file path starts, as py-spy prints it: relative to its sys.path
# entry): the first bucket with a frame anywhere in the stack
WAITS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Spark: driver waits on the JVM (py4j)", ("py4j/",)),
    ("Spark Connect: driver waits on the server", ("pyspark/sql/connect/",)),
    ("delta-rs: log reads and commits", ("deltalake/",)),
    ("Arrow: reads, casts, transfers", ("pyarrow/",)),
    ("PySpark's Python: results, serializers", ("pyspark/",)),
)
# then the innermost frame of one of these (Dagster wraps a run's every step)
OWNERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("imports (a process's first use of a module)", ("<frozen importlib",)),
    (
        "Dagster: events, instance, storage",
        ("dagster/", "dagster_pyspark/", "sqlalchemy/", "grpc/"),
    ),
    ("the platform's Python on the driver", ("cdc_platform/", "benchmarks/")),
)
OTHER = "other Python (standard library)"
BUCKETS = (*(b for b, _ in WAITS), *(b for b, _ in OWNERS), OTHER)
SPARK = (WAITS[0][0], WAITS[1][0])  # a classic session's JVM, or a Connect server


def py_spy() -> str:
    """The py-spy executable of this environment (a dev dependency)."""
    found = shutil.which("py-spy") or str(Path(__file__).parents[2] / ".venv/bin/py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: make install (it is a dev dependency)")
    return found


class Sampler:
    """``py-spy record`` of process ``pid`` while the ``with`` block runs, into ``out``."""

    def __init__(self, pid: int, out: Path, subprocesses: bool = False) -> None:
        self.pid, self.out, self.subprocesses = pid, out, subprocesses
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Sampler:
        cmd = [py_spy(), "record", "--pid", str(self.pid), "--idle", "--threads"]
        cmd += ["--rate", str(RATE), "--format", "raw", "--output", str(self.out), "--nonblocking"]
        if self.subprocesses:
            cmd.append("--subprocesses")
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the window opens
        if self._proc.poll() is not None:  # say so now, not after the runs it was to sample
            err = self._proc.communicate()[1].decode(errors="replace")[-500:]
            raise SystemExit(
                f"py-spy could not sample process {self.pid} (it needs ptrace: root, "
                f"CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0): {err}"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        _, err = self._proc.communicate(timeout=120)
        if not self.out.exists() and exc[0] is None:  # never mask the block's own error
            raise SystemExit(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")


@dataclass(frozen=True)
class Stack:
    frames: tuple[str, ...]  # outermost first, each "function (file:line)"
    samples: int


def read_stacks(path: Path) -> list[Stack]:
    """py-spy's raw (collapsed) format: ``thread (tid);frame;...;frame count`` a line."""
    stacks = []
    for line in path.read_text().splitlines():
        body, _, count = line.rpartition(" ")
        if body and count.isdigit():
            stacks.append(Stack(tuple(body.split(";")), int(count)))
    return stacks


def bucket(frames: Sequence[str]) -> str:
    """The bucket of a sample: what it waits on, else whose code it is in (innermost)."""
    files = [_file(f) for f in frames]
    for name, markers in WAITS:
        if any(f.startswith(markers) for f in files):
            return name
    for file in reversed(files):
        for name, markers in OWNERS:
            if file.startswith(markers):
                return name
    return OTHER


def _file(frame: str) -> str:
    """``function (file:line)`` -> ``file``."""
    return frame.rpartition(" (")[2].rpartition(":")[0]


def _function(frame: str) -> str:
    """``main.<locals>.small_hour (file:line)`` -> ``small_hour``."""
    return frame.rpartition(" (")[0].rpartition(".")[2]


def split(stacks: Iterable[Stack], window: str) -> dict[str, float]:
    """Seconds per bucket of the samples whose stack passes through ``window`` (a function
    name, as ``small_hour``): the window's thread, not the process's idle ones."""
    seconds: dict[str, float] = {}
    for s in stacks:
        if any(_function(f) == window for f in s.frames):
            name = bucket(s.frames)
            seconds[name] = seconds.get(name, 0.0) + s.samples / RATE
    return seconds


def jvm_calls(stacks: Iterable[Stack], window: str) -> dict[str, float]:
    """Seconds the driver waited on Spark in ``window``, by the call that waited: the
    platform's innermost function and the PySpark API it called (``openings -> orderBy``), to
    tell an action's Spark jobs from a plan's analysis."""
    seconds: dict[str, float] = {}
    for s in stacks:
        if not any(_function(f) == window for f in s.frames) or bucket(s.frames) not in SPARK:
            continue
        files = [_file(f) for f in s.frames]
        api = next((i for i, f in enumerate(files) if f.startswith("pyspark/")), len(files))
        ours = [i for i in range(api) if files[i].startswith(("cdc_platform/", "benchmarks/"))]
        caller = _function(s.frames[ours[-1]]) if ours else "?"
        called = _function(s.frames[api]) if api < len(files) else "?"
        key = f"{caller} -> {called}"
        seconds[key] = seconds.get(key, 0.0) + s.samples / RATE
    return seconds


@dataclass(frozen=True)
class Jobs:
    count: int
    seconds: float


def spark_jobs(
    event_logs: Iterable[Path], window_of: Callable[[str], str | None], since_ms: int
) -> dict[str, Jobs]:
    """The Spark jobs submitted from ``since_ms`` (epoch milliseconds) on, by window:
    ``window_of`` names the window of a job group's stage (the part after the last ``/`` of
    ``cdc_platform-run-<id>/<stage>``, empty outside one; None: not counted)."""
    started: dict[int, tuple[str, int]] = {}
    ended: dict[int, int] = {}
    for path in event_logs:
        for line in _event_lines(path):
            try:
                event = json.loads(line)
            except ValueError:  # the last line of a log whose writer was killed
                continue
            kind = event.get("Event")
            if kind == "SparkListenerJobStart" and event["Submission Time"] >= since_ms:
                group = (event.get("Properties") or {}).get(JOB_GROUP) or ""
                window = window_of(group.rpartition("/")[2])
                if window is not None:
                    started[event["Job ID"]] = (window, event["Submission Time"])
            elif kind == "SparkListenerJobEnd":
                ended[event["Job ID"]] = event["Completion Time"]
    spans: dict[str, list[tuple[int, int]]] = {}
    for job, (window, at) in started.items():
        spans.setdefault(window, []).append((at, ended.get(job, at)))
    return {w: Jobs(len(js), _covered(js) / 1000) for w, js in spans.items()}


def _covered(spans: list[tuple[int, int]]) -> int:
    """The milliseconds at least one of ``spans`` covers: jobs that overlap (concurrent runs
    on one Connect server) count once, so the seconds are those a job was running."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def event_log_files(folder: Path) -> list[Path]:
    """Spark's event log files under ``folder``: Spark 4 rolls them, zstd-compressed, into an
    ``eventlog_v2_<app>`` folder beside its status files; a log not rolled is one file."""
    rolled = [p for p in folder.rglob("events_*") if p.is_file()]
    single = [p for p in folder.glob("*") if p.is_file() and p.name.startswith(("local-", "app-"))]
    return sorted(rolled + single)  # a log not rolled (spark.eventLog.rolling.enabled=false)


def _event_lines(path: Path) -> list[str]:
    """The log's lines; of a log cut short (its writer killed), those before the cut."""
    data = path.read_bytes()
    if path.suffix == ".zstd":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
        chunks = []
        try:
            while chunk := reader.read(1 << 20):
                chunks.append(chunk)
        except zstandard.ZstdError:
            pass
        data = b"".join(chunks)
    return [line for line in data.decode(errors="replace").splitlines() if line.strip()]


def print_split(
    title: str,
    seconds: Mapping[str, float],
    jobs: Jobs | None,
    per: int,
    wall: float | None = None,
    unit: str = "run",
) -> None:
    """One window's table: seconds per bucket (per ``unit``: ``per`` of them were sampled),
    Spark's jobs inside the Spark bucket, and the run's own clock beside the samples."""
    total = sum(seconds.values()) / per
    spark = max(SPARK, key=lambda name: seconds.get(name, 0.0))
    rows: list[list[object]] = []
    for name in BUCKETS:
        s = seconds.get(name, 0.0) / per
        if not s and name != spark:
            continue
        rows.append([name, f"{s:.3f}", f"{100 * s / total:.0f}%" if total else "-"])
        if name == spark and jobs is not None:
            in_jobs = jobs.seconds / per
            rows.append(
                [f"  of it, {jobs.count / per:g} Spark job(s) running", f"{in_jobs:.3f}", ""]
            )
            rows.append(
                ["  of it, Spark outside a job (plans, round trips)", f"{s - in_jobs:.3f}", ""]
            )
    rows.append(["total sampled", f"{total:.3f}", "100%"])
    if wall is not None:
        rows.append([f"wall (the {unit}'s own clock)", f"{wall:.3f}", ""])
    log(f"\n{title}: where the wall time goes, seconds per {unit} ({per} sampled)")
    print_table(["bucket", "s", "share"], rows)


def print_calls(
    title: str, seconds: Mapping[str, float], per: int, top: int = 12, unit: str = "run"
) -> None:
    """The waits on Spark of a window by call, the longest first (per ``unit``)."""
    rows = [
        [call, f"{s / per:.3f}"] for call, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]
    ]
    log(f"\n{title}: the driver's waits on Spark by call, seconds per {unit} (top {top})")
    print_table(["platform function -> PySpark call", "s"], rows)
