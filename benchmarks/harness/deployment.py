"""The deployment as ``deploy/`` wires it, started by a benchmark: ``deploy/dagster.yaml`` with
SQLite instead of PostgreSQL, the code server and the daemon from the systemd units' command
lines, a Spark Connect server of its own, and the webserver's GraphQL; every process stopped
whatever happened."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import yaml

from benchmarks.harness.report import log
from benchmarks.harness.table import BIN, REPO_ROOT
from cdc_platform import connect_server
from cdc_platform.lib.config import CONFIG_ENV_VAR
from cdc_platform.lib.spark.connect import CONNECT_AUTH_ENV
from cdc_platform.lib.spark.deployment import SPARK_REMOTE_ENV

DEPLOY = REPO_ROOT / "deploy"
UNITS = DEPLOY / "systemd"


# What the units name, and what it is on this host (as cdc_platform_tests/integration/test_deploy.py runs them).
INSTALL_DIR = "/opt/cdc-platform"
GRPC_HOST = "127.0.0.1"
POLL_S = 0.5
TAIL_CHARS = 3000


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why (and shows the services' logs)."""


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    handle: IO[bytes]

    def tail(self) -> str:
        text = self.log_path.read_text(errors="replace")[-TAIL_CHARS:]
        return f"--- {self.name} ({self.log_path}), last {TAIL_CHARS} characters:\n{text}"


@dataclass
class Stack:
    """The processes this benchmark started, stopped in ``stop()`` whatever happened."""

    work: Path
    env: dict[str, str] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)
    connect: tuple[int, Path] | None = None  # port and state dir of our Spark Connect server

    def start(self, name: str, argv: Sequence[str]) -> Service:
        log_path = self.work / f"{name}.log"
        handle = log_path.open("wb")
        proc = subprocess.Popen(
            list(argv),
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its run workers stop with it
        )
        service = Service(name, proc, log_path, handle)
        self.services.append(service)
        return service

    def tails(self) -> str:
        parts = [s.tail() for s in self.services]
        if self.connect is not None:
            for path in connect_server.log_files(self.connect[1]):
                parts.append(f"--- {path}:\n{path.read_text(errors='replace')[-TAIL_CHARS:]}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        for service in self.services:
            code = service.proc.poll()
            if code is not None:
                raise BenchError(f"{service.name} exited with {code}\n{self.tails()}")

    def stop(self) -> None:
        """The daemon first (no new run starts), then the code server, then Spark Connect."""
        for service in reversed(self.services):
            try:
                stop_group(service.proc)
            except (OSError, subprocess.SubprocessError) as exc:
                log(f"could not stop {service.name} (pid {service.proc.pid}): {exc}")
            service.handle.close()
        self.services.clear()
        if self.connect is not None:
            port, state = self.connect
            self.connect = None
            if not connect_server.stop(port, state) and connect_server.server_pid(state, port):
                log(f"could not stop the Spark Connect server on port {port}")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the process group this benchmark started, SIGKILL to what is left after
    ``grace_s``."""
    signal_group(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    deadline = time.monotonic() + 5
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)  # its children (run workers) end after it
    if group_alive(proc.pid):
        signal_group(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=grace_s)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def unit_command(unit: str, key: str, env: Mapping[str, str]) -> list[str]:
    """A unit's ``ExecStart=``-like line as systemd runs it: split like a shell, ``${NAME}`` from
    the environment, the install paths replaced by this checkout and its venv."""
    prefix = f"{key}="
    lines = (UNITS / unit).read_text().splitlines()
    (line,) = [x.strip()[len(prefix) :] for x in lines if x.strip().startswith(prefix)]
    words = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in shlex.split(line)]
    return [
        w.replace(f"{INSTALL_DIR}/.venv/bin", str(BIN)).replace(INSTALL_DIR, str(REPO_ROOT))
        for w in words
    ]


def wait_for(stack: Stack, what: str, check: Callable[[], object], timeout: float) -> None:
    """Poll until ``check()`` is truthy; fail after ``timeout`` s or if a service died."""
    deadline = time.monotonic() + timeout
    while not check():
        stack.check_alive()
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {timeout:.0f} s\n{stack.tails()}")
        time.sleep(POLL_S)


def start_code_server(stack: Stack, timeout: float) -> None:
    """The code unit's command, then its ``ExecStartPost=`` health check until it answers."""
    stack.start("code-server", unit_command("cdc-platform-code.service", "ExecStart", stack.env))
    what = "the code server's gRPC health check"
    probe = subprocess.Popen(
        unit_command("cdc-platform-code.service", "ExecStartPost", stack.env),
        env=stack.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(stack, what, lambda: probe.poll() is not None, timeout)
    finally:
        if probe.poll() is None:
            stop_group(probe, grace_s=5)
    if probe.returncode != 0:
        raise BenchError(f"{what} exited with {probe.returncode}\n{stack.tails()}")


@dataclass(frozen=True)
class Layout:
    work: Path
    home: Path
    config: Path
    landing: Path
    warehouse: Path

    @classmethod
    def under(cls, work: Path) -> Layout:
        return cls(
            work, work / "dagster_home", work / "cdc_platform.yaml", work / "landing", work / "wh"
        )


def write_instance(home: Path) -> None:
    """``deploy/dagster.yaml`` with SQLite in DAGSTER_HOME instead of PostgreSQL."""
    instance = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    instance["storage"] = {"sqlite": {"base_dir": str(home)}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance, sort_keys=False))


def service_env(
    layout: Layout, grpc_port: int, remote: str | None, auth: Path | None
) -> dict[str, str]:
    """The services' environment, as deploy/cdc-platform.env.example names it. No CDC_* setting
    of the shell reaches them: Spark runs where this benchmark says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}
    pythonpath = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env |= {
        "DAGSTER_HOME": str(layout.home),
        CONFIG_ENV_VAR: str(layout.config),
        "DAGSTER_GRPC_HOST": GRPC_HOST,
        "DAGSTER_GRPC_PORT": str(grpc_port),
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath)),
    }
    if remote is not None and auth is not None:
        env |= {SPARK_REMOTE_ENV: remote, CONNECT_AUTH_ENV: str(auth)}
    return env


def start_connect(stack: Stack, conf: Mapping[str, str] | None = None) -> tuple[str, Path]:
    """A Spark Connect server of this benchmark's own (``conf`` over the server's defaults):
    its URL and auth file."""
    port, state = connect_server.free_port(), stack.work / "spark-connect"
    stack.connect = (port, state)  # stopped by stack.stop() even if start() fails half-way
    url = connect_server.start(port, state_dir=state, conf=conf)
    return url, connect_server.auth_file(state)


@contextmanager
def stopped_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP end the benchmark as Ctrl-C does: through the ``finally`` blocks."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


STARTUP_SECONDS = 300


def graphql(base: str, query: str) -> dict[str, Any]:
    body = json.dumps({"query": query}).encode()
    request = urllib.request.Request(
        f"{base}/graphql", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    if answer.get("errors"):
        raise RuntimeError(answer["errors"])
    return answer["data"]


LOCATION_QUERY = """
query { workspaceOrError { ... on Workspace { locationEntries { name loadStatus
  locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


def wait_until_loaded(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        if proc.poll() is not None:
            sys.exit(f"dagster-webserver exited with {proc.returncode}:\n{log.read_text()}")
        try:
            data = graphql(base, LOCATION_QUERY)["workspaceOrError"]
            entries = data.get("locationEntries") or []
            if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                for e in entries:
                    if e["locationOrLoadError"]["__typename"] != "RepositoryLocation":
                        sys.exit(f"code location failed to load: {e}")
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            sys.exit(f"not loaded within {STARTUP_SECONDS} s:\n{log.read_text()[-4000:]}")
        time.sleep(1)


def run_until_stopped(run: Callable[[], None], cleanup: Callable[[], None] | None = None) -> int:
    """The exit code of a benchmark that starts services: 0 once ``run`` returns, 1 on a
    ``BenchError`` (its message printed), 130 on Ctrl-C, SIGTERM or SIGHUP; ``cleanup`` runs
    in every case, after the message."""
    with stopped_on_signals():
        try:
            run()
        except BenchError as exc:
            log(f"FAILED: {exc}")
            return 1
        except KeyboardInterrupt:
            log("interrupted")
            return 130
        finally:
            if cleanup is not None:
                cleanup()
    return 0
