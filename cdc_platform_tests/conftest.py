"""Shared fixtures: one real local SparkSession for the whole test session, and helpers that
write landing files and read Delta tables back exactly as users would.

The session carries Delta's own JVM library (its extension and catalog, as on Databricks or EMR)
so that the platform is tested where most of its readers run, and test_delta_spark.py can read
and maintain the tables with it; ``make test`` fetches the jars first (``make jars``)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc_platform.defs.resources import KEYRING_ENV_VAR
from cdc_platform.demo.s3 import local_s3_server
from cdc_platform.lib.spark.session import INTERPRETED_CONF, build_spark_session, delta_conf
from cdc_platform_tests import jvm_startup
from cdc_platform_tests.helpers import HASH_SALT
from cdc_platform_tests.webhook import Webhook, serve_webhook


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run the larger property runs too")
    parser.addoption(
        "--run-cluster",
        action="store_true",
        help="run the pipeline on a real Spark standalone cluster too (starts one)",
    )
    parser.addoption(
        "--run-connect",
        action="store_true",
        help="run the pipeline against a real Spark Connect server too (starts one)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Every JVM the suite starts maps its classes from one archive (jvm_startup.py), set once by
    # the controlling process before the workers start (they inherit it). A JAVA_TOOL_OPTIONS
    # already set, even empty, is the developer's and stays.
    if not hasattr(config, "workerinput") and "JAVA_TOOL_OPTIONS" not in os.environ:
        os.environ["JAVA_TOOL_OPTIONS"] = jvm_startup.java_options(jvm_startup.ensure_archive())
    config.addinivalue_line(
        "markers", "cluster: on a real Spark standalone cluster, opt in with --run-cluster"
    )
    config.addinivalue_line(
        "markers", "connect: against a real Spark Connect server, opt in with --run-connect"
    )


# The longest test files (serial seconds of one fresh-clone run, 2026-12-02), collected first:
# pytest-xdist's loadfile scheduler hands files out in collection order (with
# --no-loadscope-reorder, as `make test` runs it; by default it puts the files with the most
# tests first), and a long file handed out last leaves one worker running alone at the end.
LONGEST_FIRST = (
    "test_dagster_assets.py",  # 406 s
    "test_object_landing.py",  # 363 s
    "test_rekey.py",  # 303 s
    "test_properties.py",  # 227 s
    "test_delta_spark.py",  # 207 s
    "test_cluster.py",  # 192 s
    "test_erasure_attacks.py",  # 186 s
    "test_decoded_size_bombs.py",  # 178 s
    "test_cost_model.py",  # 177 s
    "test_demo_run.py",  # 177 s
    "test_unattended.py",  # 160 s
    "test_erasure.py",  # 155 s
    "test_operator_races.py",  # 151 s
    "test_merge_adversarial.py",  # 150 s
    "test_truncate.py",  # 146 s
    "test_encoded_files.py",  # 146 s
    "test_deploy.py",  # 145 s
    "test_unapply.py",  # 144 s
)


def _longest_first(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: each file's tests keep their order
    opt_in = {"slow": "--run-slow", "connect": "--run-connect", "cluster": "--run-cluster"}
    for marker, option in opt_in.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"opt-in run: pass {option}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def spark() -> Iterator:
    os.environ.setdefault("TZ", "UTC")
    with jvm_startup.full_jit():
        session = build_spark_session(
            "local[2]",
            {
                # Test data is tiny: one shuffle partition and no adaptive re-planning (which
                # submits each stage as a job of its own) cut the suite's time by a quarter.
                "spark.sql.shuffle.partitions": "1",
                "spark.default.parallelism": "1",
                "spark.sql.adaptive.enabled": "false",
                "spark.driver.memory": "2g",
                # delta-spark rebuilds a table's snapshot (each read, DESCRIBE, OPTIMIZE) over
                # 50 partitions by default: 50 tasks for a log of a few commits. One is 4x faster.
                "spark.databricks.delta.snapshotPartitions": "1",
                # Every query here is over a few rows, where compiling its generated code costs
                # more than running it interpreted: a third of an operator test's time. The
                # platform runs its own small merges and checks this way
                # (``session.interpreted``); the Dagster CLI, daemon, demo, cluster and Connect
                # tests run the platform's own sessions, code generation included.
                **INTERPRETED_CONF,
                **delta_conf("local[2]"),
            },
            app_name="cdc_platform_tests",
        )
    yield session
    session.stop()


@pytest.fixture()
def lake(tmp_path: Path) -> dict[str, Path]:
    landing = tmp_path / "landing"
    warehouse = tmp_path / "warehouse"
    landing.mkdir()
    warehouse.mkdir()
    return {"landing": landing, "warehouse": warehouse, "root": tmp_path}


@pytest.fixture()
def webhook() -> Iterator[Webhook]:
    """A loopback HTTP server standing in for the alert webhook (records every POST)."""
    with serve_webhook() as hook:
        yield hook


@pytest.fixture()
def keyring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A keyring holding only a hash salt (``helpers.HASH_SALT``), named by ``$CDC_KEYRING``."""
    path = tmp_path / "keyring.json"
    path.write_text(json.dumps({"hash_salt": base64.b64encode(HASH_SALT).decode()}))
    path.chmod(0o600)
    monkeypatch.setenv(KEYRING_ENV_VAR, str(path))
    return path


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A local S3 server (moto's, as ``make demo-s3`` runs it), one per test worker."""
    with local_s3_server() as endpoint:
        yield endpoint
