"""The platform on a real Spark standalone cluster, cell by cell equal to local mode.

A fixture starts a standalone Master and two Workers (1 core each, each with its own work
dir) from the pyspark package's ``bin/spark-class``, on loopback, with ``spark.authenticate``
and a shared secret, and stops them by PID afterwards. Two tables, plain Parquet (read by
Spark natively) and an encrypted, compressed CSV table (decoded in Python tasks with keys from
the keyring), go through the Dagster asset and its checks twice: in local mode in this process,
and through ``dagster asset materialize`` against ``spark://127.0.0.1:<port>``. The executors'
Python cannot import the project from its checkout or its editable install: they run the code
the driver ships them (``lib.spark.session.ship_package``). Afterwards no key appears in anything the
cluster wrote to disk: work dirs, daemon logs, the application's event log.

Opt in with ``--run-cluster`` (``make test-cluster``): three extra JVMs on two cores.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pyspark
import pytest
from deltalake import DeltaTable

from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tags import RANGE_END_TAG, RANGE_START_TAG
from cdc_platform.demo.s3 import free_port
from cdc_platform.lib.config import REPO_ROOT, PlatformConfig, load_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.landing.decoding.codecs import encode_file_bytes
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    event,
    materialize_with_cli,
    write_parquet_events,
)

pytestmark = pytest.mark.cluster

SPARK_HOME = Path(pyspark.__file__).parent
H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
RANGE = ("2024-01-01-00:00", "2024-01-01-01:00")
KEY = bytes(range(7, 39))  # the payments table's AES-256 key
CONFIG = """\
landing_root: landing
warehouse_root: warehouse
tables:
  - name: orders
    primary_key: [id]
    start: "2024-01-01-00:00"
  - name: payments
    primary_key: [payment_id]
    start: "2024-01-01-00:00"
    format: csv
    compression: zstd
    encryption: aes-256-cbc
    columns: {payment_id: long, amount: double, status: string}
"""


@dataclass
class Cluster:
    url: str
    secret: str
    folder: Path
    pids: list[int]


def _start(cmd: list[str], folder: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=folder,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped with everything it started
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A standalone Master and two 1-core Workers, started from a folder that is not the
    repository, with RPC authentication and encryption on."""
    folder = tmp_path_factory.mktemp("cluster")
    secret = secrets.token_hex(32)
    props = folder / "spark-daemons.conf"
    props.write_text(
        "spark.authenticate true\n"
        f"spark.authenticate.secret {secret}\n"
        "spark.network.crypto.enabled true\n"
        "spark.worker.cleanup.enabled false\n"
    )
    props.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {"SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYTHONPATH", None)
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    port, ui = free_port(), free_port()
    procs = [
        _start(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(ui),
                "--properties-file",
                str(props),
            ],
            folder,
            folder / "master.log",
            env,
        )
    ]
    url = f"spark://127.0.0.1:{port}"
    try:
        _wait_for_workers(ui, 0, procs)
        for n in (1, 2):
            work = folder / f"worker{n}"
            work.mkdir()
            procs.append(
                _start(
                    [
                        spark_class,
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        "127.0.0.1",
                        "--cores",
                        "1",
                        "--memory",
                        "1g",
                        "--work-dir",
                        str(work),
                        "--webui-port",
                        str(free_port()),
                        "--properties-file",
                        str(props),
                        url,
                    ],
                    work,
                    folder / f"worker{n}.log",
                    env,
                )
            )
        _wait_for_workers(ui, 2, procs)
        yield Cluster(url, secret, folder, [p.pid for p in procs])
    finally:
        _stop(procs)
        for p in procs:
            with pytest.raises(ProcessLookupError):
                os.kill(p.pid, 0)


def _wait_for_workers(ui_port: int, count: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert all(p.poll() is None for p in procs), "a cluster daemon exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as r:
                state = json.load(r)
            if state.get("status") == "ALIVE" and state.get("aliveworkers", 0) >= count:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the cluster did not reach {count} workers"
        time.sleep(1)


# -- the data ---------------------------------------------------------------------------------


def _orders(hour: datetime, seq0: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(30):
        op = "DELETE" if i % 11 == 10 else ("INSERT" if i < 10 else "UPDATE")
        cols = {} if op == "DELETE" else {"status": f"s{i % 4}", "amount": i * 1.5}
        ts = hour + timedelta(seconds=i * 7)
        rows.append(event(op, seq0 + i, ts, i % 12, **cols))
    return rows


def _payments_csv(hour: datetime, seq0: int) -> bytes:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["payment_id", "amount", "status", *_CDC])
    for i in range(25):
        op = "DELETE" if i % 9 == 8 else ("INSERT" if i < 10 else "UPDATE")
        ts = (hour + timedelta(seconds=i * 11, microseconds=i)).isoformat()
        w.writerow([i % 10, f"{i * 2.25}", f"p{i % 3}", op, seq0 + i, ts])
    return out.getvalue().encode()


_CDC = ["cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"]


def write_landing(root: Path) -> PlatformConfig:
    """Both tables' files for two hours, plus a late Parquet file in the first hour."""
    (root / "cdc_platform.yaml").write_text(CONFIG)
    ring = root / "keyring.json"
    ring.write_text(json.dumps({"tables": {"payments": base64.b64encode(KEY).decode()}}))
    ring.chmod(0o600)
    platform = load_config(root / "cdc_platform.yaml")
    landing = platform.landing_path
    for n, hour in enumerate((H0, H1)):
        write_parquet_events(landing, "orders", hour, _orders(hour, 1000 * n + 1), name="o.parquet")
        folder = hour_folder(landing, "payments", hour)
        folder.mkdir(parents=True, exist_ok=True)
        data = encode_file_bytes(_payments_csv(hour, 1000 * n + 1), "zstd", "aes-256-cbc", KEY)
        (folder / "p.csv.zst.aes").write_bytes(data)
    late = _orders(H0 - timedelta(days=2), 500)[:8]
    write_parquet_events(landing, "orders", H0, late, name="late.parquet")
    return platform


def table_rows(path: Path) -> list[dict[str, Any]]:
    """Every cell but the times a run stamps (when it synced, when it ingested)."""
    tbl = DeltaTable(str(path)).to_pyarrow_table()
    stamped = {"_fivetran_synced", "_cdc_ingested_at"}
    rows = [{k: v for k, v in r.items() if k not in stamped} for r in tbl.to_pylist()]
    return sorted(rows, key=lambda r: json.dumps(r, default=str, sort_keys=True))


# -- the test ---------------------------------------------------------------------------------


def test_pipeline_on_a_standalone_cluster_equals_local_mode(
    spark, cluster, tmp_path, monkeypatch
) -> None:
    local, remote = tmp_path / "local", tmp_path / "cluster"
    for root in (local, remote):
        root.mkdir()

    # Local mode, in this process, through the same Dagster assets and checks.
    platform = write_landing(local)
    tags = {RANGE_START_TAG: RANGE[0], RANGE_END_TAG: RANGE[1]}
    monkeypatch.setenv("CDC_KEYRING", str(local / "keyring.json"))  # the deployment's keyring
    for name in ("orders", "payments"):
        defs = build_table_definitions(platform, platform.table(name))
        result = dg.materialize(
            [defs.asset, defs.checks],
            tags=tags,
            instance=dg.DagsterInstance.ephemeral(),
            resources=dagster_resources(),
        )
        assert result.success
        assert all(e.passed for e in result.get_asset_check_evaluations())

    # The cluster, through the CLI, as a deployment runs it.
    remote_platform = write_landing(remote)
    home = remote / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO_ROOT / "dagster.yaml").read_text())
    executor_python = _python_without_the_project(remote)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {
        "CDC_PLATFORM_CONFIG": str(remote / "cdc_platform.yaml"),
        "CDC_KEYRING": str(remote / "keyring.json"),
        "CDC_SPARK_MASTER": cluster.url,
        "CDC_SPARK_AUTH_SECRET": cluster.secret,
        "DAGSTER_HOME": str(home),
        "PYSPARK_PYTHON": str(executor_python),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_CONF_DIR": str(_event_log_conf(remote)),
    }
    started = time.monotonic()
    # cwd: not the repository: nothing may depend on the working directory
    proc = materialize_with_cli("orders,payments", "...".join(RANGE), env, cwd=remote)
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"cluster run: {wall:.1f} s for the CLI process")

    instance = dg.DagsterInstance.from_config(str(home))
    (run,) = instance.get_runs()
    assert run.status == dg.DagsterRunStatus.SUCCESS
    checks = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    evaluations = [e.dagster_event.event_specific_data for e in checks]  # type: ignore[union-attr]
    # Every check of both tables, each passed.
    assert len(evaluations) == 2 * len(invariants.CHECK_NAMES)
    assert all(e.passed for e in evaluations)  # type: ignore[union-attr]

    for name in ("orders", "payments"):
        for part in ("history", "changelog"):
            a = getattr(TablePaths.of(platform.warehouse_root, name), part)
            b = getattr(TablePaths.of(remote_platform.warehouse_root, name), part)
            assert table_rows(a.path) == table_rows(b.path), (name, part)
    assert table_rows(TablePaths.of(platform.warehouse_root, "payments").history.path)

    # The executors ran the shipped code: they could not have imported it any other way.
    fetched = list(cluster.folder.glob("worker*/app-*/*/cdc_platform-*.zip"))
    assert fetched, "no executor fetched the platform's code"
    probe = subprocess.run(
        [str(executor_python), "-c", "import cdc_platform"], capture_output=True, cwd=remote
    )
    assert probe.returncode != 0  # the executors' Python alone cannot import the project

    # No key (or the cluster's secret) in anything the cluster or the application wrote.
    written = [p for p in cluster.folder.rglob("*") if p.is_file() and p.suffix != ".zip"]
    written += [p for p in (remote / "spark-events").rglob("*") if p.is_file()]
    assert any("spark-events" in str(p) for p in written), "no event log was written"
    for p in written:
        data = p.read_bytes()
        for secret in (KEY, base64.b64encode(KEY), KEY.hex().encode()):
            assert secret not in data, f"a key in {p}"
        if p.name != "spark-daemons.conf":
            assert cluster.secret.encode() not in data, f"the cluster secret in {p}"


def _python_without_the_project(root: Path) -> Path:
    """An interpreter for the executors that sees the installed libraries but not this
    project (no editable install, no checkout on its path): ``-S`` skips site-packages and
    its ``.pth`` files, and PYTHONPATH adds site-packages back, without processing them."""
    site = sysconfig.get_paths()["purelib"]
    script = root / "executor-python"
    script.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" -S "$@"\n'
    )
    script.chmod(0o755)
    return script


def _event_log_conf(root: Path) -> Path:
    """A SPARK_CONF_DIR whose spark-defaults.conf turns the event log on, to check it for keys."""
    conf = root / "spark-conf"
    events = root / "spark-events"
    conf.mkdir()
    events.mkdir()
    (conf / "spark-defaults.conf").write_text(
        f"spark.eventLog.enabled true\nspark.eventLog.dir {events.as_uri()}\n"
        "spark.executor.memory 512m\nspark.cores.max 2\n"
    )
    return conf
