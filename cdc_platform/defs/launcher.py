"""A run launcher whose run workers run monitoring can check: dead runs are marked failed.

Dagster's ``DefaultRunLauncher`` (``dagster dev``, a single machine) cannot tell run monitoring
whether a run's worker is alive, so a run whose process was killed (``kill -9``, the OOM killer,
a reboot) stays STARTED for good and keeps its table's concurrency slot: the next run of the
table waits forever. This launcher is the default one plus that health check. Every run records
its worker's pid in its first engine event carrying one ("Started process for run (pid: N)",
or the executor's "Executing steps ... (pid: N)" for a run started from the CLI or the demo);
the worker is alive while that process exists and is not a zombie.

With ``run_monitoring`` enabled in ``dagster.yaml``, the monitoring daemon polls this check and
marks a run with a dead worker FAILED; after ``free_slots_after_run_end_seconds`` it frees the
pool slots the run held. A pid says nothing about another host: use this launcher where the
daemon runs on the machine that runs the workers (the project's setup), not across hosts.
"""

from __future__ import annotations

import os

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus

PID_KEY = "pid"


def worker_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The pid of the run's worker process: the first engine event that names one."""
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        data = entry.dagster_event.engine_event_data if entry.dagster_event else None
        value = data.metadata.get(PID_KEY) if data is not None else None
        if value is not None:
            try:
                return int(str(value.value))
            except ValueError:
                continue
    return None


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists on this host and is not a zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process with that pid: cannot tell, assume alive
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class LocalRunLauncher(dg.DefaultRunLauncher):
    """``DefaultRunLauncher`` plus a run worker health check for run monitoring (one host)."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        pid = worker_pid(self._instance, run.run_id)
        if pid is None:
            # Not started far enough to name its process: start_timeout_seconds covers it.
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no worker pid recorded yet")
        if process_alive(pid):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"worker process {pid} is alive")
        return CheckRunHealthResult(WorkerStatus.FAILED, f"worker process {pid} is gone")
