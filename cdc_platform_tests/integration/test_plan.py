"""The merge plan (dry run): the real run's figures, and not one byte written for real."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg

from cdc_platform.defs.jobs.registry import PLAN_JOB, operator_job
from cdc_platform.lib.config import load_config
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.operations.plan import PlanRequest, plan
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
SYNCED = datetime(2024, 3, 1, tzinfo=UTC)


def tree(root: Path) -> dict[str, tuple[int, int, bool] | None]:
    """Every folder and file under ``root``; for a file its size, mtime and whether it is a
    link, so any write shows. (A folder's mtime moves when the plan's temporary folder is
    created in it and removed again.)"""
    out: dict[str, tuple[int, int, bool] | None] = {}
    for folder, dirs, files in os.walk(root):
        out |= {str((Path(folder) / d).relative_to(root)): None for d in dirs}
        for name in files:
            p = Path(folder) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, p.is_symlink())
    return out


def test_plan_reports_the_real_runs_figures_and_writes_nothing(spark, tmp_path):
    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    table = platform.table("orders")
    landing, warehouse = platform.landing_path, platform.warehouse_root
    t0 = H0 + timedelta(minutes=30)
    write_parquet_events(
        landing,
        "orders",
        H0,
        # Key 50 is delete-only: it has no version, its last event lives in a side table.
        [ev("INSERT", i, t0, i, status="new") for i in range(1, 9)] + [ev("DELETE", 9, t0, 50)],
    )
    t1 = H1 + timedelta(minutes=30)
    write_parquet_events(
        landing, "orders", H1, [ev("UPDATE", 10 + i, t1, i, status="paid") for i in range(1, 5)]
    )
    materialize(spark, table, landing, warehouse, [H0, H1])

    # What is pending: an in-order hour, a late file (three keys, older than their last event,
    # one of them by two days, one of them delete-only), and a file that will be set aside.
    write_parquet_events(landing, "orders", H2, [ev("UPDATE", 30, H2, 7, status="sent")])
    late = [
        ev("UPDATE", 20, t1 - timedelta(minutes=1), 1, status="held"),
        ev("UPDATE", 21, t0 - timedelta(days=2), 2, status="old"),
        ev("INSERT", 22, t0 - timedelta(hours=1), 50, status="early"),
    ]
    write_parquet_events(landing, "orders", H0, late, name="late.parquet")
    (hour_folder(landing, "orders", H2) / "broken.parquet").write_bytes(b"not parquet")

    before = tree(tmp_path)
    job = operator_job(platform, PLAN_JOB)
    result = job.execute_in_process(
        run_config={
            "ops": {
                "plan_merge": {
                    "config": {
                        "table": "orders",
                        "first_partition": "2024-01-01-00:00",
                        "last_partition": "2024-01-01-02:00",
                    }
                }
            }
        },
        resources=dagster_resources(),
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    assert tree(tmp_path) == before  # landing, logs, data, side tables: untouched; no shadow
    (observation,) = [
        e.event_specific_data.asset_observation  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION
    ]
    planned = {k: v.value for k, v in observation.metadata.items()}
    assert planned["late_events"] == 3 and planned["late_keys"] == 3
    assert planned["oldest_late_event"] == (t0 - timedelta(days=2)).isoformat()
    # Key 2's newest version opened at t1 = t0 + 1 h; its late event is from t0 - 2 days.
    assert planned["late_reach_hours"] == 49.0
    assert planned["files_quarantined"] == 1
    assert "broken.parquet" in str(planned["quarantined"])

    # The real run now: the same figures.
    real = materialize(spark, table, landing, warehouse, [H0, H1, H2], synced_at=SYNCED)
    m = real.merge
    assert (m.keys_affected, m.versions_opened, m.versions_closed) == (
        planned["keys_affected"],
        planned["versions_opened"],
        planned["versions_closed"],
    )
    assert (m.files_removed, m.bytes_removed, m.files_added) == (
        planned["files_removed"],
        planned["bytes_removed"],
        planned["files_added"],
    )
    assert (real.events_new, len(real.quarantined)) == (planned["events_new"], 1)
    assert m.keys_affected == 4 and m.files_removed >= 1 and m.bytes_removed > 0


def test_plan_of_a_table_not_created_yet(spark, lake):
    from cdc_platform.lib.config import TableConfig

    table = TableConfig(name="fresh", primary_key=("id",), start=H0)
    write_parquet_events(lake["landing"], "fresh", H0, [ev("INSERT", 1, H0, 1, status="a")])
    p = plan(HistoryTable(spark, table, lake["warehouse"], lake["landing"]), PlanRequest((H0,)))
    assert (p.outcome.merge.versions_opened, p.late_events) == (1, 0)
    assert not TablePaths.of(lake["warehouse"], "fresh").history.path.exists()
    assert [p.name for p in (lake["warehouse"] / "_cdc").iterdir()] == []
