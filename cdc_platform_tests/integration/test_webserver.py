"""The code location as the UI serves it: a real ``dagster-webserver`` answering GraphQL.

The server runs on loopback with a throw-away DAGSTER_HOME (the project's dagster.yaml) and a
config file naming two tables; the test asks GraphQL for each table's asset, partitions, checks
and landing sensor. No daemon runs, so no sensor ticks and no run starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdc_platform.defs.sensors.restatements import RESTATEMENTS_SENSOR
from cdc_platform.lib.config import CONFIG_ENV_VAR, REPO_ROOT
from cdc_platform.lib.history import invariants

STARTUP_SECONDS = 120
TABLES = {"customers": "customer_id", "orders": "order_id"}
START = "2024-01-01-00:00"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def graphql(base: str, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(
        f"{base}/graphql", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert not answer.get("errors"), answer["errors"]
    return answer["data"]


@pytest.fixture(scope="module")
def webserver(tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("webserver")
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    config = tmp / "cdc_platform.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "landing_root": str(tmp / "landing"),
                "warehouse_root": str(tmp / "warehouse"),
                "tables": [
                    {"name": t, "primary_key": [k], "start": START} for t, k in TABLES.items()
                ],
            }
        )
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DAGSTER_HOME": str(home), CONFIG_ENV_VAR: str(config)}
    env.pop("CDC_ALERT_WEBHOOK_URL", None)
    log = (tmp / "webserver.log").open("w+")
    webserver_bin = Path(sys.executable).with_name("dagster-webserver")
    workspace = REPO_ROOT / "workspace.yaml"
    proc = subprocess.Popen(
        [str(webserver_bin), "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"dagster-webserver exited with {proc.returncode}:\n{log.read()}")
            try:
                info = http_get(f"{base}/server_info")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"no /server_info within {STARTUP_SECONDS}s:\n{log.read()[-4000:]}")
            time.sleep(1)
        assert "dagster_webserver_version" in info
        wait_for_location(base, deadline, log)
        yield base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server and its children
                proc.wait(timeout=30)
        log.close()


def wait_for_location(base: str, deadline: float, log) -> None:
    """The code location loads in its own process after the server is up: wait for LOADED."""
    query = """
    query {
      workspaceOrError {
        __typename
        ... on Workspace {
          locationEntries {
            name
            loadStatus
            locationOrLoadError { __typename ... on PythonError { message } }
          }
        }
      }
    }"""
    while True:
        data = graphql(base, query)["workspaceOrError"]
        entries = data.get("locationEntries") or []
        if entries and all(e["loadStatus"] == "LOADED" for e in entries):
            for e in entries:
                assert e["locationOrLoadError"]["__typename"] == "RepositoryLocation", e
            return
        if time.monotonic() > deadline:
            log.seek(0)
            pytest.fail(f"code location not loaded: {data}\n{log.read()[-4000:]}")
        time.sleep(1)


ASSET_QUERY = """
query ($path: [String!]!) {
  assetNodeOrError(assetKey: {path: $path}) {
    __typename
    ... on AssetNode {
      assetKey { path }
      isPartitioned
      pools
      partitionDefinition { type name description }
      partitionKeysByDimension { name type partitionKeys }
      assetChecksOrError {
        __typename
        ... on AssetChecks { checks { name blocking assetKey { path } } }
        ... on Error { message }
      }
    }
  }
}"""

REPOSITORIES_QUERY = """
query {
  repositoriesOrError {
    __typename
    ... on RepositoryConnection {
      nodes {
        name
        location { name }
        assetNodes { assetKey { path } }
        sensors {
          name
          minIntervalSeconds
          defaultStatus
          assetSelection { assetKeys { path } }
        }
        jobs { name }
        schedules { name }
      }
    }
    ... on PythonError { message }
  }
}"""


@pytest.mark.parametrize("table", list(TABLES))
def test_asset_partitions_and_checks(webserver: str, table: str) -> None:
    node = graphql(webserver, ASSET_QUERY, {"path": [table]})["assetNodeOrError"]
    assert node["__typename"] == "AssetNode", node
    assert node["assetKey"] == {"path": [table]}
    assert node["isPartitioned"] is True
    assert node["pools"] == [f"cdc_table_{table}"]
    assert node["partitionDefinition"]["type"] == "TIME_WINDOW"
    (dimension,) = node["partitionKeysByDimension"]
    assert dimension["type"] == "TIME_WINDOW"
    keys = dimension["partitionKeys"]
    assert keys[:3] == ["2024-01-01-00:00", "2024-01-01-01:00", "2024-01-01-02:00"]
    # Every closed hour from the start to now (the server ignores startIdx/endIdx here).
    closed_hours = (datetime.now(UTC) - datetime(2024, 1, 1, tzinfo=UTC)) // timedelta(hours=1)
    assert closed_hours - 1 <= len(keys) <= closed_hours + 1
    assert len(set(keys)) == len(keys) and keys == sorted(keys)
    checks = node["assetChecksOrError"]
    assert checks["__typename"] == "AssetChecks", checks
    names = {c["name"] for c in checks["checks"]}
    assert names == set(invariants.CHECK_NAMES)
    assert all(c["assetKey"] == {"path": [table]} for c in checks["checks"])
    # Every invariant blocks, except the set-aside files' check, which warns.
    blocking = {c["name"] for c in checks["checks"] if c["blocking"]}
    assert blocking == set(invariants.CHECK_NAMES) - {invariants.NO_QUARANTINE}


def test_repository_lists_assets_sensors_and_check_job(webserver: str) -> None:
    data = graphql(webserver, REPOSITORIES_QUERY)["repositoriesOrError"]
    assert data["__typename"] == "RepositoryConnection", data
    (repo,) = data["nodes"]
    # The demo's location (workspace.yaml): the tables, and the asset downstream of orders.
    assets = {tuple(n["assetKey"]["path"]) for n in repo["assetNodes"]}
    assert assets == {(t,) for t in TABLES} | {("orders_daily",)}
    sensors = {s["name"]: s for s in repo["sensors"]}
    assert sensors[RESTATEMENTS_SENSOR]["defaultStatus"] == "RUNNING"
    for table in TABLES:
        sensor = sensors[f"{table}_landing_sensor"]
        assert sensor["defaultStatus"] == "RUNNING"
        assert sensor["assetSelection"]["assetKeys"] == [{"path": [table]}]
    assert "cdc_run_failure_alerts" in sensors
    assert sensors["cdc_check_failure_alerts"]["defaultStatus"] == "RUNNING"
    jobs = {j["name"] for j in repo["jobs"]}
    assert {"cdc_full_table_checks", "table_maintenance", "merge_plan"} <= jobs
    assert not any(j.startswith(tuple(TABLES)) for j in jobs)  # no job per table
    schedules = {s["name"] for s in repo["schedules"]}
    assert schedules == {"cdc_full_table_checks_schedule"} | {
        f"{t}_maintenance_schedule" for t in TABLES
    }
