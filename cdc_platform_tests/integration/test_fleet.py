"""``landing_sensor: fleet``: one landing sensor for every table, and runs that apply the same
hour for several tables, each table its own step and commit (``defs.fleet``)."""

from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from deltalake import DeltaTable

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.alerts.runs import run_failed_payload
from cdc_platform.defs.sensors.all_tables import (
    FLEET_SENSOR,
    TABLES_TAG,
    FleetCursor,
    build_fleet_landing_sensor,
)
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tags import (
    BACKLOG_HOURS,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REASON_TAG,
    TABLE_TAG,
)
from cdc_platform.lib.config import ConfigError, PlatformConfig, TableConfig, parse_config
from cdc_platform.lib.fleet.sensor_cursor import (
    REASON_NEW_FOLDER,
    REASON_RETRY,
    PartitionRequest,
    batch,
)
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import Clock, dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev

START = datetime(2024, 1, 1, tzinfo=UTC)
H1 = START + timedelta(hours=1)
NAMES = ("accounts", "orders", "users")


def fleet(
    landing: Path, warehouse: Path, clock: Clock, per_run: int, budget: float = 30.0
) -> tuple[dg.Definitions, dg.SensorDefinition]:
    tables = tuple(
        TableConfig(name=n, primary_key=("id",), start=START, retry_backoff_seconds=60)
        for n in NAMES
    )
    platform = PlatformConfig(landing, Location.of(warehouse), tables)
    defs = [build_table_definitions(platform, t) for t in tables]
    assets = {t.name: d.asset for t, d in zip(tables, defs, strict=True)}
    sensor = build_fleet_landing_sensor(
        tables, landing, warehouse, assets, per_run, clock=clock, budget_seconds=budget
    )
    definitions = dg.Definitions(
        assets=list(assets.values()),
        asset_checks=[d.checks for d in defs],
        sensors=[sensor],
        resources=dagster_resources(),
    )
    return definitions, sensor


def tick(
    defs: dg.Definitions,
    sensor: dg.SensorDefinition,
    cursor: str | None,
    instance: dg.DagsterInstance,
) -> tuple[list[dg.RunRequest], str | None, list[dg.AssetObservation]]:
    """Evaluate as the daemon does (asset selections and partition keys resolved)."""
    context = dg.build_sensor_context(cursor=cursor, instance=instance, definitions=defs)
    data = sensor.evaluate_tick(context)
    events = [e for e in data.asset_events if isinstance(e, dg.AssetObservation)]
    return list(data.run_requests or []), data.cursor, events


def launch(
    defs: dg.Definitions, request: dg.RunRequest, instance: dg.DagsterInstance
) -> dg.ExecuteInProcessResult:
    """The run a request asks for, executed as its job, its assets and partition."""
    assert request.job_name is not None and request.asset_selection is not None
    return defs.resolve_job_def(request.job_name).execute_in_process(
        instance=instance,
        partition_key=request.partition_key,
        asset_selection=list(request.asset_selection),
        tags=request.tags,
        raise_on_error=False,
    )


def selected(request: dg.RunRequest) -> list[str]:
    return sorted(k.to_user_string() for k in request.asset_selection or ())


def test_one_run_applies_an_hour_for_several_tables_and_a_failing_table_fails_alone(
    spark, lake
) -> None:
    """One tick sees every table; the hour that landed in three tables
    becomes one run of two tables and one of one (``tables_per_run: 2``). A table whose
    warehouse cannot be written fails its own step: the other table of its run is committed
    and checked, and the failed table's hour is asked for again, alone, after its backoff."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    for i, name in enumerate(NAMES):
        write_parquet_events(landing, name, H1, [ev("INSERT", 1, H1, i, v=name)])
    clock = Clock(datetime(2024, 1, 1, 5, 30, tzinfo=UTC))
    defs, sensor = fleet(landing, warehouse, clock, per_run=2)
    instance = dg.DagsterInstance.ephemeral()

    requests, cursor, events = tick(defs, sensor, None, instance)
    assert requests == [] and events == []  # a first tick stores its epoch only
    requests, cursor, events = tick(defs, sensor, cursor, instance)
    assert [selected(r) for r in requests] == [["accounts", "orders"], ["users"]]
    assert {r.partition_key for r in requests} == {hour_to_partition_key(H1)}
    assert {r.job_name for r in requests} == {"__ASSET_JOB"}  # Dagster's implicit asset job
    assert [r.tags.get(TABLE_TAG) for r in requests] == [None, "users"]
    assert [r.tags[TABLES_TAG] for r in requests] == ["2", "1"]
    assert {r.tags[REASON_TAG] for r in requests} == {REASON_NEW_FOLDER}
    assert sorted(e.asset_key.to_user_string() for e in events) == sorted(NAMES)
    # Each table's cursor is in the instance's key-value store, under the sensor's epoch.
    epoch = FleetCursor.from_json(cursor)
    assert set(instance.run_storage.get_cursor_values({epoch.key(n) for n in NAMES})) == {
        epoch.key(n) for n in NAMES
    }

    blocker = TablePaths.of(warehouse, "orders").changelog.path.parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder: the orders table cannot be written")
    both, alone = (launch(defs, r, instance) for r in requests)
    assert not both.success and alone.success
    failed = [e.step_key for e in both.all_events if e.is_step_failure]
    assert failed == ["orders"]
    # The run-failure alert names the table that failed, not the one that committed.
    run = instance.get_run_by_id(both.run_id)
    assert run is not None
    alert = run_failed_payload(instance, run, None, "http://ui")
    assert alert is not None and alert["table"] == "orders"
    materialized = {str(m.asset_key) for m in both.get_asset_materialization_events()}
    assert materialized == {str(dg.AssetKey("accounts"))}
    checked = {e.asset_key.to_user_string() for e in both.get_asset_check_evaluations()}
    assert checked == {"accounts"}
    assert all(e.passed for e in both.get_asset_check_evaluations())

    blocker.unlink()
    clock.now += timedelta(minutes=2)  # past the 60 s backoff
    requests, cursor, _ = tick(defs, sensor, cursor, instance)
    assert [(selected(r), r.tags[REASON_TAG], r.tags.get(TABLE_TAG)) for r in requests] == [
        (["orders"], REASON_RETRY, "orders")
    ]
    assert launch(defs, requests[0], instance).success
    for i, name in enumerate(NAMES):
        rows = DeltaTable(str(warehouse / name)).to_pyarrow_table(columns=["id", "v"])
        assert rows.to_pylist() == [{"id": i, "v": name}]

    clock.now += timedelta(minutes=2)
    requests, cursor, events = tick(defs, sensor, cursor, instance)
    assert requests == []
    assert [e.metadata[BACKLOG_HOURS].value for e in events] == [0]  # orders' backlog ended
    # A reset cursor: a new epoch, every table seeded again from its ledger: nothing to ask.
    _, reset, _ = tick(defs, sensor, None, instance)
    assert FleetCursor.from_json(reset).epoch != epoch.epoch
    requests, _, events = tick(defs, sensor, reset, instance)
    assert requests == [] and len(events) == len(NAMES)


def test_a_tick_over_budget_goes_on_where_it_stopped_and_a_bad_cursor_is_reseeded(
    tmp_path: Path,
) -> None:
    """With no time left, a tick still takes up one table and the next tick the next one;
    a table whose stored cursor cannot be read is seeded again, and the others go on."""
    landing, warehouse = tmp_path / "landing", tmp_path / "warehouse"
    for name in NAMES:
        write_parquet_events(landing, name, H1, [ev("INSERT", 1, H1, 1, v=name)])
    clock = Clock(datetime(2024, 1, 1, 5, 30, tzinfo=UTC))
    defs, sensor = fleet(landing, warehouse, clock, per_run=3, budget=0.0)
    instance = dg.DagsterInstance.ephemeral()
    _, cursor, _ = tick(defs, sensor, None, instance)  # the epoch
    for expected in NAMES:
        requests, cursor, _ = tick(defs, sensor, cursor, instance)
        assert [selected(r) for r in requests] == [[expected]]
    epoch = FleetCursor.from_json(cursor)
    instance.run_storage.set_cursor_values({epoch.key("accounts"): '{"v": 99}'})
    (hour_folder(landing, "accounts", H1) / "late.parquet").write_bytes(b"PAR1")
    requests, cursor, _ = tick(defs, sensor, cursor, instance)  # accounts' turn again
    assert [selected(r) for r in requests] == [["accounts"]]


def test_the_fleet_replaces_the_per_table_sensors_with_no_job_of_its_own(tmp_path: Path) -> None:
    """One sensor targets the tables' assets; its runs belong to Dagster's implicit asset job.
    The config refuses batching without the fleet."""
    (tmp_path / "landing").mkdir()
    raw = {
        "landing_root": "landing",
        "warehouse_root": "warehouse",
        "landing_sensor": "fleet",
        "tables_per_run": 20,
        "tables": [
            {"name": "a", "primary_key": ["id"], "start": "2024-01-01-00:00"},
            {"name": "b", "primary_key": ["id"], "start": "2024-01-01-00:00"},
            {"name": "c", "primary_key": ["id"], "start": "2025-06-01-00:00"},
        ],
    }
    defs = build_definitions(parse_config(raw, tmp_path))
    repo = defs.get_repository_def()
    landing = [s.name for s in repo.sensor_defs if "landing" in s.name]
    assert landing == [FLEET_SENSOR]
    # No job of its own: its runs are Dagster's implicit asset job's (one 500-asset snapshot).
    assert not [j.name for j in repo.get_all_jobs() if "landing" in j.name or "ingest" in j.name]
    with pytest.raises(ConfigError, match=r"tables_per_run.*need 'landing_sensor: fleet'"):
        parse_config({**raw, "landing_sensor": "per_table"}, tmp_path)
    with pytest.raises(ConfigError, match=r"tables_per_run.*from 1 to 100"):
        parse_config({**raw, "tables_per_run": 0}, tmp_path)


def test_batches_group_by_hours_and_partitions_and_retries_run_alone() -> None:
    """Tables with the same hours and start share runs, up to the limit, oldest hours first;
    a table asked for again runs alone (a table that kills its run never holds the same
    neighbours back twice)."""

    def req(keys: tuple[str, ...], reason: str = REASON_NEW_FOLDER) -> PartitionRequest:
        return PartitionRequest(keys, f"{keys}/{reason}", reason)

    h1, h2 = ("2024-01-01-01:00",), ("2024-01-01-02:00",)
    requests = {
        "a": [req(h2)],
        "b": [req(h2), req(h1)],
        "c": [req(h2)],
        "d": [req(h2, REASON_RETRY)],
        "e": [req(h2, REASON_RETRY)],
        "f": [req(h2)],
    }
    starts = {t: "2024-01-01-00:00" for t in requests} | {"f": "2023-01-01-00:00"}
    batches = batch(requests, starts, tables_per_run=2)
    assert [(b.tables, b.partition_keys) for b in batches] == [
        (("b",), h1),
        (("f",), h2),
        (("a", "b"), h2),
        (("c",), h2),
        (("d",), h2),
        (("e",), h2),
    ]
    assert len({b.run_key for b in batches}) == len(batches)
    assert batch(requests, starts, tables_per_run=2) == batches  # deterministic


def test_tables_of_two_starts_and_an_hour_range_resolve_to_dagsters_asset_job(
    tmp_path: Path,
) -> None:
    """What the implicit asset job must take: a range run (two hours, the range tags) of two
    tables of one start, and a run of a table of another start, each resolved as the daemon
    resolves a sensor's requests (their partitions checked against the selected assets)."""
    landing, warehouse = tmp_path / "landing", tmp_path / "warehouse"
    later = START + timedelta(hours=1)
    tables = (
        TableConfig(name="a", primary_key=("id",), start=START),
        TableConfig(name="b", primary_key=("id",), start=START),
        TableConfig(name="c", primary_key=("id",), start=later),
    )
    for table in tables:
        for hour in (START, later) if table.start == START else (later,):
            write_parquet_events(landing, table.name, hour, [ev("INSERT", 1, hour, 1, v="x")])
    platform = PlatformConfig(landing, Location.of(warehouse), tables)
    defs = [build_table_definitions(platform, t) for t in tables]
    assets = {t.name: d.asset for t, d in zip(tables, defs, strict=True)}
    clock = Clock(datetime(2024, 1, 1, 5, 30, tzinfo=UTC))
    sensor = build_fleet_landing_sensor(tables, landing, warehouse, assets, 20, clock=clock)
    definitions = dg.Definitions(
        assets=list(assets.values()),
        asset_checks=[d.checks for d in defs],
        sensors=[sensor],
        resources=dagster_resources(),
    )
    instance = dg.DagsterInstance.ephemeral()
    _, cursor, _ = tick(definitions, sensor, None, instance)
    requests, _, _ = tick(definitions, sensor, cursor, instance)
    by_tables = {tuple(selected(r)): r for r in requests}
    assert set(by_tables) == {("a", "b"), ("c",)}
    assert {r.job_name for r in requests} == {"__ASSET_JOB"}
    ab, c = by_tables[("a", "b")], by_tables[("c",)]
    assert ab.partition_key is None
    assert (ab.tags[RANGE_START_TAG], ab.tags[RANGE_END_TAG]) == (
        hour_to_partition_key(START),
        hour_to_partition_key(later),
    )
    assert c.partition_key == hour_to_partition_key(later)
