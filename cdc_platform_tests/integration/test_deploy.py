"""The production recipe in ``deploy/``, started as it is against a real PostgreSQL.

A module fixture starts a throw-away PostgreSQL server (``initdb`` + ``pg_ctl``, loopback and a
private socket folder; as the ``postgres`` user when the tests run as root, since initdb refuses
root) and runs the README's psql commands that create the role and the database. DAGSTER_HOME
holds an unchanged copy of ``deploy/dagster.yaml``; the environment is
``deploy/cdc-platform.env.example`` with this test's values.

- A partition materialized through that instance: the run, its materialization and its check
  results are read back through Dagster and counted with SQL in PostgreSQL (no SQLite file).
- The systemd units' own commands, run as systemd would run them from this checkout: the code
  server answers a gRPC health check, the webserver loads ``deploy/workspace.yaml``, and the
  daemon turns a landed file into a queued run that the code server executes (sensor, run
  queue, code server, run worker, PostgreSQL: the production path end to end).
- The database password appears in no log, no stored event and not in the UI's instance page;
  the services print no warning.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
from collections.abc import Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg2
import pytest
import yaml

from cdc_platform import connect_server
from cdc_platform.defs.launcher import LocalRunLauncher, process_alive, worker_pid
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import REPO_ROOT, load_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, history_rows, write_parquet_events
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.integration.test_webserver import (
    free_port,
    graphql,
    http_get,
    wait_for_location,
)

DEPLOY = REPO_ROOT / "deploy"
UNIT_DIR = DEPLOY / "systemd"
ENV_EXAMPLE = DEPLOY / "cdc-platform.env.example"
UNITS = {
    "code": "cdc-platform-code.service",
    "webserver": "cdc-platform-webserver.service",
    "daemon": "cdc-platform-daemon.service",
}
CONNECT_UNIT = "cdc-platform-spark-connect.service"
# The install layout the units name, and what each stands for in this test.
INSTALL_DIR = "/opt/cdc-platform"
STATE_DIR = "/var/lib/cdc-platform"
ENV_FILE = "/etc/cdc-platform/cdc-platform.env"
VENV_BIN = Path(sys.executable).parent
PG_SUPERUSER = "cdc_admin"
# The README's commands that create the instance's role and database.
README_PSQL = [
    "CREATE ROLE dagster LOGIN",
    "\\password dagster",
    "CREATE DATABASE dagster OWNER dagster",
]
STARTUP_SECONDS = 120
RUN_SECONDS = 240
H5 = datetime(2024, 1, 1, 5, tzinfo=UTC)
PARTITION = "2024-01-01-05:00"
RUN_LIFECYCLE = [
    dg.DagsterEventType.RUN_ENQUEUED,
    dg.DagsterEventType.RUN_STARTING,
    dg.DagsterEventType.RUN_START,
    dg.DagsterEventType.RUN_SUCCESS,
]
# Java's one unavoidable line when Spark starts (README, "Known limitations").
JAVA_INCUBATOR_LINE = "WARNING: Using incubator modules: jdk.incubator.vector"
# run_retries starts Dagster's event-log consumer, which says once, on a new instance, that it
# starts from now for each event type it follows (not a fault: there is nothing older to read).
FIRST_START_NOTICE = re.compile(
    r'"event": "No cursor for event type DagsterEventType\.RUN_(FAILURE|SUCCESS), ignoring older'
    r' events", "logger": "dagster\.daemon\.EventLogConsumerDaemon"'
)


# ---------------------------------------------------------------------------------------------
# The files in deploy/, read as systemd and Dagster read them


def env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as systemd's ``EnvironmentFile=`` reads them (``#`` comments)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def unit(name: str) -> dict[str, list[str]]:
    """A unit file as ``Section.Key -> values`` (a key may repeat)."""
    section, entries = "", {}
    for line in (UNIT_DIR / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return entries


def env_references(text: str) -> set[str]:
    """The variables a unit (``${NAME}``) or a Dagster YAML file (``{env: NAME}``) reads."""
    return set(re.findall(r"\$\{(\w+)\}", text)) | set(re.findall(r"\{env:\s*(\w+)\}", text))


def on_this_host(value: str, state_dir: Path) -> str:
    """An install path of the units, as this checkout has it: the venv running the tests, this
    repository, a temporary state folder."""
    return (
        value.replace(f"{INSTALL_DIR}/.venv/bin", str(VENV_BIN))
        .replace(INSTALL_DIR, str(REPO_ROOT))
        .replace(STATE_DIR, str(state_dir))
    )


def command(line: str, env: Mapping[str, str], state_dir: Path) -> list[str]:
    """A unit's ``ExecStart=`` as systemd runs it: words split like a shell, ``${NAME}`` replaced
    by the environment file's value (a missing one fails the test)."""
    words = shlex.split(line)
    return [
        on_this_host(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w), state_dir) for w in words
    ]


# ---------------------------------------------------------------------------------------------
# A real PostgreSQL


@dataclass(frozen=True)
class Postgres:
    port: int
    password: str
    host: str = "127.0.0.1"
    db: str = "dagster"
    user: str = "dagster"

    def env(self) -> dict[str, str]:
        """The connection as deploy/dagster.yaml reads it."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_DB": self.db,
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
        }

    def query(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """As the instance's own role, over TCP with its password: what Dagster sees."""
        connection = psycopg2.connect(
            host=self.host, port=self.port, dbname=self.db, user=self.user, password=self.password
        )
        with closing(connection), connection.cursor() as cursor:
            cursor.execute(statement, params)
            return cursor.fetchall()


def postgres_bin_dir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: on PATH, else Debian's
    ``/usr/lib/postgresql/<version>/bin`` (the postgresql package keeps them off PATH)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(
        (p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")),
        key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else -1,
    )
    return versions[-1] if versions else None


def run_checked(args: list[str]) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{shlex.join(args)} failed:\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (Debian: apt-get install postgresql)")
    as_server_user: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, which initdb refuses, and no 'postgres' user exists")
        as_server_user = ["runuser", "-u", "postgres", "--"]
    # Not pytest's tmp_path (private to this user): the server's user must reach the folder.
    root = Path(tempfile.mkdtemp(prefix="cdc-deploy-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    if owner is not None:
        for path in (root, sockets):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    # Characters a connection URL must escape, and a value unique enough to search logs for.
    pg = Postgres(port=free_port(), password=f"pw/{secrets.token_hex(12)}@:%")
    pg_ctl = [*as_server_user, str(bin_dir / "pg_ctl"), "-D", str(data)]
    started = False
    try:
        run_checked(
            [
                *as_server_user,
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                PG_SUPERUSER,
                "--auth-local=trust",
                "--auth-host=scram-sha-256",  # over TCP, as Dagster connects: password only
                "--no-sync",
                "--no-locale",
                "-E",
                "UTF8",
            ]
        )
        options = f"-p {pg.port} -k {sockets} -c listen_addresses={pg.host} -c fsync=off"
        run_checked(
            [*pg_ctl, "-l", str(root / "server.log"), "-w", "-t", "60", "-o", options, "start"]
        )
        started = True
        # The README's commands, as they are; \password reads the password from stdin when
        # there is no terminal (a new session has none).
        psql = [
            str(bin_dir / "psql"),
            "-h",
            str(sockets),
            "-p",
            str(pg.port),
            "-U",
            PG_SUPERUSER,
            "-d",
            "postgres",
        ]
        for statement in README_PSQL:
            proc = subprocess.run(
                [*psql, "-v", "ON_ERROR_STOP=1", "-c", statement],
                input=f"{pg.password}\n{pg.password}\n",
                capture_output=True,
                text=True,
                timeout=60,
                start_new_session=True,
            )
            assert proc.returncode == 0, f"psql -c {statement!r}: {proc.stderr}"
        yield pg
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# One deployment: DAGSTER_HOME with deploy/dagster.yaml, a config file, the services' environment


@dataclass
class Deployment:
    root: Path
    home: Path
    state: Path
    pg: Postgres
    env: dict[str, str]  # the services' whole environment, as systemd would give it
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def webserver(self) -> str:
        return f"http://{self.env['DAGSTER_WEBSERVER_HOST']}:{self.env['DAGSTER_WEBSERVER_PORT']}"


@pytest.fixture(scope="module")
def deployment(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    root = tmp_path_factory.mktemp("deploy")
    home, state = root / "dagster_home", root / "state"
    home.mkdir()
    state.mkdir()
    shutil.copy(DEPLOY / "dagster.yaml", home / "dagster.yaml")
    config = root / "cdc_platform.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            landing_root: landing
            warehouse_root: warehouse
            tables:
              - name: orders
                primary_key: [id]
                start: "2024-01-01-00:00"
                sensor_interval_seconds: 5
            """
        )
    )
    values = {
        "DAGSTER_HOME": str(home),
        "CDC_PLATFORM_CONFIG": str(config),
        **postgres.env(),
        "DAGSTER_GRPC_HOST": "127.0.0.1",
        "DAGSTER_GRPC_PORT": str(free_port()),
        "DAGSTER_WEBSERVER_HOST": "127.0.0.1",
        "DAGSTER_WEBSERVER_PORT": str(free_port()),
    }
    example = env_file(ENV_EXAMPLE)
    assert set(values) <= set(example), "the example env file must name every variable set here"
    # What systemd gives a service: its environment file, HOME and a PATH; PYTHONPATH because
    # this venv's editable install points at another checkout than the one under test.
    env = {
        **example,
        **values,
        "HOME": str(state),
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(REPO_ROOT),
    }
    if "JAVA_HOME" in os.environ:
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    write_parquet_events(
        load_config(config).landing_path,
        "orders",
        H5,
        [ev("INSERT", 1, H5, 1, status="new"), ev("INSERT", 2, H5, 2, status="paid")],
    )
    return Deployment(root, home, state, postgres, env)


@pytest.fixture(scope="module")
def instance(deployment: Deployment) -> Iterator[dg.DagsterInstance]:
    """``DagsterInstance.get()`` in this process: DAGSTER_HOME and the PG variables set."""
    with pytest.MonkeyPatch.context() as patch:
        for key in ("DAGSTER_HOME", *deployment.pg.env()):
            patch.setenv(key, deployment.env[key])
        with dg.DagsterInstance.get() as loaded:
            yield loaded


def check_evaluations(instance: dg.DagsterInstance, run_id: str) -> dict[str, bool]:
    """Check name -> passed, for every check result the run stored."""
    results: dict[str, bool] = {}
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
        if entry.dagster_event is not None:
            data = entry.dagster_event.asset_check_evaluation_data
            results[data.check_name] = data.passed
    return results


def assert_stored_in_postgres(pg: Postgres, run_id: str, table: str) -> None:
    """The run, one materialization and every check passed, counted with SQL."""
    assert pg.query("SELECT status FROM runs WHERE run_id = %s", (run_id,)) == [("SUCCESS",)]
    materialized = pg.query(
        "SELECT asset_key, partition FROM event_logs"
        " WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION'",
        (run_id,),
    )
    assert materialized == [(f'["{table}"]', PARTITION)]
    # Dagster also keeps a PLANNED row per check for the run's partition: the checks are not
    # partitioned, so their results are stored as rows of their own, under no partition.
    checks = pg.query(
        "SELECT check_name, execution_status, partition FROM asset_check_executions"
        " WHERE run_id = %s AND execution_status <> 'PLANNED'",
        (run_id,),
    )
    assert sorted(checks) == sorted((n, "SUCCEEDED", None) for n in invariants.CHECK_NAMES)


# ---------------------------------------------------------------------------------------------
# The files agree with each other


def test_units_environment_workspace_and_readme_agree() -> None:
    example = env_file(ENV_EXAMPLE)
    readme = (REPO_ROOT / "docs" / "deploying.md").read_text()
    for statement in README_PSQL:
        assert f'sudo -u postgres psql -c "{statement}"' in readme
    for path in (
        ENV_FILE,
        example["CDC_PLATFORM_CONFIG"],
        f"{example['DAGSTER_HOME']}/dagster.yaml",
    ):
        assert path in readme, path
    for name in (*UNITS.values(), CONNECT_UNIT):
        entries = unit(name)
        assert entries["Service.EnvironmentFile"] == [ENV_FILE], name
        assert entries["Service.User"] == ["cdc-platform"], name
        used = env_references((UNIT_DIR / name).read_text())
        assert used <= set(example), f"{name} reads {sorted(used - set(example))}"
    for name in ("dagster.yaml", "workspace.yaml"):
        used = env_references((DEPLOY / name).read_text())
        assert used and used <= set(example), f"{name} reads {sorted(used - set(example))}"
    assert "CHANGE-ME" in example["DAGSTER_PG_PASSWORD"]  # a placeholder, never a secret

    (location,) = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())["load_from"]
    code = shlex.split(unit(UNITS["code"])["Service.ExecStart"][0])
    assert code[code.index("--location-name") + 1] == location["grpc_server"]["location_name"]
    assert code[code.index("--module-name") + 1] == "cdc_platform.definitions"
    for name in ("webserver", "daemon"):
        words = shlex.split(unit(UNITS[name])["Service.ExecStart"][0])
        assert words[words.index("--workspace") + 1] == f"{INSTALL_DIR}/deploy/workspace.yaml"

    # The Spark Connect unit: systemd tracks the pid file the server's start script writes.
    connect = unit(CONNECT_UNIT)
    start = shlex.split(connect["Service.ExecStart"][0])
    port, state = start[start.index("--port") + 1], start[start.index("--state-dir") + 1]
    assert connect["Service.PIDFile"] == [str(connect_server.pid_file(Path(state), int(port)))]
    # Its clients read the auth file the server writes in its state folder.
    auth = f"CDC_SPARK_CONNECT_AUTH={connect_server.auth_file(Path(state))}"
    assert auth in ENV_EXAMPLE.read_text()


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """systemd's own check (unknown keys, bad values, missing executables), on copies that
    name this checkout's paths."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    env = tmp_path / "cdc-platform.env"
    shutil.copy(ENV_EXAMPLE, env)
    copies = []
    for name in (*UNITS.values(), CONNECT_UNIT):
        text = on_this_host((UNIT_DIR / name).read_text(), tmp_path).replace(ENV_FILE, str(env))
        (tmp_path / name).write_text(text)
        copies.append(str(tmp_path / name))
    proc = subprocess.run(
        [analyze, "verify", *copies], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0 and not proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# The instance


def test_instance_stores_runs_events_and_checks_in_postgres(
    spark,
    services: dict[str, subprocess.Popen[bytes]],  # started first: they boot meanwhile
    deployment: Deployment,
    instance: dg.DagsterInstance,
    tmp_path: Path,
) -> None:
    assert isinstance(instance.run_launcher, LocalRunLauncher)
    assert isinstance(instance.run_coordinator, dg.QueuedRunCoordinator)
    assert instance.run_monitoring_enabled
    assert instance.get_concurrency_config().pool_config.default_pool_limit == 1

    # A table of its own, in a lake of its own: the services serve another config.
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - {name: customers, primary_key: [id], start: "2024-01-01-00:00"}\n'
    )
    platform = load_config(config)
    write_parquet_events(
        platform.landing_path, "customers", H5, [ev("INSERT", 1, H5, 1, status="new")]
    )
    defs = build_table_definitions(platform, platform.table("customers"))
    result = dg.materialize(
        [defs.asset, defs.checks],
        partition_key=PARTITION,
        instance=instance,
        resources=dagster_resources(),
    )
    assert result.success
    run_id = result.run_id

    # Read back through Dagster...
    run = instance.get_run_by_id(run_id)
    assert run is not None and run.status == dg.DagsterRunStatus.SUCCESS
    latest = instance.get_latest_materialization_event(dg.AssetKey("customers"))
    assert latest is not None and latest.run_id == run_id
    assert check_evaluations(instance, run_id) == dict.fromkeys(invariants.CHECK_NAMES, True)
    assert worker_pid(instance, run_id) == os.getpid()  # what run monitoring reads back
    # ...and counted in PostgreSQL, with nothing in SQLite.
    assert_stored_in_postgres(deployment.pg, run_id, "customers")
    assert not [p for p in deployment.home.rglob("*") if p.suffix in (".db", ".sqlite")]
    rows = history_rows(TablePaths.of(platform.warehouse_root, "customers").history)
    assert [(r["id"], r["status"], r["_fivetran_active"]) for r in rows] == [(1, "new", True)]


# ---------------------------------------------------------------------------------------------
# The services, started with the units' own commands


@pytest.fixture(scope="module")
def services(deployment: Deployment) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The three units in systemd's order: the code server, then (``After=`` it, so once its
    ``ExecStartPost=`` has finished) the webserver and the daemon."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    handles = []
    try:
        for name, unit_name in UNITS.items():
            entries = unit(unit_name)
            argv = command(entries["Service.ExecStart"][0], deployment.env, deployment.state)
            cwd = on_this_host(entries["Service.WorkingDirectory"][0], deployment.state)
            log_path = deployment.root / f"{name}.log"
            handle = log_path.open("wb")
            handles.append(handle)
            deployment.logs[name] = log_path
            procs[name] = subprocess.Popen(
                argv,
                cwd=cwd,
                env=deployment.env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: its run workers are stopped with it
            )
            for post in entries.get("Service.ExecStartPost", []):
                start_post(command(post, deployment.env, deployment.state), procs, deployment)
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for handle in handles:
            handle.close()


def start_post(
    argv: list[str], procs: Mapping[str, subprocess.Popen[bytes]], deployment: Deployment
) -> None:
    """An ``ExecStartPost=`` command, run to its end while its service stays up."""
    post = subprocess.Popen(argv, env=deployment.env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_SECONDS
    try:
        while post.poll() is None:
            alive_or_fail(procs, deployment)
            if time.monotonic() > deadline:
                pytest.fail(f"{shlex.join(argv)} still running after {STARTUP_SECONDS}s")
            time.sleep(0.5)
    finally:
        if post.poll() is None:
            post.kill()
            post.wait(timeout=30)
    assert post.returncode == 0, f"{shlex.join(argv)} exited with {post.returncode}"


def log_text(deployment: Deployment, name: str) -> str:
    return deployment.logs[name].read_text(errors="replace")


def alive_or_fail(procs: Mapping[str, subprocess.Popen[bytes]], deployment: Deployment) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            pytest.fail(
                f"{name} exited with {proc.returncode}:\n{log_text(deployment, name)[-4000:]}"
            )


def test_code_server_unit_answers_grpc_health_check(
    services: dict[str, subprocess.Popen[bytes]], deployment: Deployment
) -> None:
    """The unit's own ExecStartPost already waited for this; here the answer itself."""
    host, port = deployment.env["DAGSTER_GRPC_HOST"], deployment.env["DAGSTER_GRPC_PORT"]
    alive_or_fail(services, deployment)
    check = subprocess.run(
        [
            str(VENV_BIN / "dagster"),
            "api",
            "grpc-health-check",
            "--host",
            host,
            "--port",
            port,
        ],
        env=deployment.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0 and "gRPC connection successful" in check.stdout, check


def test_webserver_unit_loads_the_deploy_workspace(
    services: dict[str, subprocess.Popen[bytes]], deployment: Deployment
) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while True:
        alive_or_fail(services, deployment)
        try:
            info = http_get(f"{deployment.webserver}/server_info")
            break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                pytest.fail(f"no /server_info:\n{log_text(deployment, 'webserver')[-4000:]}")
            time.sleep(1)
    assert "dagster_webserver_version" in info
    with deployment.logs["webserver"].open() as log:
        wait_for_location(deployment.webserver, deadline, log)
    data = graphql(
        deployment.webserver,
        "{ repositoriesOrError { ... on RepositoryConnection { nodes {"
        " location { name } assetNodes { assetKey { path } } } } } }",
    )
    (repository,) = data["repositoriesOrError"]["nodes"]
    assert repository["location"]["name"] == "cdc_platform"  # deploy/workspace.yaml's name
    assert [n["assetKey"]["path"] for n in repository["assetNodes"]] == [["orders"]]


@pytest.fixture(scope="module")
def sensor_run(
    services: dict[str, subprocess.Popen[bytes]],
    deployment: Deployment,
    instance: dg.DagsterInstance,
) -> dg.DagsterRun:
    """The run the daemon starts for the landed file: the landing sensor requests it, the run
    queue releases it, the code server runs it. Waits until it has ended."""
    sensor = dg.RunsFilter(tags={"dagster/sensor_name": "orders_landing_sensor"})
    deadline = time.monotonic() + RUN_SECONDS
    while True:
        alive_or_fail(services, deployment)
        runs = instance.get_runs(filters=sensor)
        if runs and runs[0].is_finished:
            assert len(runs) == 1, [r.run_id for r in runs]
            return runs[0]
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{log_text(deployment, n)[-3000:]}" for n in UNITS)
            pytest.fail(f"no finished sensor run within {RUN_SECONDS}s: {runs}\n{logs}")
        time.sleep(1)


def test_daemon_runs_landed_files_through_the_queue_and_the_code_server(
    sensor_run: dg.DagsterRun,
    services: dict[str, subprocess.Popen[bytes]],
    deployment: Deployment,
    instance: dg.DagsterInstance,
) -> None:
    run_id = sensor_run.run_id
    events = instance.all_logs(run_id)
    errors = [e.message for e in events if e.dagster_event and e.dagster_event.is_failure]
    assert sensor_run.status == dg.DagsterRunStatus.SUCCESS, errors
    lifecycle = [
        e.dagster_event.event_type
        for e in events
        if e.dagster_event is not None and e.dagster_event.event_type in RUN_LIFECYCLE
    ]
    # Queued by the QueuedRunCoordinator, released by the daemon, run to the end.
    assert lifecycle == RUN_LIFECYCLE
    # Started by the code server in a process of its own, whose pid run monitoring reads.
    started = [e.message for e in events if e.message.startswith("Started process for run")]
    pid = worker_pid(instance, run_id)
    assert started == [f"Started process for run (pid: {pid})."]
    assert pid is not None and pid not in (os.getpid(), *(p.pid for p in services.values()))
    assert sensor_run.tags["dagster/partition"] == PARTITION
    assert check_evaluations(instance, run_id) == dict.fromkeys(invariants.CHECK_NAMES, True)
    assert_stored_in_postgres(deployment.pg, run_id, "orders")
    warehouse = load_config(deployment.env["CDC_PLATFORM_CONFIG"]).warehouse_root
    rows = history_rows(TablePaths.of(warehouse, "orders").history)
    assert [(r["id"], r["status"]) for r in rows] == [(1, "new"), (2, "paid")]


def test_no_password_in_logs_events_or_ui_and_no_warnings(
    sensor_run: dg.DagsterRun, deployment: Deployment, instance: dg.DagsterInstance
) -> None:
    password = deployment.pg.password
    for name in UNITS:
        text = log_text(deployment, name)
        assert password not in text, f"the password is in the {name} log"
        assert "\x1b" not in text, f"{name} logs escape codes (journalctl: '[N blob data]')"
        noise = [
            line
            for line in text.splitlines()
            if "warn" in line.lower()
            and line.strip() != JAVA_INCUBATOR_LINE
            and not FIRST_START_NOTICE.search(line)
        ]
        assert noise == [], f"{name} printed warnings:\n" + "\n".join(noise)
    for run in instance.get_runs():
        for entry in instance.all_logs(run.run_id):
            assert password not in dg.serialize_value(entry), f"the password in run {run.run_id}"
    for path in (deployment.home / "storage").rglob("*"):  # captured stdout/stderr of runs
        if path.is_file():
            assert password.encode() not in path.read_bytes(), path
    info = graphql(deployment.webserver, "{ instance { info } }")["instance"]["info"]
    assert "run_storage: PostgresRunStorage" in info and password not in info


@pytest.mark.connect
def test_spark_connect_unit_starts_and_stops_the_server(tmp_path: Path) -> None:
    """``Type=forking``: ExecStart returns once the server listens, and systemd then follows the
    process its PIDFile= names; ExecStop ends it. On a free port instead of the unit's."""
    entries = unit(CONNECT_UNIT)
    unit_port, port = "15002", str(connect_server.free_port())
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"], "PYTHONPATH": str(REPO_ROOT)}
    env |= {k: v for k, v in os.environ.items() if k == "JAVA_HOME"}

    def run(key: str) -> None:
        argv = command(entries[key][0], env, tmp_path)
        argv = [port if w == unit_port else w for w in argv]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    pid_file = Path(on_this_host(entries["Service.PIDFile"][0], tmp_path).replace(unit_port, port))
    run("Service.ExecStart")
    try:
        pid = int(pid_file.read_text())
        assert connect_server.server_pid(tmp_path / "spark-connect", int(port)) == pid
    finally:
        run("Service.ExecStop")
    assert not pid_file.exists() and not process_alive(pid)
