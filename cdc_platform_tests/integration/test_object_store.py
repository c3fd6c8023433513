"""A warehouse on S3: the platform's delta-rs code paths against a local S3-compatible server.

moto's S3 server stands in for S3. Everything the driver does with delta-rs runs against it
through the platform's own functions, with storage options parsed from a config (secrets as
``{env: NAME}``): creating a table, the driver's half of a Spark write (listing the files a
writer left, reading their footers, renaming, deleting junk), the atomic commit with its app
transaction, a stale writer refused, snapshot listings, reads, the applied-files and quarantine
tables, VACUUM and the metadata-only commits of compaction. In those tests the Parquet files
stand in for what Spark writes; they are uploaded with pyarrow's own S3 client.

Spark itself on ``s3a://`` (hadoop-aws and the AWS SDK, fetched by ``make jars``) runs end to
end in ``test_spark_on_s3_through_the_dagster_asset``: the asset and its checks materialize two
hours into the bucket in a process of their own (a fresh JVM: the S3 connector and its settings
are fixed when Spark starts), and delta-rs reads the result back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from deltalake.exceptions import CommitFailedError

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.resources import SparkResource
from cdc_platform.lib.config import ConfigError, PlatformConfig, load_config
from cdc_platform.lib.history import changelog, merge
from cdc_platform.lib.landing.where.layout import LandingFile
from cdc_platform.lib.ledgers import applied_files, quarantine
from cdc_platform.lib.operations import maintenance
from cdc_platform.lib.spark.session import spark_conf
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import (
    EnvRef,
    Location,
    StorageOptionError,
    hadoop_conf,
)
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

KEY_ID_ENV, SECRET_ENV = "CDC_TEST_S3_KEY_ID", "CDC_TEST_S3_SECRET"
KEY_ID, SECRET = "test-key-id", "test-secret-value"
SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])
TABLE = '{name: orders, primary_key: [id], start: "2024-01-01-00:00"}'


@pytest.fixture()
def bucket(s3_endpoint: str) -> str:
    name = f"cdc-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name


def _config_text(warehouse_root: str, options: str, landing_root: str = "landing") -> str:
    """A config file with one table; ``options`` is the YAML of ``warehouse_storage_options``."""
    indented = textwrap.indent(textwrap.dedent(options).strip() + "\n", "  ")
    return (
        f"landing_root: {landing_root}\nwarehouse_root: {warehouse_root}\n"
        f"warehouse_storage_options:\n{indented}tables:\n  - {TABLE}\n"
    )


@pytest.fixture()
def platform(
    s3_endpoint: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> PlatformConfig:
    """A config with its warehouse in the bucket; the keys come from the environment."""
    monkeypatch.setenv(KEY_ID_ENV, KEY_ID)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    options = f"""\
        aws_access_key_id: {{env: {KEY_ID_ENV}}}
        aws_secret_access_key: {{env: {SECRET_ENV}}}
        aws_region: us-east-1
        aws_endpoint_url: {s3_endpoint}
        aws_allow_http: true
        """
    path = tmp_path / "cdc_platform.yaml"
    path.write_text(_config_text(f"s3://{bucket}/warehouse", options))
    return load_config(path)


@pytest.fixture()
def s3(s3_endpoint: str) -> pafs.S3FileSystem:
    """pyarrow's own S3 client: what stands in for Spark's writes, and checks what is stored."""
    return pafs.S3FileSystem(
        access_key=KEY_ID,
        secret_key=SECRET,
        endpoint_override=s3_endpoint,
        scheme="http",
        region="us-east-1",
    )


def _key(location: Location, relative: str = "") -> str:
    """``bucket/prefix[/relative]``: how pyarrow's S3 file system names an object."""
    key = location.uri.removeprefix("s3://")
    return f"{key}/{relative}" if relative else key


def _upload(s3: pafs.S3FileSystem, table: Location, relative: str, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), _key(table, relative), filesystem=s3)


def _stored(s3: pafs.S3FileSystem, table: Location, under: str = "data") -> set[str]:
    """The objects below ``table/under``, table-relative."""
    selector = pafs.FileSelector(_key(table, under), recursive=True, allow_not_found=True)
    prefix = _key(table) + "/"
    return {
        i.path.removeprefix(prefix)
        for i in s3.get_file_info(selector)
        if i.type == pafs.FileType.File
    }


def _log_entry(s3: pafs.S3FileSystem, table: Location, version: int) -> list[dict]:
    with s3.open_input_stream(_key(table, f"_delta_log/{version:020d}.json")) as fh:
        return [json.loads(line) for line in fh.read().decode().splitlines()]


def _write(s3: pafs.S3FileSystem, table: Location, folder: str, rows: list[dict]) -> list:
    """What ``delta.write_files`` does, with pyarrow writing instead of Spark."""
    _upload(s3, table, f"{delta.DATA_DIR}/{folder}/part-00000.snappy.parquet", rows)
    return delta.adds_for_written(table, f"{delta.DATA_DIR}/{folder}")


# -- the commit path of lib/storage/delta.py ---------------------------------------------------------------


def test_a_writers_files_are_collected_and_committed_atomically(platform, s3):
    table = TablePaths.of(platform.warehouse_root, "orders").history
    assert table.uri.startswith("s3://") and not delta.exists(table)
    dt = delta.ensure_table(table, SCHEMA, description="orders on S3")
    assert delta.exists(table) and dt.version() == 0

    # What Spark leaves: a Hive-style segment folder, a checksum beside a file, an empty file.
    _upload(s3, table, "data/w1/seg=live/part-00000.snappy.parquet", [{"id": 1, "v": "a"}])
    _upload(s3, table, "data/w1/seg=live/part-00001.snappy.parquet", [])
    s3.open_output_stream(_key(table, "data/w1/seg=live/.part-00000.snappy.parquet.crc")).close()
    first = delta.adds_for_written(table, "data/w1")
    assert [a.path for a in first] == ["data/w1/live/part-00000.snappy.parquet"]
    assert _stored(s3, table) == {"data/w1/live/part-00000.snappy.parquet"}
    assert json.loads(first[0].stats) == {
        "numRecords": 1,
        "minValues": {"id": 1, "v": "a"},
        "maxValues": {"id": 1, "v": "a"},
        "nullCount": {"id": 0, "v": 0},
    }
    assert delta.commit(dt, first, [], SCHEMA, app_transaction=("test/app", 1), strict=True) == 1

    # One commit replaces the file and records the input it reflects.
    second = _write(s3, table, "w2", [{"id": 2, "v": "b"}, {"id": 3, "v": "c"}])
    removes = delta.removes_for(delta.snapshot_files(dt))
    version = delta.commit(
        dt, second, removes, SCHEMA, app_transaction=("test/app", 2), strict=True
    )
    assert version == 2
    actions = {next(iter(a)) for a in _log_entry(s3, table, 2)}
    assert {"add", "remove", "txn"} <= actions

    now = delta.open_table(table)
    assert now.transaction_version("test/app") == 2
    assert [f.path for f in delta.snapshot_files(now)] == [second[0].path]
    assert [f.num_records for f in delta.snapshot_files(now)] == [2]
    assert delta.read_arrow(table).sort_by("id").to_pylist() == [
        {"id": 2, "v": "b"},
        {"id": 3, "v": "c"},
    ]
    assert delta.read_arrow(table, columns=["v"]).schema == pa.schema([SCHEMA.field("v")])
    old = delta.open_table(table, version=1)
    assert [f.path for f in delta.snapshot_files(old)] == [first[0].path]
    # What a reader of the watermark sees pending: after input 1, the second write; after 2, none.
    log = Table.open(table)
    assert [f.path for f in changelog.files_since(log, 1)] == [second[0].path]
    assert changelog.files_since(log, 2) == []
    # The file Spark would read, under Hadoop's name for S3.
    assert delta.absolute_paths(table, [second[0].path]) == [
        f"s3a://{_key(table)}/{second[0].path}"
    ]


def test_a_stale_writer_is_refused_and_a_retry_commits(platform, s3):
    """Two writers from one snapshot: the strict commit of the second fails (no lock option is
    set: delta-rs commits with S3's put-if-absent) and recomputing from the new version works."""
    table = TablePaths.of(platform.warehouse_root, "orders").history
    delta.ensure_table(table, SCHEMA)
    first, late = delta.open_table(table), delta.open_table(table)
    delta.commit(first, _write(s3, table, "a", [{"id": 1, "v": "a"}]), [], SCHEMA, strict=True)
    stale = _write(s3, table, "b", [{"id": 2, "v": "b"}])
    with pytest.raises(CommitFailedError):
        delta.commit(late, stale, [], SCHEMA, strict=True)
    delta.discard(table, stale)
    assert _stored(s3, table) == {"data/a/part-00000.snappy.parquet"}

    def attempt() -> int:
        return delta.commit(
            delta.open_table(table),
            _write(s3, table, "c", [{"id": 2, "v": "b"}]),
            [],
            SCHEMA,
            strict=True,
        )

    assert delta.with_commit_retries(attempt, "test") == (2, 1)
    assert sorted(delta.read_arrow(table)["id"].to_pylist()) == [1, 2]


def test_a_new_column_is_added_to_the_table_on_s3(platform, s3):
    table = TablePaths.of(platform.warehouse_root, "orders").history
    dt = delta.ensure_table(table, SCHEMA)
    delta.commit(dt, _write(s3, table, "a", [{"id": 1, "v": "a"}]), [], SCHEMA)
    wider = SCHEMA.append(pa.field("extra", pa.float64()))
    dt = delta.ensure_table(table, wider)
    assert delta.table_arrow_schema(dt).names == ["id", "v", "extra"]
    assert delta.read_arrow(table).to_pylist() == [{"id": 1, "v": "a", "extra": None}]


# -- the platform's small tables -------------------------------------------------------------------


def test_applied_files_ledger_on_s3(platform, tmp_path):
    ledger = applied_files.ledger_path(platform.warehouse_root, "orders")
    assert ledger.uri.endswith("/warehouse/_cdc/orders/applied_files")
    landing = tmp_path / "landing"
    at = datetime(2024, 1, 1, 6, tzinfo=UTC)

    def landed(name: str, size: int) -> applied_files.AppliedFile:
        path = landing / "orders" / "year=2024" / name
        return applied_files.AppliedFile("2024-01-01-05:00", LandingFile(str(path), size, 7))

    assert applied_files.applied(ledger) == set()
    applied_files.record(ledger, landing, ["2024-01-01-05:00"], [landed("a", 10)], "run-1", at)
    assert applied_files.applied(ledger) == {("orders/year=2024/a", 10, 7)}
    # A later run of the same hour replaces its rows.
    files = [landed("a", 11), landed("b", 5)]
    applied_files.record(ledger, landing, ["2024-01-01-05:00"], files, "run-2", at)
    assert applied_files.applied(ledger) == {
        ("orders/year=2024/a", 11, 7),
        ("orders/year=2024/b", 5, 7),
    }


def test_quarantine_on_s3(platform):
    path = TablePaths.of(platform.warehouse_root, "orders").quarantine
    at = datetime(2024, 1, 1, 6, tzinfo=UTC)
    bad = quarantine.QuarantinedFile("orders/h/x.parquet", "2024-01-01-05:00", "bad", 3, 1, at)
    quarantine.record(path, [bad.file, "orders/h/y.parquet"], [bad], ["2024-01-01-05:00"])
    assert quarantine.current(path) == [bad]
    # The file was fixed and read again: it leaves the quarantine.
    quarantine.record(path, [bad.file], [], ["2024-01-01-05:00"])
    assert quarantine.current(path) == []
    assert delta.open_table(path).version() == 1


# -- maintenance: VACUUM and compaction's metadata commits -----------------------------------------


def test_vacuum_on_s3_removes_replaced_and_never_committed_files(platform, s3):
    paths = TablePaths.of(platform.warehouse_root, "orders")
    table = paths.history
    dt = delta.ensure_table(table, SCHEMA)
    replaced = _write(s3, table, "w1", [{"id": 1, "v": "a"}])
    delta.commit(dt, replaced, [], SCHEMA)
    kept = _write(s3, table, "w2", [{"id": 1, "v": "b"}])
    delta.commit(dt, kept, delta.removes_for(delta.snapshot_files(dt)), SCHEMA)
    crashed = _crashed_write(s3, table, "w3")
    everything = _stored(s3, table)

    assert maintenance.vacuum(paths, retention_hours=1, enforce_retention_duration=False) == []
    dry = maintenance.vacuum(
        paths, retention_hours=0, dry_run=True, enforce_retention_duration=False
    )
    assert {str(table / replaced[0].path), str(table / crashed)} <= set(dry)
    assert _stored(s3, table) == everything

    removed = maintenance.vacuum(paths, retention_hours=0, enforce_retention_duration=False)
    assert {str(table / replaced[0].path), str(table / crashed)} <= set(removed)
    assert _stored(s3, table) == {kept[0].path}
    assert delta.read_arrow(table).to_pylist() == [{"id": 1, "v": "b"}]


def _crashed_write(s3: pafs.S3FileSystem, table: Location, folder: str) -> str:
    """What a run that died before its commit leaves: a data file, Spark's checksum beside it
    and a half-written ``_temporary/``; returns the data file's table-relative path."""
    data = f"data/{folder}/part-00000.snappy.parquet"
    _upload(s3, table, data, [{"id": 9, "v": "z"}])
    s3.open_output_stream(_key(table, f"data/{folder}/.part-00000.snappy.parquet.crc")).close()
    _upload(s3, table, f"data/{folder}/_temporary/0/part-00001.parquet", [{"id": 8, "v": "y"}])
    return data


def test_write_folders_left_without_data_are_removed_on_s3(platform, s3):
    """delta-rs (1.6) already deletes hidden and ``_`` files on S3, so VACUUM's own step for
    them finds nothing there; this checks that step on an object store directly."""
    table = TablePaths.of(platform.warehouse_root, "orders").history
    delta.ensure_table(table, SCHEMA)
    _crashed_write(s3, table, "dead")
    s3.delete_file(_key(table, "data/dead/part-00000.snappy.parquet"))  # VACUUM's first step
    _crashed_write(s3, table, "live")  # a data file: never removed by this step
    assert maintenance._stale_write_folders(table, 1, dry_run=False) == []  # too young
    assert maintenance._stale_write_folders(table, 0, dry_run=False) == [str(table / "data/dead")]
    assert not any(p.startswith("data/dead/") for p in _stored(s3, table))
    assert len([p for p in _stored(s3, table) if p.startswith("data/live/")]) == 3


def test_compaction_commits_on_s3_change_no_row_and_move_the_watermarks(platform, s3):
    paths = TablePaths.of(platform.warehouse_root, "orders")
    table = paths.history
    dt = delta.ensure_table(table, SCHEMA)
    small = [_write(s3, table, f"w{i}", [{"id": i, "v": "x"}])[0] for i in range(3)]
    delta.commit(dt, small, [], SCHEMA)
    # The rewrite: one file holding the same rows, every action marked dataChange=false.
    _upload(s3, table, "data/c/part-00000.snappy.parquet", [{"id": i, "v": "x"} for i in range(3)])
    compacted = delta.adds_for_written(table, "data/c", data_change=False)
    removes = delta.removes_for(delta.snapshot_files(dt), data_change=False)
    meta = {"cdc_platform.operation": "compact"}
    assert delta.commit(dt, compacted, removes, SCHEMA, metadata=meta, strict=True) == 2
    entry = _log_entry(s3, table, 2)
    changes = [a[k] for a in entry for k in ("add", "remove") if k in a]
    assert len(changes) == 4 and not any(c["dataChange"] for c in changes)
    assert next(a["commitInfo"] for a in entry if "commitInfo" in a)["cdc_platform.operation"] == (
        "compact"
    )
    assert sorted(delta.read_arrow(table)["id"].to_pylist()) == [0, 1, 2]

    # The delete-only keys' watermark moves with the change log's compacted version...
    side = delta.ensure_table(paths.delete_only_keys, pa.schema([pa.field("id", pa.int64())]))
    delta.commit(side, [], [], delta.table_arrow_schema(side), app_transaction=(merge.APP_ID, 3))
    merge.stamp_delete_only_keys(Table.open(paths.delete_only_keys), 5, previous=3)
    assert delta.open_table(paths.delete_only_keys).transaction_version(merge.APP_ID) == 5
    # ...unless it was stale (a crash between two commits): then it is left for the next run.
    merge.stamp_delete_only_keys(Table.open(paths.delete_only_keys), 7, previous=3)
    assert delta.open_table(paths.delete_only_keys).transaction_version(merge.APP_ID) == 5


# -- the config ------------------------------------------------------------------------------------


# -- Spark on s3a://, end to end -------------------------------------------------------------------

_MATERIALIZE_TWO_HOURS = """
import json, sys
import dagster as dg
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import load_config
from cdc_platform_tests.helpers import dagster_resources

platform = load_config(sys.argv[1])
defs = build_table_definitions(platform, platform.tables[0])
out = []
for key in ("2024-01-01-00:00", "2024-01-01-01:00"):
    result = dg.materialize(
        [defs.asset, defs.checks], partition_key=key, resources=dagster_resources(),
        raise_on_error=False,
    )
    checks = {str(c.check_name): c.passed for c in result.get_asset_check_evaluations()}
    out.append({"success": result.success, "checks": checks})
print("RESULT " + json.dumps(out))
"""


def test_spark_on_s3_through_the_dagster_asset(platform, tmp_path):
    """Spark reads the history and change log from, and writes its files to, ``s3a://``; the
    checks read them too; delta-rs commits; the table in the bucket is the contract's."""
    h0, h1 = datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 1, 1, 1, tzinfo=UTC)
    landing = tmp_path / "landing"
    write_parquet_events(
        landing,
        "orders",
        h0,
        [
            ev("INSERT", 1, h0 + timedelta(minutes=1), 1, v="a"),
            ev("INSERT", 2, h0 + timedelta(minutes=2), 2, v="b"),
        ],
    )
    write_parquet_events(
        landing,
        "orders",
        h1,
        [
            ev("UPDATE", 3, h1 + timedelta(minutes=1), 1, v="c"),
            ev("DELETE", 4, h1 + timedelta(minutes=2), 2),
        ],
    )
    done = subprocess.run(
        [sys.executable, "-c", _MATERIALIZE_TWO_HOURS, str(tmp_path / "cdc_platform.yaml")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    for run in json.loads(lines[-1].removeprefix("RESULT ")):
        assert run["success"] and run["checks"] and all(run["checks"].values()), run
    history = TablePaths.of(platform.warehouse_root, "orders").history
    rows = sorted(
        (r["id"], r["v"], r["_fivetran_active"])
        for r in delta.read_arrow(history, ["id", "v", "_fivetran_active"]).to_pylist()
    )
    assert rows == [(1, "a", False), (1, "c", True), (2, "b", False)]


def test_object_store_roots_parse_with_env_references(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ID_ENV, KEY_ID)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    options = f"""\
        aws_region: eu-west-1
        aws_allow_http: true
        aws_access_key_id: {{env: {KEY_ID_ENV}}}
        aws_secret_access_key: {{env: {SECRET_ENV}}}
        """
    path = tmp_path / "c.yaml"
    path.write_text(_config_text("s3a://bucket/wh/", options, landing_root="file:///srv/landing"))
    cfg = load_config(path)
    assert cfg.landing_root == Path("/srv/landing")
    root = cfg.warehouse_root
    assert root.uri == "s3://bucket/wh" and root.scheme == "s3" and not root.is_local
    assert root.options == {
        "aws_region": "eu-west-1",
        "aws_allow_http": "true",
        "aws_access_key_id": EnvRef(KEY_ID_ENV),
        "aws_secret_access_key": EnvRef(SECRET_ENV),
    }
    # Read when used: a missing variable is named, with the option that needs it.
    with pytest.raises(StorageOptionError) as err:
        _ = root.storage_options
    assert str(err.value) == (
        f"storage option 'aws_secret_access_key' reads the environment variable {SECRET_ENV},"
        " which is not set"
    )
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert root.storage_options == {
        "aws_region": "eu-west-1",
        "aws_allow_http": "true",
        "aws_access_key_id": KEY_ID,
        "aws_secret_access_key": SECRET,
    }
    shown = f"{root!r} {root} {cfg!r} {TablePaths.of(root, 'orders')!r}"
    assert SECRET not in shown and KEY_ID not in shown
    assert (root / "orders").options == root.options


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("gs://bucket/a/b", "gs://bucket/a/b"),
        ("abfss://wh@account.dfs.core.windows.net/x", "abfss://wh@account.dfs.core.windows.net/x"),
        ("S3://bucket", "s3://bucket"),
        ("file:///abs/wh", "/abs/wh"),
    ],
)
def test_each_supported_scheme_parses(tmp_path, root, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"landing_root: l\nwarehouse_root: {root}\ntables:\n  - {TABLE}\n")
    assert load_config(path).warehouse_root.uri == expected


@pytest.mark.parametrize(
    ("warehouse", "options", "landing", "message"),
    [
        (
            "s3://b/wh",
            "aws_secret_access_key: do-not-echo",
            "l",
            "option 'aws_secret_access_key' holds a secret: give it as {env: NAME}",
        ),
        ("s3://b/wh", "azure_storage_account_key: do-not-echo", "l", "holds a secret"),
        ("s3://b/wh", "aws_session_token: do-not-echo", "l", "holds a secret"),
        ("wh", "aws_region: x", "l", "storage options are for an object-store warehouse_root"),
        ("s3://b/wh", "aws_region: x", "s3://b/wh/landing", "field 'landing_root'"),
        ("s3://b/wh/in", "aws_region: x", "s3://b/wh", "overlap"),
        ("hdfs://nn/wh", "aws_region: x", "l", "scheme 'hdfs' is not supported"),
        ("s3:///wh", "aws_region: x", "l", "names no bucket"),
        ("s3://b/wh", "aws_region: {env: ''}", "l", "a reference is {env: NAME}"),
        ("s3://b/wh", "aws_region: [a, b]", "l", "a string, number, boolean or {env: NAME}"),
        ("s3://b/wh", "{aws_region: a, AWS_REGION: b}", "l", "are one option"),
    ],
)
def test_bad_object_store_config_is_rejected_clearly(
    tmp_path, warehouse, options, landing, message
):
    path = tmp_path / "c.yaml"
    path.write_text(_config_text(warehouse, options, landing_root=landing))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)
    assert "do-not-echo" not in str(err.value)


def test_a_gcs_or_azure_landing_root_is_refused_naming_why(tmp_path):
    path = tmp_path / "c.yaml"
    for root in ("gs://b/landing", "abfss://c@account.dfs.core.windows.net/landing"):
        path.write_text(f"landing_root: {root}\nwarehouse_root: wh\ntables:\n  - {TABLE}\n")
        with pytest.raises(ConfigError, match="read through S3's API"):
            load_config(path)


# -- what Spark is given ---------------------------------------------------------------------------


def _s3_location(**options: str | EnvRef) -> Location:
    return Location.of("s3://bucket/wh", options)


def test_s3_storage_options_become_s3a_settings(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    loc = _s3_location(
        AWS_ACCESS_KEY_ID=KEY_ID,
        aws_secret_access_key=EnvRef(SECRET_ENV),
        aws_session_token=EnvRef(SECRET_ENV),
        region="eu-west-1",
        aws_endpoint_url="http://minio:9000",
        aws_conditional_put="etag",
    )
    assert hadoop_conf(loc) == {
        "fs.s3a.access.key": KEY_ID,
        "fs.s3a.secret.key": SECRET,
        "fs.s3a.session.token": SECRET,
        "fs.s3a.aws.credentials.provider": (
            "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
        ),
        "fs.s3a.endpoint.region": "eu-west-1",
        "fs.s3a.endpoint": "http://minio:9000",
        "fs.s3a.path.style.access": "true",
        "fs.s3a.connection.ssl.enabled": "false",
    }
    virtual = _s3_location(endpoint="https://s3.example", virtual_hosted_style_request="true")
    assert hadoop_conf(virtual) == {
        "fs.s3a.endpoint": "https://s3.example",
        "fs.s3a.path.style.access": "false",
    }
    assert hadoop_conf(_s3_location(aws_region="us-east-1")) == {
        "fs.s3a.endpoint.region": "us-east-1"
    }
    # Only S3 maps: Spark reaches GCS and ADLS with the connector's own cluster credentials.
    assert hadoop_conf(Location.of("gs://bucket/wh", {"google_service_account": "/k.json"})) == {}


def test_the_spark_session_gets_the_warehouses_hadoop_settings(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    loc = _s3_location(aws_access_key_id=KEY_ID, aws_secret_access_key=EnvRef(SECRET_ENV))
    conf = spark_conf("local[2]", {"spark.hadoop.fs.s3a.access.key": "from-caller"}, [loc])
    assert conf["spark.hadoop.fs.s3a.secret.key"] == SECRET
    assert conf["spark.hadoop.fs.s3a.access.key"] == "from-caller"  # the caller's conf wins
    local = Location.of("/data/wh")
    assert spark_conf("local[2]", None, [local]) == spark_conf("local[2]")
    assert not any("s3a" in k for k in spark_conf("local[2]"))


def test_the_code_locations_spark_resource_carries_no_warehouse_and_no_secret(platform):
    """The warehouse's Hadoop settings come from the code location's config at session time
    (``SparkResource.session(warehouse)``), never from a field a run's config could set."""
    spark = (build_definitions(platform).resources or {})["spark"]
    assert spark == SparkResource()
    assert set(SparkResource.model_fields) == {"spark_config", "stop_at_end_of_run"}
    assert SECRET not in json.dumps(spark.model_dump()) and SECRET not in repr(spark)
    conf = spark_conf("local[2]", None, [platform.warehouse_root])
    assert conf["spark.hadoop.fs.s3a.secret.key"] == SECRET
    endpoint = platform.warehouse_root.options["aws_endpoint_url"]
    assert conf["spark.hadoop.fs.s3a.endpoint"] == endpoint


def test_spark_turns_an_s3a_file_url_into_the_table_relative_path(spark):
    """The SQL the merge uses on ``input_file_name()``, given the URLs Spark reports."""
    from pyspark.sql import functions as F

    urls = [
        ("s3a://bucket/wh/orders/data/u1/live/part-0.parquet", "s3://bucket/wh/orders"),
        ("s3a://bucket/wh/orders/data/a%3Db/part-0.parquet", "s3://bucket/wh/orders"),
        ("file:///tmp/wh/orders/data/u1/part-0.parquet", "/tmp/wh/orders"),
    ]
    got = [
        spark.createDataFrame([(url,)], ["url"])
        .select(merge.table_relative(F.col("url"), Location.of(table)).alias("p"))
        .collect()[0]["p"]
        for url, table in urls
    ]
    assert got == [
        "data/u1/live/part-0.parquet",
        "data/a=b/part-0.parquet",
        "data/u1/part-0.parquet",
    ]
