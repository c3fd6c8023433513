"""What a landing sensor tick, a new-tables tick and a code-location load list on a bucket.

Before the shared listing, a reset cursor listed two folders an hour to seed (1,441 requests for 720
hours), and a folder of junk keys (one per hour, in sub-folders) two an hour at every
``cdc_new_tables`` tick and every load with ``discover:``. Now seeding, the sweep and discovery
share the table's one prefix listing, and each tick lists within a budget, going on next tick
where it stopped. The requests are counted as S3 sees them (a botocore hook on every client the
zone makes) against moto's S3 server; the sensors are evaluated as the daemon does.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.alerts.webhook import AlertWebhookResource
from cdc_platform.defs.sensors.all_tables import FLEET_SENSOR, FleetCursor
from cdc_platform.defs.sensors.per_table import partitions_of
from cdc_platform.lib.config import load_config
from cdc_platform.lib.fleet import sensor_cursor
from cdc_platform.lib.fleet.sensor_cursor import CursorState, evaluate
from cdc_platform.lib.landing import discovery
from cdc_platform.lib.landing.discovery import unlisted_tables, with_discovered_tables
from cdc_platform.lib.landing.where import object_store
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.landing.where.object_store import S3Landing
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import ListBudget
from cdc_platform.lib.ledgers import applied_files
from cdc_platform.lib.storage.stores import Location
from cdc_platform_tests.integration.test_object_landing import (
    KEY_ID,
    KEY_ID_ENV,
    SECRET,
    SECRET_ENV,
    _client,
    _events,
    _folder,
    _options,
    _put,
)

H0 = datetime(2024, 1, 1, tzinfo=UTC)


@pytest.fixture()
def zone(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3Landing:
    """A landing zone in a bucket of its own on moto's S3 server."""
    name = f"landing-{uuid.uuid4().hex[:12]}"
    _client(s3_endpoint).create_bucket(Bucket=name)
    monkeypatch.setenv(KEY_ID_ENV, KEY_ID)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    landing = zone_at(Location.of(f"s3://{name}/landing", _options(s3_endpoint)))
    assert isinstance(landing, S3Landing)
    return landing


@pytest.fixture()
def listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ListObjectsV2 request any landing zone's client sends from now on."""
    sent: list[str] = []
    real = object_store._client

    def counted(location):
        client = real(location)
        client.meta.events.register(
            "before-call.s3.ListObjectsV2",
            lambda **kw: sent.append(str(kw["params"].get("query_string", ""))),
        )
        return client

    monkeypatch.setattr(object_store, "_client", counted)
    return sent


def _land(zone: S3Landing, table: str, hours: range) -> None:
    for h in hours:
        hour = H0 + timedelta(hours=h)
        _put(zone, f"{_folder(table, hour)}/p.parquet", _events(hour, h))


def _record(zone: S3Landing, warehouse, table: str, hours: range) -> None:
    """The applied-files ledger says these hours' files were read (as a run records them)."""
    listed = zone.hour_files(table).files
    keys = [hour_to_partition_key(H0 + timedelta(hours=h)) for h in hours]
    files = [
        applied_files.AppliedFile(hour_to_partition_key(hour), f)
        for hour, fs in listed.items()
        if hour_to_partition_key(hour) in keys
        for f in fs
    ]
    path = applied_files.ledger_path(warehouse, table)
    applied_files.record(path, zone, keys, files, "run-0", datetime.now(UTC))


def _config(tmp_path, zone: S3Landing, s3_endpoint: str, extra: str = "") -> str:
    path = tmp_path / "c.yaml"
    path.write_text(
        f"landing_root: {zone.root}\nwarehouse_root: {tmp_path / 'wh'}\n"
        f"landing_storage_options:\n  aws_access_key_id: {{env: {KEY_ID_ENV}}}\n"
        f"  aws_secret_access_key: {{env: {SECRET_ENV}}}\n  aws_region: us-east-1\n"
        f"  aws_endpoint_url: {s3_endpoint}\n{extra}"
    )
    return str(path)


def _asked(request: dg.RunRequest) -> list[str]:
    return [request.partition_key] if request.partition_key else partitions_of(request.tags)


def test_a_reset_cursor_is_seeded_from_the_one_prefix_listing(zone, tmp_path, listings):
    """720 hours, all applied: the first tick lists the window and the table once (it listed
    two folders an hour: 1,443 requests) and asks for nothing; an hour never applied is
    asked for once."""
    _land(zone, "orders", range(720))
    warehouse = tmp_path / "wh"
    _record(zone, warehouse, "orders", range(719))
    table = sensor_cursor_table()
    lookup = _ledger(warehouse)
    now = H0 + timedelta(hours=800)
    listings.clear()
    requests, state = evaluate(table, zone, now, CursorState(), applied=lookup)
    assert len(listings) == 2  # the window's listing and the table's one prefix listing
    assert [r.partition_keys for r in requests] == [
        (hour_to_partition_key(H0 + timedelta(hours=719)),)
    ]
    assert state.sweep is None and state.pending.keys() == {requests[0].first}


def test_a_long_seed_goes_on_over_ticks_within_the_budget(zone, tmp_path, listings, monkeypatch):
    """Pages of 20 keys and 3 requests a tick: the seeding sweep of 200 hours goes on over
    ticks, never past the budget, and asks for each unapplied hour exactly once."""
    monkeypatch.setattr(object_store, "PAGE_KEYS", 20)
    _land(zone, "orders", range(200))
    warehouse = tmp_path / "wh"
    _record(zone, warehouse, "orders", range(0, 200, 2))  # the even hours applied
    table, lookup = sensor_cursor_table(), _ledger(warehouse)
    now, state, asked, ticks = H0 + timedelta(hours=300), CursorState(), [], 0
    while ticks == 0 or state.sweep is not None:
        listings.clear()
        requests, state = evaluate(
            table, zone, now + timedelta(minutes=ticks), state, applied=lookup, budget=ListBudget(3)
        )
        assert len(listings) <= 1 + 3, listings  # the window's listing, then the budget
        asked += [k for r in requests for k in r.partition_keys]
        ticks += 1
        assert ticks < 20
    assert ticks >= 3
    odd = [hour_to_partition_key(H0 + timedelta(hours=h)) for h in range(1, 200, 2)]
    assert sorted(asked) == sorted(odd)  # each once, none applied, none twice


def test_the_code_locations_sensor_progresses_tick_by_tick(
    zone, tmp_path, s3_endpoint, listings, monkeypatch
):
    """The per-table sensor of the code location, evaluated as the daemon does, with a budget
    smaller than the table: every tick stays within it and saves its progress in its cursor,
    and the ticks together ask for every hour not applied exactly once."""
    monkeypatch.setattr(object_store, "PAGE_KEYS", 20)
    monkeypatch.setattr(sensor_cursor, "LIST_REQUESTS_PER_TICK", 2)
    _land(zone, "orders", range(120))
    _record(zone, tmp_path / "wh", "orders", range(30))
    tables = 'tables: [{name: orders, primary_key: [id], start: "2024-01-01-00:00"}]\n'
    defs = build_definitions(load_config(_config(tmp_path, zone, s3_endpoint, tables)))
    sensor = defs.resolve_sensor_def("orders_landing_sensor")
    asked: list[str] = []
    cursor = None
    with dg.DagsterInstance.ephemeral() as instance:
        for _ in range(12):
            listings.clear()
            context = dg.build_sensor_context(instance=instance, definitions=defs, cursor=cursor)
            data = sensor.evaluate_tick(context)
            # The root's check, the window's listing, then the budget.
            assert len(listings) <= 1 + 1 + 2, listings
            assert data.cursor is not None
            cursor = data.cursor
            asked += [k for r in data.run_requests or [] for k in _asked(r)]
            if CursorState.from_json(cursor).sweep is None:
                break
    expected = [hour_to_partition_key(H0 + timedelta(hours=h)) for h in range(30, 120)]
    assert sorted(asked) == expected


def test_junk_keys_cost_a_bounded_listing_per_tick_and_per_load(
    zone, tmp_path, s3_endpoint, listings, monkeypatch
):
    """An unlisted folder of one zero-byte key per hour, each in a sub-folder (no landing
    file), listed two folders an hour at every new-tables tick and every load. Now: within
    the budget, going on next tick where it stopped; a real new table is still reported."""
    monkeypatch.setattr(object_store, "PAGE_KEYS", 20)
    monkeypatch.setattr(discovery, "UNLISTED_LIST_REQUESTS", 4)
    for h in range(300):
        _put(zone, f"{_folder('junk', H0 + timedelta(hours=h))}/sub/x", b"")
    _land(zone, "orders", range(2))
    _land(zone, "refunds", range(1))
    raw = 'discover: {primary_key: [id], start: "2024-01-01-00:00"}\n'
    platform = load_config(_config(tmp_path, zone, s3_endpoint, raw))
    listings.clear()
    loaded = with_discovered_tables(platform)
    # The root, the budget shared by the three folders, describing the two found (a page each).
    assert len(listings) <= 1 + 4 + 2, listings
    assert [t.name for t in loaded.tables] == ["orders", "refunds"]

    progress: dict[str, str] = {}
    rounds = 0
    while rounds == 0 or progress:
        listings.clear()
        found = unlisted_tables(zone, [], ListBudget(4), progress)
        assert len(listings) <= 1 + 4, listings
        assert found == ["orders", "refunds"]  # the junk folder never hides the others
        rounds += 1
        assert rounds < 40
    assert rounds >= 300 // 20 // 4  # the junk folder was listed over several calls

    defs = build_definitions(platform)
    sensor = defs.resolve_sensor_def("cdc_new_tables")
    with dg.DagsterInstance.ephemeral() as instance:
        listings.clear()
        context = dg.build_sensor_context(
            instance=instance,
            definitions=defs,
            resources={"alert_webhook": AlertWebhookResource(webhook_url="")},
        )
        data = sensor.evaluate_tick(context)
    assert len(listings) <= 1 + 1 + 4 + 2, listings  # exists, root, budget, two described
    assert json.loads(data.cursor or "{}")["scanning"][0][0] == "junk"


def test_a_failing_table_holds_no_other_up_in_the_fleet(
    zone, tmp_path, s3_endpoint, listings, monkeypatch
):
    """Fleet mode: a table whose ledger cannot be read fails its share of every tick, while
    a table too large for one tick's budget goes on tick by tick, each saving its cursor (and
    the fleet's position) as soon as its share is done."""
    monkeypatch.setattr(object_store, "PAGE_KEYS", 20)
    monkeypatch.setattr(sensor_cursor, "LIST_REQUESTS_PER_TICK", 2)
    _land(zone, "big", range(100))
    _land(zone, "small", range(3))
    _land(zone, "broken", range(3))
    ledger = applied_files.ledger_path(tmp_path / "wh", "broken")
    log = Path(ledger.path) / "_delta_log"
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("not a delta log\n")
    tables = ", ".join(
        f'{{name: {n}, primary_key: [id], start: "2024-01-01-00:00"}}'
        for n in ("big", "broken", "small")
    )
    extra = f"landing_sensor: fleet\ntables_per_run: 5\ntables: [{tables}]\n"
    defs = build_definitions(load_config(_config(tmp_path, zone, s3_endpoint, extra)))
    sensor = defs.resolve_sensor_def(FLEET_SENSOR)
    asked: dict[str, list[str]] = {"big": [], "small": [], "broken": []}
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = dg.build_sensor_context(instance=instance, definitions=defs)
        cursor = sensor.evaluate_tick(cursor).cursor  # the epoch
        epoch = FleetCursor.from_json(cursor)
        for _ in range(10):
            listings.clear()
            context = dg.build_sensor_context(instance=instance, definitions=defs, cursor=cursor)
            data = sensor.evaluate_tick(context)
            # The root's check, then each table's window listing and its budget.
            assert len(listings) <= 1 + 3 * (1 + 2), listings
            cursor = data.cursor
            for request in data.run_requests or []:
                for key in request.asset_selection or ():
                    asked[key.to_user_string()] += _asked(request)
            stored = instance.run_storage.get_cursor_values({epoch.key("big")})
            if stored and CursorState.from_json(stored[epoch.key("big")]).sweep is None:
                break
        stored = instance.run_storage.get_cursor_values(
            {epoch.key(n) for n in ("big", "small", "broken")} | {epoch.position_key}
        )
    every = [hour_to_partition_key(H0 + timedelta(hours=h)) for h in range(100)]
    assert sorted(asked["big"]) == every
    assert sorted(asked["small"]) == every[:3]
    assert asked["broken"] == [] and epoch.key("broken") not in stored
    assert epoch.position_key in stored


def sensor_cursor_table():
    from cdc_platform.lib.config import TableConfig

    return TableConfig(name="orders", primary_key=("id",), start=H0)


def _ledger(warehouse):
    path = applied_files.ledger_path(warehouse, "orders")
    return lambda keys: applied_files.applied_by_partition(path, keys)
