"""Unattended operation through a real Dagster daemon: an hour that landed while the
warehouse was down reaches the table once storage is back, with no human action; a source that
went quiet is stale in Dagster's freshness and alerted once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
from deltalake import DeltaTable

from cdc_platform.defs.tags import PARTITION_TAG, REASON_TAG
from cdc_platform.lib.config import REPO_ROOT, load_config
from cdc_platform.lib.fleet.sensor_cursor import REASON_RETRY
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events
from cdc_platform_tests.webhook import Webhook

# Generous: each run starts a Spark JVM of its own on a 2-core machine.
FAIL_SECONDS = 240
RECOVER_SECONDS = 420


def test_an_hour_landed_during_a_warehouse_outage_reaches_the_table_unattended(
    tmp_path: Path, webhook: Webhook
) -> None:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        f"  - name: t\n    primary_key: [id]\n"
        f'    start: "{hour_to_partition_key(hour - timedelta(hours=24))}"\n'
        "    sensor_interval_seconds: 5\n    retry_backoff_seconds: 20\n"
        "    expected_delivery_hours: 1\n"
        # A source that stopped delivering: its last data arrived three hours ago.
        f"  - name: quiet\n    primary_key: [id]\n"
        f'    start: "{hour_to_partition_key(hour - timedelta(hours=24))}"\n'
        "    expected_delivery_hours: 1\n"
    )
    platform = load_config(config)
    paths = TablePaths.of(platform.warehouse_root, "t")
    # The outage: where the change log goes, a file instead of a folder (as root, a permission
    # bit would not stop a write). Every run fails before it commits anything.
    outage = Path(str(paths.changelog))
    outage.parent.mkdir(parents=True)
    outage.write_text("storage is down")
    partition = hour_to_partition_key(hour)
    write_parquet_events(platform.landing_path, "t", hour, [ev("INSERT", 1, hour, 1, v="landed")])

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: cdc_platform.definitions\n"
        f"      working_directory: {REPO_ROOT}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {
        "CDC_PLATFORM_CONFIG": str(config),
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
        "FRESHNESS_DAEMON_INTERVAL_SECONDS": "5",
        "CDC_ALERT_WEBHOOK_URL": webhook.secret_url,
    }
    with dg.DagsterInstance.from_config(str(home)) as instance:
        materialized_long_ago(instance, "quiet", hours=3)
    daemon_bin = Path(sys.executable).parent / "dagster-daemon"
    log = (tmp_path / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        [str(daemon_bin), "run", "--workspace", str(workspace)],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.get() as instance:
            runs_of_hour = dg.RunsFilter(tags={PARTITION_TAG: partition})

            def wait_for(what: str, seconds: float, done) -> None:
                deadline = time.monotonic() + seconds
                while not done():
                    assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-4000:]
                    if time.monotonic() > deadline:
                        runs = [(r.run_id[:8], r.status, r.tags) for r in instance.get_runs()]
                        tail = (tmp_path / "daemon.log").read_text()[-4000:]
                        raise AssertionError(f"no {what} within {seconds}s: {runs}\n{tail}")
                    time.sleep(2)

            def failed() -> bool:
                return any(
                    r.status == dg.DagsterRunStatus.FAILURE
                    for r in instance.get_runs(filters=runs_of_hour)
                )

            wait_for("failed run during the outage", FAIL_SECONDS, failed)
            outage.unlink()  # storage is back; nobody touches the platform

            def applied() -> bool:
                return any(
                    r.status == dg.DagsterRunStatus.SUCCESS
                    for r in instance.get_runs(filters=runs_of_hour)
                )

            wait_for("successful run once storage is back", RECOVER_SECONDS, applied)
            runs = instance.get_runs(filters=runs_of_hour)

            # Dagster's freshness daemon: the quiet source is stale, the live one fresh.
            def freshness() -> dict[str, str]:
                keys = [dg.AssetKey("quiet"), dg.AssetKey("t")]
                records = instance.get_freshness_state_records(keys)
                return {k.to_user_string(): r.freshness_state.value for k, r in records.items()}

            wait_for(
                "freshness states",
                120,
                lambda: freshness() == {"quiet": "FAIL", "t": "PASS"},
            )

            def stale_alerts() -> list[str]:
                return [
                    c.body["subject"] for c in webhook.posted if c.body["kind"] == "source_stale"
                ]

            wait_for("a source_stale alert", 150, lambda: "quiet" in stale_alerts())
            retried = [r for r in runs if r.tags.get(REASON_TAG) == REASON_RETRY]
            assert retried, [r.tags for r in runs]
    finally:
        os.environ.pop("DAGSTER_HOME", None)
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        log.close()
    assert stale_alerts().count("quiet") == 1  # once, however many ticks saw it stale
    rows = history_rows(paths.history)
    assert [(r["id"], r["v"], r["_fivetran_active"]) for r in rows] == [(1, "landed", True)]
    # Applied once: the change log holds the event once, whatever the number of runs.
    logged = DeltaTable(paths.changelog.uri).to_pyarrow_table(columns=["id", "cdc_change_seq"])
    assert logged.to_pylist() == [{"id": 1, "cdc_change_seq": 1}]


def materialized_long_ago(instance: dg.DagsterInstance, asset: str, hours: int) -> None:
    """A materialization recorded ``hours`` ago (the event log's own entry, backdated)."""
    from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData
    from dagster._core.events.log import EventLogEntry

    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
        job_name="__ASSET_JOB",
        event_specific_data=StepMaterializationData(dg.AssetMaterialization(asset)),
    )
    instance.store_event(
        EventLogEntry(
            error_info=None,
            level="INFO",
            user_message="",
            run_id="",
            timestamp=time.time() - hours * 3600,
            dagster_event=event,
        )
    )
