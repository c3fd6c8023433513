"""The pipeline path once against a real Spark Connect server, cell by cell equal to local mode.

A session-scoped fixture starts a Spark Connect server from the pyspark package on a free
loopback port (``cdc_platform.connect_server``), the same scenario runs in local mode (this
process's session) and over Connect (a subprocess: a Connect client switches pyspark into
remote mode for its whole process), and the history table, change log, quarantine, every run's
figures and the invariant checks must be identical (byte counts within 5%: ``BYTE_FIGURES``).
Opt in with ``--run-connect`` (``make test-connect``, which CI runs): starting the server alone
takes most of a minute on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_platform import connect_server
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import invariants
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event, write_parquet_events

pytestmark = pytest.mark.connect

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
TABLE = TableConfig(name="orders", primary_key=("id",), start=H0)
SYNCED = [datetime(2024, 1, 2, h, tzinfo=UTC) for h in range(4)]
REPO = Path(__file__).resolve().parents[2]
CONNECT_CLIENT_MODULES = ("grpc", "grpc_status", "google.rpc", "zstandard", "pandas")
# A secret setting the server starts with (an S3 key it never uses here): it must reach the
# server through its properties file, never a command line.
SERVER_SECRET = "s3-secret-" + os.urandom(8).hex()

PLAIN = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("status", pa.string()),
        pa.field("amount", pa.float64()),
        pa.field("cdc_operation_type", pa.string()),
        pa.field("cdc_change_seq", pa.int64()),
        pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
    ]
)
# Needs conversion (int32 key and seq, millisecond timestamps): decoded in Python tasks.
CONVERTED = pa.schema(
    [
        pa.field("id", pa.int32()),
        pa.field("status", pa.string()),
        pa.field("note", pa.string()),  # schema drift: a column appears
        pa.field("cdc_operation_type", pa.string()),
        pa.field("cdc_change_seq", pa.int32()),
        pa.field("cdc_commit_timestamp", pa.timestamp("ms", tz="UTC")),
    ]
)


def _events(rng: random.Random, seqs: Iterator[int], start: datetime, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        key = rng.randrange(1, 21)
        op = rng.choice(["INSERT", "update", "UPDATE", "UPDATE", "DELETE"])
        ts = start + timedelta(milliseconds=rng.randrange(0, 3_600_000))
        cols = {} if op == "DELETE" else {"status": rng.choice("abc"), "amount": rng.random()}
        out.append(event(op, next(seqs), ts, key, **cols))
    return out


def scenario(spark: Any, landing: Path, warehouse: Path) -> dict[str, Any]:
    """Two hours, a file needing conversion, a bad file, a late file, a replay; then checks."""
    rng = random.Random(8)
    seqs = iter(range(1, 10_000))
    put = write_parquet_events
    put(landing, "orders", H0, _events(rng, seqs, H0, 40), PLAIN, "plain-1.parquet")
    converted = [
        {k: v for k, v in e.items() if k != "amount"} | {"note": f"n{i}"}
        for i, e in enumerate(_events(rng, seqs, H0, 20))
    ]
    put(landing, "orders", H0, converted, CONVERTED, "converted.parquet")
    bad = _events(rng, seqs, H0, 5)
    bad[3] = {**bad[3], "id": None}
    put(landing, "orders", H0, bad, PLAIN, "bad.parquet")
    runs = [materialize(spark, TABLE, landing, warehouse, [H0], synced_at=SYNCED[0])]

    put(landing, "orders", H1, _events(rng, seqs, H1, 40), PLAIN, "plain-2.parquet")
    runs.append(materialize(spark, TABLE, landing, warehouse, [H1], synced_at=SYNCED[1]))

    # A late file in the first hour's folder, its events committed before everything else.
    late = _events(rng, seqs, H0 - timedelta(days=3), 15)
    put(landing, "orders", H0, late, PLAIN, "late.parquet")
    runs.append(materialize(spark, TABLE, landing, warehouse, [H0], synced_at=SYNCED[2]))
    runs.append(materialize(spark, TABLE, landing, warehouse, [H0, H1], synced_at=SYNCED[3]))

    paths = TablePaths.of(warehouse, TABLE.name)
    checks = invariants.run_checks(spark, paths, TABLE.key)
    since = runs[1].merge.history_version
    scope = invariants.touched_keys(spark, paths, TABLE.key, since)
    scoped = invariants.run_checks(spark, paths, TABLE.key, scope)
    return json.loads(
        json.dumps(
            {
                "runs": [_run_summary(r) for r in runs],
                "checks": [(c.name, c.passed, c.failing, c.detail) for c in checks],
                "scoped_checks": [(c.name, c.passed, c.failing, c.checked_keys) for c in scoped],
            },
            default=str,
        )
    )


# Byte counts of the files a run read and wrote. Over Spark Connect every string column reaches
# the server as ``string collate UTF8_BINARY`` (the default collation, spelled out), and Spark
# copies that schema into each Parquet footer (``org.apache.spark.sql.parquet.row.metadata``):
# the same rows, a few dozen bytes longer per file. Compared apart: present and close, not equal.
BYTE_FIGURES = ("bytes_added", "bytes_removed", "changelog_bytes_read", "history_bytes_read")


def _run_summary(r: MaterializationOutcome) -> dict[str, Any]:
    merge = {k: v for k, v in r.merge.__dict__.items() if k != "attempts"}
    return {
        "files_read": r.files_read,
        "events_read": r.events_read,
        "events_new": r.events_new,
        "quarantined": [(q.file, q.reason, q.row, q.bad_rows) for q in r.quarantined],
        "read_natively": list(r.read_natively),
        "merge": {k: v for k, v in merge.items() if k not in BYTE_FIGURES},
        "bytes": {k: merge[k] for k in BYTE_FIGURES},
    }


def table_rows(path: Path) -> list[dict[str, Any]]:
    rows = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda r: json.dumps(r, default=str, sort_keys=True))


@pytest.fixture(scope="session")
def connect_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(the server's URL, its state folder): the auth file clients read is in the folder."""
    missing = [m for m in CONNECT_CLIENT_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Spark Connect client packages missing ({missing}): pyspark[connect]")
    state = tmp_path_factory.mktemp("spark-connect")
    port = connect_server.free_port()
    conf = {"spark.hadoop.fs.s3a.secret.key": SERVER_SECRET}
    url = connect_server.start(port, state_dir=state, driver_memory="1g", conf=conf)
    try:
        yield url, state
    finally:
        connect_server.stop(port, state)
        assert connect_server.server_pid(state, port) is None


@pytest.fixture(scope="session")
def connect_url(connect_state: tuple[str, Path]) -> str:
    return connect_state[0]


def _client(*args: str) -> subprocess.CompletedProcess[str]:
    """This module as a Connect client in a process of its own (a Connect client switches
    pyspark into remote mode for its whole process)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "cdc_platform_tests.integration.test_spark_connect", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_the_server_serves_only_clients_with_its_token_and_proves_itself(connect_state):
    """docs/SECURITY.md: no local process runs code on the server without the token, and a
    client sends no work to a server that cannot prove it holds the auth file's secret."""
    url, state = connect_state
    auth = connect_server.auth_file(state)
    assert auth.stat().st_mode & 0o777 == 0o600
    secrets = json.loads(auth.read_text())
    props = connect_server.properties_file(state)
    assert props.stat().st_mode & 0o777 == 0o600
    assert props.parent.stat().st_mode & 0o777 == 0o700
    assert SERVER_SECRET in props.read_text()
    pid = connect_server.server_pid(state, int(url.rsplit(":", 1)[1]))
    cmdline = Path(f"/proc/{pid}/cmdline").read_text()
    assert str(props) in cmdline  # the server read its settings from there
    leaked = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            line = (proc / "cmdline").read_text(errors="replace")
        except OSError:
            continue
        leaked += [
            proc.name for s in (secrets["token"], secrets["proof"], SERVER_SECRET) if s in line
        ]
    assert not leaked

    assert _client("probe", url, str(auth), "right").stdout.strip() == "served"
    no_token = _client("probe", url, str(auth), "no-token")
    assert "UNAUTHENTICATED" in no_token.stdout + no_token.stderr, no_token.stderr[-2000:]
    impostor = _client("probe", url, str(auth), "wrong-proof")
    assert "refused: " in impostor.stdout and "cannot prove" in impostor.stdout
    for leaked in (secrets["token"], secrets["proof"]):
        for out in (no_token, impostor):
            assert leaked not in out.stdout + out.stderr
    # Once the proven connection drops, no call goes out on the channel again (a process that
    # took the port meanwhile would get the next plan): the session is refused, not retried.
    dropped = _client("probe", url, str(auth), "dropped")
    assert "refused after the drop: " in dropped.stdout, dropped.stderr[-2000:]


def test_localhost_never_reaches_another_listener_on_ipv6_loopback(connect_state):
    """gRPC may resolve ``localhost`` to ``::1`` first, where any local user can listen while the
    server binds 127.0.0.1: the client dials the server's address, and the squatter hears nothing."""
    url, state = connect_state
    port = int(url.rsplit(":", 1)[1])
    try:
        squatter = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        squatter.bind(("::1", port))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with squatter:
        squatter.listen(8)
        squatter.settimeout(0.5)
        auth = str(connect_server.auth_file(state))
        assert _client("probe", f"sc://localhost:{port}", auth, "right").stdout.strip() == "served"
        with pytest.raises(TimeoutError):
            squatter.accept()


def test_pipeline_over_spark_connect_equals_local_mode(
    spark, connect_url, connect_state, tmp_path
) -> None:
    local_root, remote_root = tmp_path / "local", tmp_path / "connect"
    for root in (local_root, remote_root):
        (root / "landing").mkdir(parents=True)
        (root / "warehouse").mkdir()
    local = scenario(spark, local_root / "landing", local_root / "warehouse")

    out = tmp_path / "connect.json"
    state = connect_state[1]
    run = _client(
        "scenario", connect_url, str(connect_server.auth_file(state)), str(remote_root), str(out)
    )
    assert run.returncode == 0, run.stderr[-4000:]
    remote = json.loads(out.read_text())

    def without_bytes(result: dict[str, Any]) -> dict[str, Any]:
        return {
            **result,
            "runs": [{k: v for k, v in r.items() if k != "bytes"} for r in result["runs"]],
        }

    assert without_bytes(remote) == without_bytes(local)
    for mine, theirs in zip(local["runs"], remote["runs"], strict=True):
        for name in BYTE_FIGURES:
            a, b = mine["bytes"][name], theirs["bytes"][name]
            assert (a == 0) == (b == 0) and abs(a - b) <= 0.05 * max(a, b), (name, a, b)
    assert local["runs"][0]["bytes"]["bytes_added"] > 0
    first = local["runs"][0]
    assert first["read_natively"] == ["orders/year=2024/month=01/day=01/hour=00/plain-1.parquet"]
    assert [q[0].rsplit("/", 1)[1] for q in first["quarantined"]] == ["bad.parquet"]
    assert first["quarantined"][0][1] == "row 4: primary key column 'id' is null"
    assert local["runs"][2]["events_new"] == 15  # the late file
    assert local["runs"][3]["events_new"] == 0  # the replay
    assert all(passed for name, passed, *_ in local["checks"] if name != "no_quarantined_files")
    assert all(
        passed for name, passed, *_ in local["scoped_checks"] if name != "no_quarantined_files"
    )
    for part in ("history", "changelog", "quarantine"):
        a = getattr(TablePaths.of(local_root / "warehouse", "orders"), part)
        b = getattr(TablePaths.of(remote_root / "warehouse", "orders"), part)
        assert table_rows(a) == table_rows(b), part


def _scenario(url: str, auth: str, root: str, out: str) -> None:
    """The scenario over Spark Connect, in its own process (``python -m`` this module)."""
    from cdc_platform.lib.spark.connect import ConnectAuth, build_connect_session

    session = build_connect_session(
        url, app_name="cdc_platform_connect_test", auth=ConnectAuth.load(Path(auth))
    )
    try:
        result = scenario(session, Path(root) / "landing", Path(root) / "warehouse")
    finally:
        session.stop()
    Path(out).write_text(json.dumps(result))


def _probe(url: str, auth_path: str, mode: str) -> None:
    """One query as a client that has the token and the proof ("right"), no token at all, or
    the token but another proof secret: what a server that is not the platform's would fail."""
    from pyspark.sql import SparkSession

    from cdc_platform.lib.spark.connect import ConnectAuth, ConnectSetupError, build_connect_session

    auth = ConnectAuth.load(Path(auth_path))
    if mode == "no-token":
        SparkSession.builder.remote(url).getOrCreate().range(1).count()
    try:
        proof = "not-the-servers-proof" if mode == "wrong-proof" else auth.proof
        session = build_connect_session(url, auth=ConnectAuth(auth.token, proof))
    except ConnectSetupError as exc:
        print(f"refused: {exc}")
        return
    session.range(3).count()
    if mode == "dropped":
        import grpc

        builder = session._client._builder  # type: ignore[attr-defined]
        builder._state(grpc.ChannelConnectivity.TRANSIENT_FAILURE)  # what gRPC reports
        try:
            session.range(3).count()
        except Exception as exc:
            print(f"refused after the drop: {type(exc).__name__}")
            return
    print("served")


if __name__ == "__main__":
    if sys.argv[1] == "scenario":
        _scenario(*sys.argv[2:6])
    else:
        _probe(*sys.argv[2:5])
