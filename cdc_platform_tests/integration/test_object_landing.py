"""A landing zone in an S3 bucket (moto's S3 server): listed by prefix, read pinned by ETag.

The zone's own calls (``lib.landing.where.object_store``) are tested against the server directly:
hostile keys set aside, never a stopped listing; a window listed in one request from its first
key; a read refused when the object was overwritten after the listing, or while it was read;
paths outside the root refused; a store that does not answer failing loud. The landing sensor's
cursor runs on the bucket (new hours, a late file found by the sweep, an overwritten object).
End to end, the demo's three tables (Parquet and encrypted, compressed CSV) landed in a bucket
and materialized through the Dagster CLI equal the same files materialized from a folder, cell
for cell, with a hostile key set aside in the quarantine.
"""

from __future__ import annotations

import io
import os
import shutil
import textwrap
import uuid
from datetime import UTC, datetime, timedelta

import boto3
import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_platform.definitions import build_definitions
from cdc_platform.demo.encrypted import write_encrypted_csv_table
from cdc_platform.demo.generate import generate_landing_zone
from cdc_platform.lib.config import REPO_ROOT, ConfigError, load_config
from cdc_platform.lib.fleet import sensor_cursor
from cdc_platform.lib.fleet.sensor_cursor import CursorState, evaluate
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.decoding.codecs import LandingFileError
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.discovery import (
    describe,
    unlisted_tables,
    with_discovered_tables,
)
from cdc_platform.lib.landing.reading.file_reader import LandingReader
from cdc_platform.lib.landing.where import object_store
from cdc_platform.lib.landing.where.layout import BAD_KEY, IN_SUBFOLDER, hour_to_partition_key
from cdc_platform.lib.landing.where.object_store import S3Landing
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.safe_open import CHANGED, OUTSIDE
from cdc_platform.lib.landing.where.zone import LandingUnavailableError
from cdc_platform.lib.ledgers import applied_files, quarantine
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.operations import unapply as revocation
from cdc_platform.lib.operations.resync import ResyncError, ResyncRequest, resync
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import EnvRef, Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, materialize_with_cli

KEY_ID_ENV, SECRET_ENV = "CDC_TEST_LANDING_KEY_ID", "CDC_TEST_LANDING_SECRET"
KEY_ID, SECRET = "landing-key-id", "landing-secret"
H0 = datetime(2024, 1, 1, tzinfo=UTC)
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("v", pa.string()),
        pa.field("cdc_operation_type", pa.string()),
        pa.field("cdc_change_seq", pa.int64()),
        pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
    ]
)


@pytest.fixture()
def bucket(s3_endpoint: str) -> str:
    name = f"landing-{uuid.uuid4().hex[:12]}"
    _client(s3_endpoint).create_bucket(Bucket=name)
    return name


def _client(endpoint: str):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )


def _options(endpoint: str) -> dict[str, str | EnvRef]:
    return {
        "aws_access_key_id": EnvRef(KEY_ID_ENV),
        "aws_secret_access_key": EnvRef(SECRET_ENV),
        "aws_region": "us-east-1",
        "aws_endpoint_url": endpoint,
    }


@pytest.fixture()
def zone(s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch) -> S3Landing:
    monkeypatch.setenv(KEY_ID_ENV, KEY_ID)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    landing = zone_at(Location.of(f"s3://{bucket}/landing", _options(s3_endpoint)))
    assert isinstance(landing, S3Landing)
    return landing


def _folder(table: str, hour: datetime) -> str:
    return f"{table}/year={hour:%Y}/month={hour:%m}/day={hour:%d}/hour={hour:%H}"


def _put(zone: S3Landing, relative: str, body: bytes) -> None:
    zone.client.put_object(Bucket=zone.bucket, Key=zone.key_of(relative), Body=body)


def _parquet(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), sink)
    return sink.getvalue()


def _events(hour: datetime, *ids: int, v: str = "a") -> bytes:
    ts = hour + timedelta(minutes=1)
    return _parquet([ev("INSERT", i, ts, i, v=v) for i in ids])


# -- listing ---------------------------------------------------------------------------------------


def test_an_hour_lists_its_files_and_sets_aside_hostile_keys(zone):
    folder = _folder("orders", H0 + timedelta(hours=5))
    _put(zone, f"{folder}/part-1.parquet", _events(H0, 1))
    _put(zone, "orders/year=2024/month=1/day=1/hour=5/unpadded.parquet", _events(H0, 2))
    for marker in ("_SUCCESS", ".part-1.crc", "_temporary/0/x"):
        _put(zone, f"{folder}/{marker}", b"")
    hostile = [f"{folder}/../../escape.parquet", f"{folder}//double.parquet", f"{folder}/./dot"]
    for key in hostile:
        _put(zone, key, b"PAR1")
    _put(zone, f"{folder}/sub/deeper.parquet", b"PAR1")
    _put(zone, "orders/year=99999/month=01/day=01/hour=00/odd.parquet", b"x")
    _put(zone, "orders/year=2024/month=13/day=01/hour=00/odd.parquet", b"x")

    files = zone.files_in_hour("orders", H0 + timedelta(hours=5))
    by_name = {zone.relative(f.path): f for f in files}
    readable = sorted(n for n, f in by_name.items() if f.set_aside is None)
    assert readable == [
        f"{folder}/part-1.parquet",
        "orders/year=2024/month=1/day=1/hour=5/unpadded.parquet",
    ]
    assert {n: by_name[n].set_aside for n in hostile} == dict.fromkeys(hostile, BAD_KEY)
    assert by_name[f"{folder}/sub/deeper.parquet"].set_aside == IN_SUBFOLDER
    assert all(f.etag for f in files), "every listed object carries its ETag"
    assert zone.hours("orders") == [H0 + timedelta(hours=5)]
    newest, touched = zone.sweep("orders", H0 + timedelta(hours=6), 0)
    assert list(newest) == [H0 + timedelta(hours=5)]
    assert touched == {H0 + timedelta(hours=5): files}
    assert zone.table_names() == ["orders"]
    # A hostile key cannot be opened even by name: it is outside every hour folder it names.
    with pytest.raises(LandingFileError, match=OUTSIDE):
        zone.open(f"{zone.root}/{hostile[0]}", None)


def test_a_window_is_one_listing_from_its_first_key(zone):
    for h in range(48):
        hour = H0 + timedelta(hours=h)
        _put(zone, f"{_folder('orders', hour)}/part-{h}.parquet", _events(hour, h))
    first, last = H0 + timedelta(hours=40), H0 + timedelta(hours=47)
    before = zone.requests
    window = zone.files_in_hours("orders", first, last)
    assert zone.requests - before == 1
    before = zone.requests
    one_by_one = {h: zone.files_in_hour("orders", h) for h in window}
    assert zone.requests - before == 8 * 2  # each hour's padded and unpadded folder
    assert window == one_by_one
    assert sorted(window) == [first + timedelta(hours=i) for i in range(8)]


def test_a_window_listing_stops_at_its_last_hour_and_agrees_with_each_hour(zone):
    """Junk after the window (a future year, a stray folder) is never listed; a folder spelled
    half padded is no hour's, in the window as in ``files_in_hour``."""
    hour = H0 + timedelta(hours=5)
    _put(zone, f"{_folder('orders', hour)}/p.parquet", _events(hour, 1))
    _put(zone, "orders/year=2024/month=01/day=01/hour=5/mixed-a.parquet", _events(hour, 2))
    _put(zone, "orders/year=2024/month=1/day=01/hour=05/mixed-b.parquet", _events(hour, 3))
    for i in range(1500):  # more than a page: listing them would cost a second request
        _put(zone, f"orders/year=9999/month=01/day=01/hour=00/junk-{i}", b"")
    _put(zone, "orders/zzz/x.parquet", b"")
    _put(zone, f"{_folder('orders', hour)}/", b"")  # a console's folder marker
    before = zone.requests
    window = zone.files_in_hours("orders", H0, hour)
    assert zone.requests - before == 1
    assert window == {hour: zone.files_in_hour("orders", hour)}
    assert [zone.relative(f.path) for f in window[hour]] == [f"{_folder('orders', hour)}/p.parquet"]
    assert f"{_folder('orders', hour)}/" not in zone.table_files("orders")


# -- reading ---------------------------------------------------------------------------------------


def test_a_read_is_pinned_to_the_listed_etag(zone):
    hour = H0 + timedelta(hours=1)
    name = f"{_folder('orders', hour)}/part-1.parquet"
    _put(zone, name, _events(hour, 1, 2))
    (listed,) = zone.files_in_hour("orders", hour)
    with zone.open(listed.path, listed.file_id) as fh:
        assert pq.read_table(fh).num_rows == 2
    _put(zone, name, _events(hour, 1, 2, 3))  # re-delivered in place
    assert zone.changed_since_listed(listed.path, listed.file_id)
    with pytest.raises(LandingFileError, match="changed since it was listed"):
        zone.open(listed.path, listed.file_id)

    reader = LandingReader(_table(), zone)
    reader.expect({listed.path: listed.file_id})
    report = reader.inspect(listed.path)
    assert report.error == CHANGED


def test_an_object_overwritten_while_it_is_read_is_refused(zone, monkeypatch):
    monkeypatch.setattr(object_store, "WHOLE_OBJECT_BYTES", 1024)
    hour = H0 + timedelta(hours=2)
    name = f"{_folder('orders', hour)}/big.bin"
    _put(zone, name, bytes(range(256)) * 64)  # 16 KiB: read in ranged, pinned GETs
    (listed,) = zone.files_in_hour("orders", hour)
    fh = zone.open(listed.path, listed.file_id)
    assert fh.read(1024) == (bytes(range(256)) * 4)
    _put(zone, name, b"\0" * 16384)
    with pytest.raises(LandingFileError, match="changed since it was listed"):
        fh.read()
    with pytest.raises(LandingFileError, match="changed since it was listed"):
        zone.check_unchanged(fh, listed.file_id)


def test_an_archived_object_is_set_aside_and_a_failing_store_fails_the_run(zone, monkeypatch):
    """Glacier: this object cannot be read, whoever asks, so it is set aside with the reason.
    Denied, or a connection dropped while the body streams: the store's failure, so the run
    fails (and is retried) with nothing set aside."""
    from botocore.exceptions import ClientError, ResponseStreamingError

    hour = H0 + timedelta(hours=4)
    name = f"{_folder('orders', hour)}/cold.parquet"
    zone.client.put_object(
        Bucket=zone.bucket, Key=zone.key_of(name), Body=_events(hour, 1), StorageClass="GLACIER"
    )
    (listed,) = zone.files_in_hour("orders", hour)
    reader = LandingReader(_table(), zone)
    reader.expect({listed.path: listed.file_id})
    assert "archived" in (reader.inspect(listed.path).error or "")

    class Dropped:
        def read(self) -> bytes:
            raise ResponseStreamingError(error="connection reset by peer")

    monkeypatch.setattr(zone, "_send", lambda operation, kwargs: {"Body": Dropped()})
    with pytest.raises(LandingUnavailableError, match="ResponseStreamingError"):
        reader.inspect(listed.path)

    def denied(operation, kwargs):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, operation)

    monkeypatch.setattr(zone, "_send", denied)
    with pytest.raises(LandingUnavailableError, match="AccessDenied"):
        reader.inspect(listed.path)

    def bad_request(operation, kwargs):  # S3's generic 400: the deployment's, not the file's
        raise ClientError({"Error": {"Code": "InvalidRequest", "Message": "bad sig"}}, operation)

    monkeypatch.setattr(zone, "_send", bad_request)
    with pytest.raises(LandingUnavailableError, match="InvalidRequest"):
        reader.inspect(listed.path)


def test_paths_outside_the_root_are_refused(zone, bucket):
    good = f"{zone.root}/orders/year=2024/month=01/day=01/hour=00/x.parquet"
    _put(zone, "orders/year=2024/month=01/day=01/hour=00/x.parquet", b"PAR1")
    for path in (
        "s3://other-bucket/landing/orders/x.parquet",
        f"s3://{bucket}/landing-evil/orders/x.parquet",
        f"s3://{bucket}/orders/x.parquet",
        f"{zone.root}/orders/../../secret",
        f"{zone.root}//orders/x.parquet",
        "/etc/passwd",
    ):
        with pytest.raises(LandingFileError, match=OUTSIDE):
            zone.open(path, None)
    with zone.open(good, None) as fh:
        assert fh.read() == b"PAR1"


def test_a_store_that_does_not_answer_fails_loud(monkeypatch):
    monkeypatch.setenv(KEY_ID_ENV, KEY_ID)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    dead = zone_at(Location.of("s3://b/landing", _options("http://127.0.0.1:9")))
    assert not dead.exists()
    with pytest.raises(LandingUnavailableError, match="s3://b/landing"):
        dead.files_in_hour("orders", H0)
    reader = LandingReader(_table(), dead)
    with pytest.raises(LandingUnavailableError):  # never a file set aside for an outage
        reader.inspect("s3://b/landing/orders/year=2024/month=01/day=01/hour=00/x.parquet")


# -- the landing sensor's cursor ---------------------------------------------------------------


def test_the_sensor_finds_new_late_and_overwritten_objects(zone, monkeypatch):
    table = _table(lookback_hours=3, full_sweep_minutes=60)
    now = H0 + timedelta(hours=30, minutes=10)
    for h in (1, 2, 28):
        hour = H0 + timedelta(hours=h)
        _put(zone, f"{_folder('orders', hour)}/p.parquet", _events(hour, h))
    requests, state = evaluate(table, zone, now, CursorState())
    assert _keys(requests) == {_key(1), _key(2), _key(28)}

    now += timedelta(minutes=5)  # a new hour, an object overwritten in the window
    _put(zone, f"{_folder('orders', H0 + timedelta(hours=29))}/p.parquet", _events(H0, 29))
    _put(zone, f"{_folder('orders', H0 + timedelta(hours=28))}/p.parquet", _events(H0, 280))
    before = zone.requests
    requests, state = evaluate(table, zone, now, state)
    assert _keys(requests) == {_key(28), _key(29)}
    assert zone.requests - before == 1, "a tick without a sweep is one listing"

    # A late file in an old hour, found by the next sweep (the mark allows for clock skew).
    _put(zone, f"{_folder('orders', H0 + timedelta(hours=1))}/late.parquet", _events(H0, 100))
    requests, state = evaluate(table, zone, now + timedelta(minutes=5), state)
    assert requests == []
    requests, state = evaluate(table, zone, now + timedelta(hours=1, minutes=1), state)
    assert _keys(requests) == {_key(1)}
    assert {r.reason for r in requests} == {sensor_cursor.REASON_LATE_FILES}
    assert len(state.to_json()) < 2000


def test_unapply_names_bucket_files_by_key_and_uri(zone):
    hour = H0 + timedelta(hours=3)
    _put(zone, f"{_folder('orders', hour)}/a.parquet", _events(hour, 1))
    _put(zone, f"{_folder('orders', hour)}/b.parquet", _events(hour, 2))
    files = revocation._landing_files(zone, "orders")
    name = f"{_folder('orders', hour)}/a.parquet"
    assert revocation.match([name], files, "orders", zone) == [name]
    assert revocation.match([f"{zone.root}/{name}"], files, "orders", zone) == [name]
    assert len(revocation.match(["orders/year=2024/*/*/*/*.parquet"], files, "orders", zone)) == 2
    with pytest.raises(revocation.NoMatchingFileError):
        revocation.match([f"s3://elsewhere/{name}"], files, "orders", zone)


def test_the_dagster_landing_sensor_and_discovery_run_on_a_bucket(zone, s3_endpoint, tmp_path):
    """The code location's own sensor, evaluated as the daemon does, requests the hours landed
    in the bucket; a table folder the config does not list is discovered and described."""
    for h in (3, 4, 5):
        hour = H0 + timedelta(hours=h)
        _put(zone, f"{_folder('orders', hour)}/p.parquet", _events(hour, h))
    _put(zone, f"{_folder('refunds', H0)}/r.parquet", _events(H0, 1))
    _put(zone, "orders/../escape/year=2024/month=01/day=01/hour=00/x.parquet", b"PAR1")
    config = tmp_path / "c.yaml"
    config.write_text(
        f"landing_root: {zone.root}\nwarehouse_root: {tmp_path / 'wh'}\n"
        f"landing_storage_options:\n  aws_access_key_id: {{env: {KEY_ID_ENV}}}\n"
        f"  aws_secret_access_key: {{env: {SECRET_ENV}}}\n  aws_region: us-east-1\n"
        f"  aws_endpoint_url: {s3_endpoint}\n"
        'tables: [{name: orders, primary_key: [id], start: "2024-01-01-00:00"}]\n'
    )
    platform = load_config(config)
    defs = build_definitions(platform)
    sensor = defs.resolve_sensor_def("orders_landing_sensor")
    with dg.DagsterInstance.ephemeral() as instance:
        context = dg.build_sensor_context(instance=instance, definitions=defs)
        data = sensor.evaluate_tick(context)
    assert [r.partition_key_range for r in data.run_requests or []] == [
        dg.PartitionKeyRange(_key(3), _key(5))
    ]
    assert unlisted_tables(platform.landing_root, ["orders"]) == ["refunds"]
    found = describe(platform.landing_root, "refunds")
    assert [c for c, _ in found.columns][:2] == ["id", "v"]
    assert found.sample_file == f"{zone.root}/{_folder('refunds', H0)}/r.parquet"


def test_a_resync_snapshot_and_the_cdc_it_replaces_both_on_the_bucket(spark, zone, tmp_path):
    """A re-sync from an ``s3://`` snapshot under ``snapshot_roots``: its rows become events
    named by their URIs, an absent key is closed; a snapshot elsewhere is refused."""
    table = _table()
    warehouse = tmp_path / "wh"
    hour = H0 + timedelta(hours=1)
    _put(zone, f"{_folder('orders', hour)}/p.parquet", _events(hour, 1, 2))
    materialize(spark, table, zone, warehouse, [hour])
    bucket_root = zone.root.rsplit("/", 1)[0]
    snapshots = Location(f"{bucket_root}/snapshots", zone.location.options)
    at = H0 + timedelta(hours=3)
    snap = _parquet([ev("INSERT", None, None, 1, v="resynced")])
    zone.client.put_object(Bucket=zone.bucket, Key="snapshots/orders/part-0.parquet", Body=snap)
    zone.client.put_object(Bucket=zone.bucket, Key="snapshots/orders/_SUCCESS", Body=b"")
    zone.client.put_object(Bucket=zone.bucket, Key="snapshots/orders/", Body=b"")  # a marker
    result = resync(
        HistoryTable(spark, table, warehouse, zone.location),
        ResyncRequest(f"{snapshots.uri}/orders", (snapshots,), at),
    )
    assert (result.files, result.rows, result.keys_closed) == (1, 1, 1)
    rows = history_rows(TablePaths.of(warehouse, "orders").history)
    assert [(r["id"], r["v"], r["_fivetran_active"]) for r in rows] == [
        (1, "a", False),
        (1, "resynced", True),
        (2, "a", False),
    ]
    log = delta.read_arrow(TablePaths.of(warehouse, "orders").changelog).to_pylist()
    assert f"{snapshots.uri}/orders/part-0.parquet" in {e["_cdc_source_file"] for e in log}
    for elsewhere in ("s3://other-bucket/snapshots/orders", f"{zone.root}/orders"):
        with pytest.raises(ResyncError):
            resync(
                HistoryTable(spark, table, warehouse, zone.location),
                ResyncRequest(elsewhere, (snapshots,), at),
            )


def test_unapply_and_readmit_a_bucket_file(spark, zone, tmp_path):
    """A file on the bucket un-applied by its URI leaves the history; re-admitted, its hour is
    read from the bucket again and the history is what it was."""
    table = _table()
    warehouse = tmp_path / "wh"
    hour = H0 + timedelta(hours=2)
    _put(zone, f"{_folder('orders', hour)}/a.parquet", _events(hour, 1))
    _put(zone, f"{_folder('orders', hour)}/b.parquet", _events(hour, 2))
    materialize(spark, table, zone, warehouse, [hour])
    history = TablePaths.of(warehouse, "orders").history
    before = history_rows(history)
    uri = f"{zone.root}/{_folder('orders', hour)}/b.parquet"
    out = revocation.unapply(
        HistoryTable(spark, table, warehouse, zone),
        revocation.UnapplyRequest((uri,), "bad export", "run-1"),
    )
    assert out.files == (f"{_folder('orders', hour)}/b.parquet",)
    assert [r["id"] for r in history_rows(history)] == [1]
    materialize(spark, table, zone, warehouse, [hour])  # the sensor's next run skips it
    assert [r["id"] for r in history_rows(history)] == [1]
    back = revocation.readmit(
        HistoryTable(spark, table, warehouse, zone), revocation.ReadmitRequest((uri,))
    )
    assert back.hours == (hour,)
    assert history_rows(history) == before


def test_a_load_during_an_outage_keeps_the_tables_discovered_before(tmp_path, monkeypatch):
    """The code location loads while the bucket does not answer: a table the ``discover:``
    template found before (its change log is in the warehouse) keeps its asset."""
    from deltalake import write_deltalake

    monkeypatch.setenv(KEY_ID_ENV, KEY_ID)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    warehouse = tmp_path / "wh"
    log = TablePaths.of(warehouse, "refunds").changelog
    write_deltalake(log.uri, pa.table({"id": [1]}))
    config = tmp_path / "c.yaml"
    config.write_text(
        f"landing_root: s3://gone/landing\nwarehouse_root: {warehouse}\n"
        "landing_storage_options: {aws_endpoint_url: 'http://127.0.0.1:9', aws_region: us-east-1}\n"
        'discover: {primary_key: [id], start: "2024-01-01-00:00"}\n'
    )
    platform = load_config(config)
    assert [t.name for t in with_discovered_tables(platform).tables] == ["refunds"]


# -- config ----------------------------------------------------------------------------------------


def test_an_s3_landing_root_parses_with_its_options(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    tables = '[{name: orders, primary_key: [id], start: "2024-01-01-00:00"}]'
    options = (
        "landing_storage_options:\n  aws_access_key_id: {env: K}\n"
        "  aws_secret_access_key: {env: S}\n  aws_endpoint_url: http://127.0.0.1:9000\n"
    )
    path.write_text(
        f"landing_root: s3a://bucket/landing/\nwarehouse_root: wh\n{options}tables: {tables}\n"
    )
    platform = load_config(path)
    assert isinstance(platform.landing_root, Location)
    assert platform.landing_root.uri == "s3://bucket/landing"
    assert platform.landing_root.options["aws_access_key_id"] == EnvRef("K")
    assert "S" not in repr(platform)
    for root, extra, why in (
        ("s3://bucket/a/../b", "", "'..'"),
        ("s3://AKIAKEY:s3cr3t-value@bucket/l", "", "no credentials"),
        ("landing", options, "not a local folder"),
        ("s3://bucket/wh", "", "overlap"),
    ):
        warehouse = "s3://bucket/wh/inner" if why == "overlap" else "wh"
        path.write_text(
            f"landing_root: {root}\nwarehouse_root: {warehouse}\n{extra}tables: {tables}\n"
        )
        with pytest.raises(ConfigError, match=why) as refused:
            load_config(path)
        assert "s3cr3t-value" not in str(refused.value)
    path.write_text(
        f"landing_root: s3://bucket/l\nwarehouse_root: wh\nlanding_storage_options:\n"
        f"  aws_secret_access_key: plain-secret\ntables: {tables}\n"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "plain-secret" not in str(refused.value)


# -- end to end ------------------------------------------------------------------------------------

DEMO_HOURS = 4


def test_the_demo_landed_in_a_bucket_equals_the_demo_on_disk(spark, zone, s3_endpoint, tmp_path):
    """customers and orders (Parquet) and payments (CSV, ZSTD, AES) landed in the bucket and
    materialized with ``dagster asset materialize`` give the tables, cell for cell, that the
    same files give from a folder; a hostile key is set aside, nothing else."""
    disk = tmp_path / "disk"
    keyring_path = tmp_path / "keyring.json"
    config_text = (REPO_ROOT / "cdc_platform.yaml").read_text()
    local_config = tmp_path / "local.yaml"
    local_config.write_text(
        config_text.replace("landing_root: data/landing", f"landing_root: {disk}").replace(
            "warehouse_root: data/warehouse", f"warehouse_root: {tmp_path / 'wh_disk'}"
        )
    )
    local = load_config(local_config)
    generate_landing_zone(disk, hours=DEMO_HOURS)
    write_encrypted_csv_table(disk, keyring_path, local.table("payments"), hours=DEMO_HOURS)
    for path in sorted(disk.rglob("*")):
        if path.is_file():
            _put(zone, path.relative_to(disk).as_posix(), path.read_bytes())
    hostile = "orders/year=2024/month=01/day=01/hour=01/../../../payments/x.parquet"
    _put(zone, hostile, b"PAR1")

    bucket_config = tmp_path / "bucket.yaml"
    options = textwrap.indent(
        f"aws_access_key_id: {{env: {KEY_ID_ENV}}}\naws_secret_access_key: {{env: {SECRET_ENV}}}"
        f"\naws_region: us-east-1\naws_endpoint_url: {s3_endpoint}\n",
        "  ",
    )
    bucket_config.write_text(
        config_text.replace(
            "landing_root: data/landing",
            f"landing_root: {zone.root}\nlanding_storage_options:\n{options}",
        ).replace("warehouse_root: data/warehouse", f"warehouse_root: {tmp_path / 'wh_s3'}")
    )
    on_bucket = load_config(bucket_config)
    hours = sorted({h for t in local.tables for h in zone_at(disk).hours(t.name)})
    assert sorted({h for t in on_bucket.tables for h in zone.hours(t.name)}) == hours

    keyring = Keyring.from_file(keyring_path)
    for table in local.tables:
        materialize(spark, table, local.landing_root, local.warehouse_root, hours, keyring)

    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {
        "CDC_PLATFORM_CONFIG": str(bucket_config),
        "CDC_KEYRING": str(keyring_path),
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
        KEY_ID_ENV: KEY_ID,
        SECRET_ENV: SECRET,
    }
    first, last = hour_to_partition_key(hours[0]), hour_to_partition_key(hours[-1])
    tables = ",".join(t.name for t in on_bucket.tables)
    proc = materialize_with_cli(tables, f"{first}...{last}", env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert SECRET not in proc.stdout + proc.stderr

    for table in local.tables:
        from_disk = history_rows(TablePaths.of(local.warehouse_root, table.name).history)
        from_bucket = history_rows(TablePaths.of(on_bucket.warehouse_root, table.name).history)
        assert from_disk, table.name
        assert from_bucket == from_disk, table.name
    ledger = applied_files.ledger_path(on_bucket.warehouse_root, "payments")
    recorded = Ledger(ledger, applied_files.SCHEMA).rows()
    listed = {
        zone.relative(f.path): f.etag for h in hours for f in zone.files_in_hour("payments", h)
    }
    assert {r["file"]: r["etag"] for r in recorded} == listed  # the version each was read as
    set_aside = quarantine.current(TablePaths.of(on_bucket.warehouse_root, "orders").quarantine)
    assert [(q.file, q.reason) for q in set_aside] == [(hostile, BAD_KEY)]
    for table in ("customers", "payments"):
        assert quarantine.current(TablePaths.of(on_bucket.warehouse_root, table).quarantine) == []


def _table(**extra):
    from cdc_platform.lib.config import TableConfig

    return TableConfig(name="orders", primary_key=("id",), start=H0, **extra)


def _key(h: int) -> str:
    return hour_to_partition_key(H0 + timedelta(hours=h))


def _keys(requests) -> set[str]:
    return {k for r in requests for k in r.partition_keys}


def test_a_snapshot_key_that_cannot_be_named_refuses_the_whole_resync(spark, zone, tmp_path):
    """A snapshot key with a ``..`` segment cannot be read safely, and skipping it would close
    its keys: the re-sync is refused, naming it, and the history keeps its live keys."""
    table = _table()
    warehouse = tmp_path / "wh"
    hour = H0 + timedelta(hours=1)
    _put(zone, f"{_folder('orders', hour)}/p.parquet", _events(hour, 1, 2))
    materialize(spark, table, zone, warehouse, [hour])
    bucket_root = zone.root.rsplit("/", 1)[0]
    snapshots = Location(f"{bucket_root}/snapshots", zone.location.options)
    snap = _parquet([ev("INSERT", None, None, 1, v="resynced")])
    zone.client.put_object(Bucket=zone.bucket, Key="snapshots/orders/part-0.parquet", Body=snap)
    zone.client.put_object(
        Bucket=zone.bucket, Key="snapshots/orders/x/../part-1.parquet", Body=snap
    )
    with pytest.raises(ResyncError, match=r"x/\.\./part-1\.parquet: the object's key has"):
        resync(
            HistoryTable(spark, table, warehouse, zone.location),
            ResyncRequest(f"{snapshots.uri}/orders", (snapshots,), H0 + timedelta(hours=3)),
        )
    rows = history_rows(TablePaths.of(warehouse, "orders").history)
    assert [(r["id"], r["_fivetran_active"]) for r in rows] == [(1, True), (2, True)]
