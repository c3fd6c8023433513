"""The key is part of the table (docs/HISTORY_MODE.md): recorded on the history table by its first
merge, and a config naming another key refused before anything is written, through the asset,
an operator job and the merge itself."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from deltalake import DeltaTable

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history import invariants, table_key
from cdc_platform.lib.history.merge import apply
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.table_key import PRIMARY_KEY_PROPERTY, PrimaryKeyChangedError
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, one_table_config, write_parquet_events
from cdc_platform_tests.helpers import event as ev

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
FIRST = [
    ev("INSERT", 1, H0 + timedelta(minutes=1), 1, region="eu", status="new"),
    ev("INSERT", 2, H0 + timedelta(minutes=2), 2, region="us", status="new"),
]
LATER = [ev("UPDATE", 3, H1 + timedelta(minutes=1), 1, region="eu", status="paid")]


def config_file(tmp_path: Path, key: str) -> PlatformConfig:
    return one_table_config(tmp_path, f"primary_key: {key}")


def recorded(paths: TablePaths) -> list[str] | None:
    return table_key.recorded_key(Table.open(paths.history))


def versions(paths: TablePaths) -> tuple[int | None, ...]:
    return tuple(
        delta.version_or_none(p) for p in (paths.history, paths.changelog, paths.quarantine)
    )


def materialize_asset(platform: PlatformConfig, hour: datetime) -> dg.ExecuteInProcessResult:
    defs = build_table_definitions(platform, platform.table("t"))
    return dg.materialize(
        [defs.asset],
        partition_key=hour.strftime("%Y-%m-%d-%H:%M"),
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
        raise_on_error=False,
    )


def failure_of(result: dg.ExecuteInProcessResult) -> str:
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    return failure.event_specific_data.error.message  # type: ignore[union-attr]


def test_the_first_run_records_the_key_and_a_run_under_another_key_writes_nothing(spark, tmp_path):
    platform = config_file(tmp_path, "[id]")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(platform.landing_path, "t", H0, FIRST)
    assert materialize_asset(platform, H0).success
    assert recorded(paths) == ["id"]

    write_parquet_events(platform.landing_path, "t", H1, LATER)
    before = versions(paths)
    changed = config_file(tmp_path, "[id, region]")
    result = materialize_asset(changed, H1)
    assert not result.success
    message = failure_of(result)
    assert "['id', 'region']" in message and "['id']" in message
    assert "Nothing was written" in message and "rekey_table" in message
    assert versions(paths) == before  # no event logged, no file set aside, no version

    # Back under its own key, the hour applies as usual.
    assert materialize_asset(platform, H1).success
    assert versions(paths) != before and recorded(paths) == ["id"]


def test_an_operator_job_refuses_a_config_with_another_key(spark, tmp_path):
    platform = config_file(tmp_path, "[id]")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(platform.landing_path, "t", H0, FIRST)
    materialize(spark, platform.table("t"), platform.landing_path, platform.warehouse_root, [H0])
    before = versions(paths)
    changed = config_file(tmp_path, "[region]")
    result = (
        build_definitions(changed)
        .resolve_job_def("truncate_table")
        .execute_in_process(
            run_config={"ops": {"truncate": {"config": {"table": "t", "before": H1.isoformat()}}}},
            resources=dagster_resources(),
            instance=dg.DagsterInstance.ephemeral(),
            raise_on_error=False,
        )
    )
    assert not result.success
    assert "['region']" in failure_of(result) and "primary_key" in failure_of(result)
    assert versions(paths) == before


def test_the_merge_itself_refuses_another_key(spark, lake):
    """Whatever calls it: the merge checks the key it is given against the table's."""
    table = TableConfig(name="t", primary_key=("id",), start=H0)
    write_parquet_events(lake["landing"], "t", H0, FIRST)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], "t")
    before = versions(paths)
    another = HistoryTable(
        spark, dataclasses.replace(table, primary_key=("status",)), lake["warehouse"]
    )
    with pytest.raises(PrimaryKeyChangedError, match="folded under"):
        another.merge_pending(H1)
    assert versions(paths) == before


def test_the_same_columns_in_another_order_are_the_same_key(spark, lake):
    table = TableConfig(name="t", primary_key=("id", "region"), start=H0)
    write_parquet_events(lake["landing"], "t", H0, FIRST)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], "t")
    assert recorded(paths) == ["id", "region"]
    write_parquet_events(lake["landing"], "t", H1, LATER)
    reordered = dataclasses.replace(table, primary_key=("region", "id"))
    outcome = materialize(spark, reordered, lake["landing"], lake["warehouse"], [H1])
    assert outcome.merge.versions_opened == 1
    assert recorded(paths) == ["id", "region"]  # unchanged: no metadata commit for it
    assert not table_key.same_key(["id"], ["id", "region"])
    # Letter case counts: files are matched to the key as written, so it is refused here.
    assert not table_key.same_key(["ID", "region"], ["region", "id"])
    with pytest.raises(PrimaryKeyChangedError, match="folded under"):
        materialize(
            spark,
            dataclasses.replace(table, primary_key=("ID", "region")),
            lake["landing"],
            lake["warehouse"],
            [H1],
        )


def test_a_table_from_before_the_property_records_the_configs_key(spark, lake, monkeypatch):
    """Tables built before the key was recorded are not refused: their next commit records it."""
    table = TableConfig(name="t", primary_key=("id",), start=H0)
    # An older release: no property at creation, none recorded after.
    ensure = Table.ensure
    monkeypatch.setattr(
        Table, "ensure", lambda self, schema, about, _=None: ensure(self, schema, about)
    )
    monkeypatch.setattr(apply, "record_settings", lambda *a, **k: False)
    write_parquet_events(lake["landing"], "t", H0, FIRST)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], "t")
    assert recorded(paths) is None
    monkeypatch.undo()
    write_parquet_events(lake["landing"], "t", H1, LATER)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H1])
    assert recorded(paths) == ["id"]


@pytest.mark.parametrize(
    "value", ["id", "[]", "[1]", '{"a": 1}', "[" * 5000 + "]" * 5000, '["' + "x" * 20000 + '"]']
)
def test_a_property_another_tool_wrote_is_refused_not_guessed(spark, lake, value):
    table = TableConfig(name="t", primary_key=("id",), start=H0)
    write_parquet_events(lake["landing"], "t", H0, FIRST)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], "t")
    DeltaTable(str(paths.history)).alter.set_table_properties(
        {PRIMARY_KEY_PROPERTY: value}, raise_if_not_exists=False
    )
    write_parquet_events(lake["landing"], "t", H1, LATER)
    before = versions(paths)
    with pytest.raises(PrimaryKeyChangedError, match="not a list of column names"):
        materialize(spark, table, lake["landing"], lake["warehouse"], [H1])
    assert versions(paths) == before


def test_the_checks_verify_the_table_under_the_key_it_records(spark, lake):
    """A config naming another key is refused by the runs; the checks, which may run on a
    schedule meanwhile, verify the table as it is (its own key), not fail on every row."""
    table = TableConfig(name="t", primary_key=("id",), start=H0)
    write_parquet_events(lake["landing"], "t", H0, FIRST)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], "t")
    outcomes = invariants.run_checks(spark, paths, ["status"])  # two keys share "new"
    assert all(o.passed for o in outcomes), [o.name for o in outcomes if not o.passed]
