"""The attacker at the Launchpad: every job's run config, with hostile values
(docs/SECURITY.md). No run config may choose where Spark runs, what it loads, weaken its security
settings, name another keyring or read the deployment's environment; each is refused by the job's
config schema before a run starts, for every job the code location defines, and changes nothing.
What a run may still tune is a short allowlist of plain values."""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from cdc_platform.definitions import build_definitions
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.deployment import (
    RUN_TUNABLE,
    SparkConfigError,
    SparkDeployment,
    run_conf,
)
from cdc_platform.lib.spark.session import spark_conf
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)


# What an attacker would put under `resources:` in a run config.
HOSTILE_RESOURCES: list[dict[str, Any]] = [
    {"spark": {"config": {"remote": "sc://attacker.example:15002"}}},
    {"spark": {"config": {"master": "spark://attacker.example:7077"}}},
    {"spark": {"config": {"auth_secret": "known"}}},
    {"spark": {"config": {"warehouse_root": "s3://attacker-bucket/wh"}}},
    {"spark": {"config": {"warehouse_storage_options": {"endpoint": "http://evil"}}}},
    {"spark": {"config": {"app_name": "x"}}},
    {"keyring": {"config": {"path": "/tmp/attacker-keyring.json"}}},
]


# spark_config entries that must never be accepted from a run.
HOSTILE_SPARK_CONF: list[dict[str, str]] = [
    {"spark.jars": "/tmp/evil.jar"},
    {"spark.jars.packages": "evil:evil:1.0"},
    {"spark.driver.extraJavaOptions": "-javaagent:/tmp/evil.jar"},
    {"spark.executor.extraJavaOptions": "-Duser.timezone=Asia/Tokyo"},
    {"spark.io.encryption.enabled": "false"},
    {"spark.authenticate": "false"},
    {"spark.network.crypto.enabled": "false"},
    {"spark.master": "spark://attacker.example:7077"},
    {"spark.remote": "sc://attacker.example:15002"},
    {"spark.sql.session.timeZone": "Asia/Tokyo"},
    {"spark.hadoop.fs.s3a.endpoint": "http://attacker.example"},
    {"spark.pyspark.python": "/tmp/evil-python"},
    {"spark.sql.shuffle.partitions": "4 --conf spark.jars=/tmp/evil.jar"},
    {"spark.driver.memory": "4g -javaagent:/tmp/evil.jar"},
    {"spark.sql.shuffle.partitions": "4\nspark.jars=/tmp/evil.jar"},
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> list[dg.JobDefinition]:
    """Every job of a code location with a plain and an encrypted table."""
    root = tmp_path_factory.mktemp("attack")
    (root / "landing").mkdir()
    tables = (
        TableConfig(name="orders", primary_key=("id",), start=H0),
        TableConfig(
            name="payments",
            primary_key=("id",),
            start=H0,
            format="csv",
            encryption="aes-256-cbc",
            columns={"id": "long", "amount": "double"},
        ),
    )
    platform = PlatformConfig(root / "landing", Location.of(root / "warehouse"), tables)
    repo = build_definitions(platform).get_repository_def()
    return [j for j in repo.get_all_jobs() if not j.name.startswith("__")]


# A valid run config of each job that needs one: the hostile part is added to it, so a refusal
# is the hostile part's, not a missing entry's. A new job that needs config must be added here.
OPS = {
    "adopt_table": {"adopt": {"config": {"table": "orders", "source": "x"}}},
    "resync_table": {"resync": {"config": {"table": "orders", "snapshot": "x"}}},
    "truncate_table": {"truncate": {"config": {"table": "orders"}}},
    "unapply_files": {"unapply": {"config": {"table": "orders", "files": ["x"], "reason": "r"}}},
    "readmit_files": {"readmit": {"config": {"table": "payments", "files": ["x"]}}},
    "merge_plan": {
        "plan_merge": {"config": {"table": "payments", "first_partition": "2024-01-01-00:00"}}
    },
    "table_maintenance": {"compact_and_vacuum": {"config": {"table": "orders"}}},
    "rekey_table": {"rekey": {"config": {"table": "orders"}}},
    "protect_columns": {"protect": {"config": {"table": "orders"}}},
    "erase_key": {"erase": {"config": {"table": "orders", "keys": [{"id": "1"}], "reason": "r"}}},
}


def _base(job: dg.JobDefinition) -> dict[str, Any]:
    return {"ops": OPS[job.name]} if job.name in OPS else {}


def _accepted(job: dg.JobDefinition, run_config: dict[str, Any]) -> bool:
    try:
        dg.validate_run_config(job, run_config)
    except dg.DagsterInvalidConfigError:
        return False
    return True


def test_no_run_config_redirects_spark_or_the_keyring_on_any_job(jobs):
    assert {"resync_table", "readmit_files", "truncate_table", "adopt_table"} <= {
        j.name for j in jobs
    }
    checked = 0
    for job in jobs:
        assert _accepted(job, _base(job)), f"{job.name}: add its minimal run config to OPS"
        for resources in HOSTILE_RESOURCES:
            if not set(resources) & set(job.resource_defs):
                continue
            assert not _accepted(job, {**_base(job), "resources": resources}), job.name
            checked += 1
    assert checked >= len(jobs) * 2


def test_no_run_uses_the_alert_webhook_so_its_run_config_reaches_nothing(jobs):
    """Asset jobs accept config for every resource of the code location; the webhook is used
    by sensors only (their resources are the code location's), never by a run's step."""
    for job in jobs:
        for node in job.graph.node_defs:
            assert "alert_webhook" not in node.required_resource_keys, (job.name, node.name)


def test_no_run_config_loads_code_or_weakens_security_through_spark_config(jobs):
    spark_jobs = [j for j in jobs if "spark" in j.resource_defs]
    assert spark_jobs
    for conf in HOSTILE_SPARK_CONF:
        with pytest.raises(SparkConfigError):
            run_conf(conf)
    # The Launchpad's path: the run config validates as a dict of strings, and the resource
    # refuses it when the run builds it, before any session exists.
    job = next(j for j in spark_jobs if j.name == "resync_table")
    hostile = {"spark": {"config": {"spark_config": HOSTILE_SPARK_CONF[0]}}}
    assert _accepted(job, {**_base(job), "resources": hostile})
    result = job.execute_in_process(
        run_config={**_base(job), "resources": hostile}, raise_on_error=False
    )
    assert not result.success
    failure = str(result.get_run_failure_event().event_specific_data)
    assert "spark.jars" in failure and "/tmp/evil.jar" not in failure


def test_a_run_may_tune_only_plain_values_of_the_allowlist():
    tuned = run_conf({"spark.sql.shuffle.partitions": 8, "spark.driver.memory": "4g"})
    assert tuned == {"spark.sql.shuffle.partitions": "8", "spark.driver.memory": "4g"}
    assert run_conf({"spark.sql.adaptive.enabled": "false"}) == {
        "spark.sql.adaptive.enabled": "false"
    }
    assert all(k.startswith("spark.") for k in RUN_TUNABLE)


def test_security_settings_win_over_any_conf():
    """Even the deployment's own code path cannot turn them off by passing conf."""
    off = {
        "spark.io.encryption.enabled": "false",
        "spark.authenticate": "false",
        "spark.network.crypto.enabled": "false",
        "spark.sql.session.timeZone": "Asia/Tokyo",
    }
    merged = spark_conf("local[2]", off)
    assert merged["spark.io.encryption.enabled"] == "true"
    assert merged["spark.authenticate"] == "true"
    assert merged["spark.network.crypto.enabled"] == "true"
    assert merged["spark.sql.session.timeZone"] == "UTC"


def test_where_spark_runs_comes_from_the_deployments_environment():
    assert SparkDeployment.from_env({}) == SparkDeployment()
    cluster = SparkDeployment.from_env(
        {"CDC_SPARK_MASTER": "spark://h:7077", "CDC_SPARK_AUTH_SECRET": "s3cr3t"}
    )
    assert (cluster.master, cluster.auth_secret, cluster.remote) == (
        "spark://h:7077",
        "s3cr3t",
        None,
    )
    assert "s3cr3t" not in repr(cluster)
    remote = SparkDeployment.from_env(
        {"CDC_SPARK_REMOTE": "sc://127.0.0.1:1", "CDC_SPARK_CONNECT_AUTH": "/a/auth.json"}
    )
    assert remote.remote == "sc://127.0.0.1:1" and remote.connect_auth == Path("/a/auth.json")


SECRET_KEY = base64.b64encode(b"k" * 32).decode()


SECRET_CELL = "secret-cell-value-7f3a"


@dataclass(frozen=True)
class Lake:
    root: Path
    platform: PlatformConfig
    paths: TablePaths
    secret: Path  # a folder outside every root: a keyring and a CSV a source must never reach

    def versions(self) -> tuple[int | None, int | None]:
        return delta.version_or_none(self.paths.history), delta.version_or_none(
            self.paths.changelog
        )


@pytest.fixture(scope="module")
def hostile_lake(spark, tmp_path_factory: pytest.TempPathFactory) -> Lake:
    """One applied hour of `orders`, roots for snapshots and adoption, and secrets beside them,
    with symlinks from inside each root to the secrets and to the warehouse."""
    root = tmp_path_factory.mktemp("hostile")
    landing, warehouse = root / "landing", root / "warehouse"
    snapshots, adoptable, secret = root / "snapshots", root / "adoptable", root / "secret"
    for folder in (landing, warehouse, snapshots, adoptable, secret):
        folder.mkdir()
    keyring = secret / "keyring.json"
    keyring.write_text(json.dumps({"tables": {"orders": SECRET_KEY}}))
    keyring.chmod(0o600)
    (secret / "orders.csv").write_text(f"id,status\n1,{SECRET_CELL}\n")
    table = TableConfig(name="orders", primary_key=("id",), start=H0)
    platform = PlatformConfig(
        landing,
        Location.of(warehouse),
        (table,),
        snapshot_roots=(Location.of(snapshots),),
        adoption_roots=(Location.of(adoptable),),
    )
    rows = [ev("INSERT", i, H0 + timedelta(minutes=i), i, status="a") for i in range(1, 4)]
    write_parquet_events(landing, "orders", H0, rows)
    materialize(spark, table, landing, platform.warehouse_root, [H0])
    paths = TablePaths.of(platform.warehouse_root, "orders")
    (snapshots / "to-secret").symlink_to(secret)
    (adoptable / "to-secret").symlink_to(secret)
    (adoptable / "to-history").symlink_to(Path(str(paths.history)))
    return Lake(root, platform, paths, secret)


def _hostile_paths(lake: Lake, root: str) -> list[str]:
    """Places outside ``root`` spelled every way an attacker would try."""
    r, s = lake.root, lake.secret
    return [
        str(s),
        "/etc",
        f"{r / root}/../secret",
        "../secret",
        "../../../../../../etc",
        f"file://{s}",
        "s3://another-bucket/orders",
        f"{r / root}/to-secret",
        f"{r / root}/to-secret/orders.csv",
        str(lake.paths.history),
        str(lake.paths.changelog),
        str(lake.platform.landing_root / "orders"),
        f"{r / root}/x\nsnapshot_roots: [/]",
        f"{r / root}/it's`quoted`",
    ]


def _hostile_cases(lake: Lake) -> list[tuple[str, str, dict[str, Any]]]:
    future, no_zone = "9999-01-01T00:00:00Z", "2024-01-01T00:00:00"
    cases: list[tuple[str, str, dict[str, Any]]] = []
    for name in ("orders`", "../orders", "orders\nx", "", "ORDERS", "orders; DROP TABLE x"):
        cases.append(("truncate_table", "truncate", {"table": name}))
        cases.append(("unapply_files", "unapply", {"table": name, "files": ["*"], "reason": "r"}))
        cases.append(("table_maintenance", "compact_and_vacuum", {"table": name}))
        plan = {"table": name, "first_partition": "2024-01-01-00:00"}
        cases.append(("merge_plan", "plan_merge", plan))
    for path in _hostile_paths(lake, "snapshots"):
        cases.append(("resync_table", "resync", {"table": "orders", "snapshot": path}))
    for path in _hostile_paths(lake, "adoptable"):
        cases.append(("adopt_table", "adopt", {"table": "orders", "source": path}))
    for at in (future, no_zone, "yesterday`"):
        snapshot = str(lake.root / "snapshots")
        cases.append(
            ("resync_table", "resync", {"table": "orders", "snapshot": snapshot, "at": at})
        )
        cases.append(("truncate_table", "truncate", {"table": "orders", "before": at}))
    # Before 1970: truncate's synthetic deletes are ordered by -before in ms, so it refuses them.
    cases.append(
        ("truncate_table", "truncate", {"table": "orders", "before": "1000-01-01T00:00:00Z"})
    )
    outside = [str(lake.secret / "keyring.json"), "../../secret/keyring.json", "/etc/passwd"]
    outside += ["orders/../../secret/keyring.json", "adopt:*", "resync:*", "truncate:*"]
    for files in outside:
        cases.append(
            ("unapply_files", "unapply", {"table": "orders", "files": [files], "reason": "r"})
        )
        cases.append(("readmit_files", "readmit", {"table": "orders", "files": [files]}))
    for partition in ("../../x", "2024-01-01-00:00\n", "2024-01-01-00:00`"):
        cases.append(
            ("merge_plan", "plan_merge", {"table": "orders", "first_partition": partition})
        )
    return cases


def test_every_operator_job_refuses_hostile_values_and_changes_nothing(hostile_lake):
    """Traversal, absolute paths, URIs, symlinks out of a root or into the warehouse, quotes,
    backticks, newlines, future, zone-less and pre-1970 times: each run fails with a message, writes
    nothing, and no message or event carries a secret it could have reached."""
    defs = build_definitions(hostile_lake.platform)
    before = hostile_lake.versions()
    cases = _hostile_cases(hostile_lake)
    assert len(cases) > 60
    for job_name, op, config in cases:
        job = defs.get_job_def(job_name)
        result = job.execute_in_process(
            run_config={"ops": {op: {"config": config}}}, raise_on_error=False
        )
        assert not result.success, (job_name, config)
        text = "\n".join(
            str(e.message or "") + repr(e.event_specific_data) for e in result.all_events
        )
        for secret in (SECRET_KEY, SECRET_CELL, '"tables"'):
            assert secret not in text, (job_name, config, secret)
        assert hostile_lake.versions() == before, (job_name, config)
    # The control: the same harness runs a job with sound values, and it writes.
    control = {"table": "orders"}  # soft: close what was written up to now
    result = defs.get_job_def("truncate_table").execute_in_process(
        run_config={"ops": {"truncate": {"config": control}}}, raise_on_error=False
    )
    assert result.success and hostile_lake.versions() != before


def test_no_run_config_reads_the_deployments_environment(hostile_lake, monkeypatch):
    """Dagster resolves ``{env: NAME}`` in any string of a run config; echoed back by an error
    (a bad time, an unknown table) or stored (a reason), it would hand the Launchpad user any
    secret of the deployment's environment. Such a run is refused before any step runs."""
    secret = "env-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("CDC_TEST_DEPLOYMENT_SECRET", secret)
    ref = {"env": "CDC_TEST_DEPLOYMENT_SECRET"}
    defs = build_definitions(hostile_lake.platform)
    before = hostile_lake.versions()
    runs = [
        ("truncate_table", {"ops": {"truncate": {"config": {"table": "orders", "before": ref}}}}),
        ("truncate_table", {"ops": {"truncate": {"config": {"table": ref}}}}),
        ("table_maintenance", {"ops": {"compact_and_vacuum": {"config": {"table": ref}}}}),
        (
            "unapply_files",
            {"ops": {"unapply": {"config": {"table": "orders", "files": ["x"], "reason": ref}}}},
        ),
        ("resync_table", {"ops": {"resync": {"config": {"table": "orders", "snapshot": ref}}}}),
        (
            "truncate_table",
            {
                "ops": {"truncate": {"config": {"table": "orders"}}},
                "resources": {"spark": {"config": {"spark_config": {"spark.driver.memory": ref}}}},
            },
        ),
    ]
    for job_name, run_config in runs:
        job = defs.get_job_def(job_name)
        assert _accepted(job, run_config)  # Dagster itself takes it: the platform refuses it
        result = job.execute_in_process(run_config=run_config, raise_on_error=False)
        assert not result.success, run_config
        text = "\n".join(
            str(e.message or "") + repr(e.event_specific_data) for e in result.all_events
        )
        assert secret not in text and "environment variables" in text, run_config
        assert hostile_lake.versions() == before
