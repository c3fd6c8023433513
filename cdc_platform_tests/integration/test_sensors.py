"""The landing sensor as Dagster evaluates it: run requests, partition ranges, cursor progression."""

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.storage import tags as dagster_tags
from deltalake import DeltaTable

from cdc_platform.defs.sensors.per_table import build_landing_sensor
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tags import (
    BACKLOG_HOURS,
    BACKLOG_OLDEST,
    BACKLOG_SINCE,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REASON_TAG,
    TABLE_TAG,
)
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.fleet.sensor_cursor import (
    REASON_INITIAL,
    REASON_NEW_FILES,
    REASON_NEW_FOLDER,
    CursorState,
)
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import Clock, dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev

START = datetime(2024, 1, 1, tzinfo=UTC)
TABLE = TableConfig(name="orders", primary_key=("id",), start=START, sensor_interval_seconds=45)
seen_ranges: list[tuple[str, ...]] = []


@dg.asset(
    name="orders",
    partitions_def=dg.HourlyPartitionsDefinition(start_date="2024-01-01-00:00"),
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def orders_asset(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Stands in for the real table asset: records which partitions one run covered."""
    seen_ranges.append(tuple(context.partition_keys))
    return dg.MaterializeResult(metadata={"partitions": len(context.partition_keys)})


def put(root: Path, hour: datetime, name: str = "part-0.parquet") -> None:
    folder = hour_folder(root, "orders", hour)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"PAR1" + name.encode())


def tick(
    sensor: dg.SensorDefinition,
    cursor: str | None,
    instance: dg.DagsterInstance,
    assets: list,
    resources: dict | None = None,
) -> tuple[list[dg.RunRequest], str | None, str | None]:
    """Evaluate like the daemon does (partition keys are resolved and validated)."""
    defs = dg.Definitions(assets=assets, sensors=[sensor], resources=resources)
    context = dg.build_sensor_context(cursor=cursor, instance=instance, definitions=defs)
    data = sensor.evaluate_tick(context)
    return list(data.run_requests or []), data.cursor, data.skip_message


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def test_sensor_definition_shape(tmp_path: Path) -> None:
    sensor = build_landing_sensor(TABLE, tmp_path, orders_asset)
    assert sensor.name == "orders_landing_sensor"
    assert sensor.minimum_interval_seconds == 45
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    stopped = build_landing_sensor(
        TABLE, tmp_path, orders_asset, default_status=dg.DefaultSensorStatus.STOPPED
    )
    assert stopped.default_status == dg.DefaultSensorStatus.STOPPED


def test_single_partition_and_range_requests_and_cursor_progression(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    clock = Clock(datetime(2024, 1, 3, 10, 30, tzinfo=UTC))
    sensor = build_landing_sensor(TABLE, tmp_path, orders_asset, clock=clock)

    requests, cursor, skip = tick(sensor, None, instance, [orders_asset])
    assert requests == [] and skip
    assert cursor is not None and json.loads(cursor)["last_sweep_started"]

    for h in (5, 6, 7, 9):
        put(tmp_path, datetime(2024, 1, 3, h, tzinfo=UTC))
    clock.now += timedelta(minutes=1)
    requests, cursor, _ = tick(sensor, cursor, instance, [orders_asset])
    assert len(requests) == 2
    ranged, single = requests
    assert ranged.partition_key is None
    assert ranged.partition_key_range == dg.PartitionKeyRange(
        "2024-01-03-05:00", "2024-01-03-07:00"
    )
    assert ranged.tags[RANGE_START_TAG] == "2024-01-03-05:00"
    assert ranged.tags[RANGE_END_TAG] == "2024-01-03-07:00"
    assert ranged.tags[TABLE_TAG] == "orders"
    assert ranged.tags[REASON_TAG] == REASON_NEW_FOLDER
    assert ranged.run_key and ranged.run_key.startswith(
        "orders:2024-01-03-05:00..2024-01-03-07:00:"
    )
    assert single.partition_key == "2024-01-03-09:00"
    assert single.tags["dagster/partition"] == "2024-01-03-09:00"  # resolved like the daemon does
    assert RANGE_START_TAG not in single.tags
    assert single.tags[TABLE_TAG] == "orders"
    state = CursorState.from_json(cursor)
    assert set(state.folders) == {f"2024-01-03-0{h}:00" for h in (5, 6, 7, 9)}

    clock.now += timedelta(minutes=1)
    again, cursor, skip = tick(sensor, cursor, instance, [orders_asset])
    assert again == [] and skip == "no new or changed hour folders"

    put(tmp_path, datetime(2024, 1, 3, 6, tzinfo=UTC), "part-1.parquet")
    clock.now += timedelta(minutes=1)
    changed, cursor, _ = tick(sensor, cursor, instance, [orders_asset])
    assert [(r.partition_key, r.tags[REASON_TAG]) for r in changed] == [
        ("2024-01-03-06:00", REASON_NEW_FILES)
    ]
    assert changed[0].run_key != ranged.run_key


def test_range_request_launches_one_run_over_the_whole_range(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    for i in range(30):  # 2024-01-01 00:00 .. 05:00 of the 2nd: old folders, an initial backfill
        put(tmp_path, START + timedelta(hours=i))
    clock = Clock(datetime(2024, 1, 5, 0, 30, tzinfo=UTC))
    sensor = build_landing_sensor(TABLE, tmp_path, orders_asset, clock=clock)
    requests, _, _ = tick(sensor, None, instance, [orders_asset])
    assert len(requests) == 1
    (request,) = requests
    assert request.tags[REASON_TAG] == REASON_INITIAL
    expected = tuple(hour_to_partition_key(START + timedelta(hours=i)) for i in range(30))
    assert request.partition_key_range == dg.PartitionKeyRange(expected[0], expected[-1])

    seen_ranges.clear()
    result = dg.materialize([orders_asset], instance=instance, tags=dict(request.tags))
    assert result.success
    assert seen_ranges == [expected]  # one run, all 30 partitions
    assert instance.get_materialized_partitions(dg.AssetKey("orders")) == set(expected)
    (run,) = instance.get_runs()
    assert run.tags[RANGE_START_TAG] == expected[0]
    assert run.tags[RANGE_END_TAG] == expected[-1]
    assert run.tags[TABLE_TAG] == "orders"


def test_single_request_launches_a_partition_run(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    put(tmp_path, datetime(2024, 1, 3, 8, tzinfo=UTC))
    sensor = build_landing_sensor(
        TABLE, tmp_path, orders_asset, clock=Clock(datetime(2024, 1, 3, 10, 30, tzinfo=UTC))
    )
    (request,), _, _ = tick(sensor, None, instance, [orders_asset])
    seen_ranges.clear()
    tags = {k: v for k, v in request.tags.items() if not k.startswith("dagster/")}
    result = dg.materialize(
        [orders_asset], instance=instance, partition_key=request.partition_key, tags=tags
    )
    assert result.success
    assert seen_ranges == [("2024-01-03-08:00",)]


def test_the_open_hour_with_a_real_clock(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    """With the wall clock, the open hour's partition does not exist yet: never requested early."""
    now = datetime.now(UTC)
    current = now.replace(minute=0, second=0, microsecond=0)
    put(tmp_path, current)
    put(tmp_path, current - timedelta(hours=1))
    table = TableConfig(name="orders", primary_key=("id",), start=current - timedelta(days=2))
    orders_now = dg.asset(
        name="orders",
        partitions_def=dg.HourlyPartitionsDefinition(
            start_date=(current - timedelta(days=2)).strftime("%Y-%m-%d-%H:%M")
        ),
    )(lambda: None)
    sensor = build_landing_sensor(table, tmp_path, orders_now)
    requests, _, _ = tick(sensor, None, instance, [orders_now])  # validated against the asset
    assert [r.partition_key for r in requests] == [
        hour_to_partition_key(current - timedelta(hours=1))
    ]

    @dg.asset(
        name="orders",
        partitions_def=dg.HourlyPartitionsDefinition(
            start_date=(current - timedelta(days=2)).strftime("%Y-%m-%d-%H:%M"), end_offset=1
        ),
    )
    def orders_open(context: dg.AssetExecutionContext) -> None:
        """Partitions include the open hour (end_offset=1)."""

    sensor = build_landing_sensor(table, tmp_path, orders_open)
    requests, _, _ = tick(sensor, None, instance, [orders_open])
    assert [r.partition_key_range for r in requests] == [
        dg.PartitionKeyRange(
            hour_to_partition_key(current - timedelta(hours=1)), hour_to_partition_key(current)
        )
    ]


def test_range_tag_names_are_dagsters() -> None:
    assert dagster_tags.ASSET_PARTITION_RANGE_START_TAG == RANGE_START_TAG
    assert dagster_tags.ASSET_PARTITION_RANGE_END_TAG == RANGE_END_TAG
    assert dagster_tags.PARTITION_NAME_TAG == "dagster/partition"


def test_first_tick_starts_from_what_is_already_applied(
    spark, lake, instance: dg.DagsterInstance
) -> None:
    """After every hour was materialized (as `make demo` does), the sensor's
    first tick requests nothing; then a new file triggers exactly its hour."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    table = TableConfig(name="orders", primary_key=("id",), start=START)
    platform = PlatformConfig(landing, warehouse, (table,))
    h0, h1, h2, h3 = (START + timedelta(hours=i) for i in range(4))
    write_parquet_events(landing, "orders", h0, [ev("INSERT", 1, h0, 1, v="a")])
    write_parquet_events(landing, "orders", h1, [ev("UPDATE", 2, h1, 1, v="b")])
    # A re-delivery of events already logged: read, but in no change-log row.
    write_parquet_events(landing, "orders", h2, [ev("UPDATE", 2, h1, 1, v="b")])
    (hour_folder(landing, "orders", h2) / "part-bad.parquet").write_bytes(b"not parquet")
    defs = build_table_definitions(platform, table)
    result = dg.materialize(
        [defs.asset],
        instance=instance,
        resources=dagster_resources(),
        tags={RANGE_START_TAG: hour_to_partition_key(h0), RANGE_END_TAG: hour_to_partition_key(h2)},
    )
    assert result.success
    paths = TablePaths.of(warehouse, "orders")
    logged = DeltaTable(str(paths.changelog)).to_pyarrow_table(columns=["_cdc_source_file"])
    assert not any("hour=02" in f for f in logged["_cdc_source_file"].to_pylist())
    assert len(quarantine.current(paths.quarantine)) == 1

    # A file that landed after the materialization and was never read.
    write_parquet_events(landing, "orders", h3, [ev("INSERT", 3, h3, 3, v="c")])
    clock = Clock(datetime(2024, 1, 1, 4, 30, tzinfo=UTC))  # window: hours 0..3
    sensor = build_landing_sensor(table, landing, defs.asset, warehouse_root=warehouse, clock=clock)
    requests, cursor, _ = tick(sensor, None, instance, [defs.asset], dagster_resources())
    assert [(r.partition_key, r.tags[REASON_TAG]) for r in requests] == [
        (hour_to_partition_key(h3), REASON_NEW_FOLDER)
    ]
    # Everything else was applied: remembered as if requested, so nothing else runs.
    assert set(CursorState.from_json(cursor).folders) == {
        hour_to_partition_key(h) for h in (h0, h1, h2, h3)
    }

    result = dg.materialize(
        [defs.asset],
        instance=instance,
        resources=dagster_resources(),
        partition_key=hour_to_partition_key(h3),
    )
    assert result.success
    # A reset cursor (or the first tick of `make ui` after `make demo`): nothing to request.
    clock.now += timedelta(minutes=1)
    requests, cursor, skip = tick(sensor, None, instance, [defs.asset], dagster_resources())
    assert requests == [] and skip == "no new or changed hour folders"

    write_parquet_events(landing, "orders", h1, [ev("UPDATE", 4, h1, 1, v="d")])
    clock.now += timedelta(minutes=1)
    requests, cursor, _ = tick(sensor, cursor, instance, [defs.asset], dagster_resources())
    assert [(r.partition_key, r.tags[REASON_TAG]) for r in requests] == [
        (hour_to_partition_key(h1), REASON_NEW_FILES)
    ]


def test_without_a_ledger_the_first_tick_requests_every_folder(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """Nothing recorded as applied (a fresh warehouse): every closed folder is requested."""
    for h in (1, 2):
        put(tmp_path / "landing", START + timedelta(hours=h))
    sensor = build_landing_sensor(
        TABLE,
        tmp_path / "landing",
        orders_asset,
        warehouse_root=tmp_path / "warehouse",
        clock=Clock(datetime(2024, 1, 1, 5, 30, tzinfo=UTC)),
    )
    requests, _, _ = tick(sensor, None, instance, [orders_asset])
    assert [r.partition_key_range for r in requests] == [
        dg.PartitionKeyRange("2024-01-01-01:00", "2024-01-01-02:00")
    ]


def test_a_missing_landing_root_fails_the_tick_instead_of_looking_quiet(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """An unmounted landing volume lists nothing: the tick fails, naming the root, so the
    sensor's page shows it (an empty listing would look like a source with nothing new)."""
    sensor = build_landing_sensor(TABLE, tmp_path / "not-mounted", orders_asset)
    with pytest.raises(Exception, match=r"cannot be listed.*is the landing volume mounted"):
        tick(sensor, None, instance, [orders_asset])
    (tmp_path / "not-mounted").mkdir()
    requests, cursor, _ = tick(sensor, None, instance, [orders_asset])
    assert requests == [] and cursor


def test_the_backlog_is_reported_when_it_changes_and_after_a_reset_cursor(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    """What ``cdc_source_alerts`` reads: hours requested and not seen applied, the oldest, and
    when it was first requested; sent when any of them changes, and always on a tick whose
    cursor is empty (the last report may not hold any more)."""
    clock = Clock(datetime(2024, 1, 1, 5, 30, tzinfo=UTC))
    sensor = build_landing_sensor(
        TABLE, tmp_path / "landing", orders_asset, warehouse_root=tmp_path / "wh", clock=clock
    )
    defs = dg.Definitions(assets=[orders_asset], sensors=[sensor])

    def observed(cursor: str | None) -> tuple[list[dict], str | None]:
        context = dg.build_sensor_context(cursor=cursor, instance=instance, definitions=defs)
        data = sensor.evaluate_tick(context)
        events = [
            {k: v.value for k, v in e.metadata.items()}
            for e in data.asset_events
            if isinstance(e, dg.AssetObservation)
        ]
        return events, data.cursor

    (tmp_path / "landing").mkdir()
    events, cursor = observed(None)  # a first tick: nothing pending, reported all the same
    assert [e[BACKLOG_HOURS] for e in events] == [0]
    put(tmp_path / "landing", START + timedelta(hours=2))
    clock.now += timedelta(minutes=1)
    events, cursor = observed(cursor)
    (report,) = events
    assert report[BACKLOG_HOURS] == 1 and report[BACKLOG_OLDEST] == "2024-01-01-02:00"
    assert report[BACKLOG_SINCE] == clock.now.timestamp()
    clock.now += timedelta(minutes=1)
    assert observed(cursor)[0] == []  # unchanged: nothing sent
    events, _ = observed(None)  # a reset cursor: sent again
    assert [e[BACKLOG_HOURS] for e in events] == [1]
