"""Each run shows its cost: seconds and Spark jobs per stage, bytes read, and
the bytes each Delta commit of the run rewrote, in the materialization's Dagster metadata."""

from __future__ import annotations

import json
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest

from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tables.history import materialization_metadata
from cdc_platform.lib.config import TableConfig, load_config
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark import run_cost
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev

D1 = datetime(2020, 1, 1, tzinfo=UTC)
STAGES = {
    "list_files",
    "inspect",
    "changelog_append",
    "quarantine",
    "merge_open",
    "merge_classify",
    "merge_fold_compare",
    "merge_write",
    "merge_commit",
    "merge_side_tables",
}


def log_bytes(table: Path, after: int | None, upto: int) -> int:
    """Sizes of the add and remove actions of the commits ``after`` < v <= ``upto``, read from
    the Delta log's JSON (every remove the platform writes carries its size)."""
    total = 0
    first = 0 if after is None else after + 1
    for v in range(first, upto + 1):
        for line in (table / "_delta_log" / f"{v:020d}.json").read_text().splitlines():
            action = json.loads(line)
            for kind in ("add", "remove"):
                if kind in action:
                    total += int(action[kind]["size"])
    return total


def latest_version(table: Path) -> int:
    return max(int(p.name[:20]) for p in (table / "_delta_log").glob("*.json"))


def materialization(defs, partition: str) -> dict:
    result = dg.materialize(
        [defs.asset],
        partition_key=partition,
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
    )
    assert result.success
    [event] = result.get_asset_materialization_events()
    return {k: v.value for k, v in event.materialization.metadata.items()}


def test_cost_metadata_of_a_real_materialization(spark, tmp_path):
    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        + textwrap.indent('- name: abc\n  primary_key: [id]\n  start: "2020-01-01-00:00"\n', "  ")
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    defs = build_table_definitions(platform, platform.table("abc"))
    paths = TablePaths.of(platform.warehouse_root, "abc")
    d2 = D1 + timedelta(hours=1)
    write_parquet_events(
        platform.landing_path,
        "abc",
        D1,
        [ev("INSERT", 1, D1, "a", counter=1), ev("INSERT", 2, D1, "b", counter=2)],
    )
    write_parquet_events(
        platform.landing_path,
        "abc",
        d2,
        [ev("UPDATE", 3, d2, "a", counter=3), ev("DELETE", 4, d2, "b", counter=None)],
    )
    materialize(spark, platform.table("abc"), platform.landing_path, platform.warehouse_root, [D1])
    log_before = latest_version(paths.changelog.path)
    meta = materialization(defs, "2020-01-01-01:00")  # rewrites the live file: adds and removes

    stage_seconds = {k[len("cost/seconds/") :]: v for k, v in meta.items() if "seconds/" in k}
    total = stage_seconds.pop("total")
    assert set(stage_seconds) == STAGES
    assert all(s >= 0 for s in stage_seconds.values())
    assert sum(stage_seconds.values()) <= total + 0.0005 * len(stage_seconds)  # each rounded

    jobs = {k[len("cost/spark_jobs/") :]: v for k, v in meta.items() if "spark_jobs/" in k}
    assert set(jobs) == {*STAGES, "total"}  # local mode: counted
    assert all(isinstance(v, int) for v in jobs.values())
    assert jobs["total"] == sum(v for k, v in jobs.items() if k != "total") > 0
    assert jobs["changelog_append"] > 0 and jobs["merge_write"] > 0
    assert "cost/spark_jobs_note" not in meta

    history = paths.history.path
    assert meta["cost/bytes_rewritten/history"] == log_bytes(
        history, meta["delta_version_before"], meta["delta_version"]
    )
    assert meta["cost/bytes_rewritten/history"] > 0
    assert meta["cost/bytes_rewritten/changelog"] == log_bytes(
        paths.changelog.path, log_before, meta["changelog_version"]
    )
    assert meta["cost/commits/history"] == meta["delta_version"] - meta["delta_version_before"]
    per_table = {k: v for k, v in meta.items() if k.startswith("cost/bytes_rewritten/")}
    assert per_table.pop("cost/bytes_rewritten/total") == sum(per_table.values())
    landing = sum(f.stat().st_size for f in (platform.landing_path / "abc").rglob("*.parquet"))
    assert 0 < meta["cost/bytes_read/landing"] < landing  # this hour's file only
    assert meta["cost/bytes_read/history"] > 0


def test_job_group_is_restored_and_laps_outside_a_run_do_nothing(spark, lake):
    run_cost.lap("nowhere")  # no run: nothing happens
    sc = spark.sparkContext
    sc.setLocalProperty("spark.jobGroup.id", "callers-group")
    try:
        write_parquet_events(lake["landing"], "t", D1, [ev("INSERT", 1, D1, 1, v="x")])
        table = TableConfig(name="t", primary_key=("id",), start=D1)
        out = materialize(spark, table, lake["landing"], lake["warehouse"], [D1])
        assert sc.getLocalProperty("spark.jobGroup.id") == "callers-group"
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # pyright: ignore[reportArgumentType]
    assert out.cost is not None and out.cost.spark_jobs is not None
    assert out.cost.spark_jobs == sum(s.spark_jobs or 0 for s in out.cost.stages)
    # A first run creates the tables: every byte of its commits is an add.
    history = next(t for t in out.cost.tables if t.name == "history")
    assert history.commits >= 1 and history.bytes_removed == 0
    assert history.bytes_added == out.merge.bytes_added


def test_over_spark_connect_job_counts_are_absent_not_zero(spark, lake, monkeypatch):
    monkeypatch.setattr(run_cost, "is_connect", lambda session: True)
    write_parquet_events(lake["landing"], "t", D1, [ev("INSERT", 1, D1, 1, v="x")])
    table = TableConfig(name="t", primary_key=("id",), start=D1)
    out = materialize(spark, table, lake["landing"], lake["warehouse"], [D1])
    assert out.cost is not None and out.cost.spark_jobs is None
    figures = out.cost.figures()
    assert not any(k.startswith("spark_jobs/") for k in figures)
    assert figures["seconds/total"] > 0 and figures["bytes_rewritten/history"] > 0
    meta = materialization_metadata(out)
    assert "not counted" in meta["cost/spark_jobs_note"]
    assert isinstance(meta["cost/seconds/merge_write"], dg.FloatMetadataValue)
    assert isinstance(meta["cost/bytes_rewritten/history"], dg.IntMetadataValue)


def test_a_failed_run_leaves_no_stopwatch_behind(spark, lake, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr("cdc_platform.lib.history.table.apply_pending", boom)
    write_parquet_events(lake["landing"], "t", D1, [ev("INSERT", 1, D1, 1, v="x")])
    table = TableConfig(name="t", primary_key=("id",), start=D1)
    with pytest.raises(RuntimeError, match="boom"):
        materialize(spark, table, lake["landing"], lake["warehouse"], [D1])
    assert run_cost._current.get() is None
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None


def test_a_small_run_plans_whole_and_restores_the_sessions_setting(spark):
    """Adaptive execution is off for a run below ``SMALL_RUN_BYTES`` (each of its shuffle
    stages would be a Spark job of its own) and the session's own setting comes back after."""
    from cdc_platform.lib.pipeline import SMALL_RUN_BYTES, plan_whole_if_small
    from cdc_platform.lib.spark.session import ADAPTIVE as key
    from cdc_platform.lib.spark.session import conf_restored

    before = spark.conf.get(key)
    try:
        spark.conf.set(key, "true")
        with conf_restored(spark, key):
            plan_whole_if_small(spark, SMALL_RUN_BYTES - 1)
            assert spark.conf.get(key) == "false"
        assert spark.conf.get(key) == "true"
        with conf_restored(spark, key):
            plan_whole_if_small(spark, SMALL_RUN_BYTES)
            assert spark.conf.get(key) == "true"
        with pytest.raises(RuntimeError), conf_restored(spark, key):
            plan_whole_if_small(spark, 0)
            raise RuntimeError("a failed run")
        assert spark.conf.get(key) == "true"
    finally:
        spark.conf.set(key, before)
