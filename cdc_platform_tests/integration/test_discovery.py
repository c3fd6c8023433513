"""New tables: unlisted landing folders are listed, described, reported once by the
``cdc_new_tables`` sensor (log + webhook, retried when undelivered), and with ``discover:`` in
the config they get assets that materialize like any other table."""

from __future__ import annotations

import json
import os
import socket
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.alerts.webhook import AlertWebhookResource
from cdc_platform.defs.sensors.discovery import NEW_TABLES_SENSOR_NAME, build_new_tables_sensor
from cdc_platform.lib.config import (
    ConfigError,
    DiscoverTemplate,
    PlatformConfig,
    TableConfig,
    load_config,
    parse_config,
)
from cdc_platform.lib.history.versions import TMAX
from cdc_platform.lib.landing.decoding.codecs import encode_file_bytes
from cdc_platform.lib.landing.decoding.formats.csv import read_csv_events
from cdc_platform.lib.landing.discovery import (
    describe,
    guess_primary_key,
    unlisted_tables,
    with_discovered_tables,
)
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.webhook import SECRET_PATH, SECRET_QUERY, Webhook

H5 = datetime(2024, 1, 1, 5, tzinfo=UTC)
H7 = H5 + timedelta(hours=2)
CSV_BODY = (
    b"payment_id,amount,method,paid_at,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
    b"1,2.5,card,2024-01-01T05:00:00Z,INSERT,1,2024-01-01T05:00:01Z\n"
    b'2,3,"cash, coins",2024-01-01T05:10:00Z,INSERT,2,2024-01-01T05:10:01Z\n'
)


def parquet_table(landing: Path, name: str, hour: datetime = H5, key: str = "id") -> Path:
    return write_parquet_events(
        landing, name, hour, [ev("INSERT", 1, hour, 1, key_column=key, label="a", amount=1.5)]
    )


def csv_file(landing: Path, name: str, filename: str, data: bytes, hour: datetime = H5) -> Path:
    folder = hour_folder(landing, name, hour)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    path.write_bytes(data)
    return path


def snippet_table(snippet: str, lake: dict[str, Path]) -> TableConfig:
    """The snippet pasted under ``tables:`` of a config, parsed as the platform parses it."""
    text = (
        f"landing_root: {lake['landing']}\nwarehouse_root: {lake['warehouse']}\ntables:\n{snippet}"
    )
    (table,) = parse_config(yaml.safe_load(text), base_dir=lake["root"]).tables
    return table


# --- listing ----------------------------------------------------------------------------------


def test_unlisted_tables_are_table_folders_the_config_does_not_list(lake) -> None:
    landing = lake["landing"]
    for name in ("orders", "zeta", "alpha", ".hidden", "_staging", "bad-name"):
        parquet_table(landing, name)
    (landing / "no_hours" / "stray").mkdir(parents=True)  # no year=/.../hour= folders
    (landing / "no_hours" / "file.parquet").write_bytes(b"x")
    hour_folder(landing, "empty_hours", H5).mkdir(parents=True)  # an hour folder, no file
    markers = hour_folder(landing, "markers_only", H5)
    markers.mkdir(parents=True)
    (markers / "_SUCCESS").write_bytes(b"")
    (markers / ".part.crc").write_bytes(b"")
    (landing / "README.txt").write_text("not a table")
    os.symlink(landing / "alpha", landing / "linked", target_is_directory=True)

    assert unlisted_tables(landing, ["ORDERS"]) == ["alpha", "zeta"]  # names: case-insensitive
    assert unlisted_tables(landing, ["orders", "alpha", "zeta"]) == []
    assert unlisted_tables(lake["root"] / "missing", []) == []


# --- describing -------------------------------------------------------------------------------


def test_describe_a_parquet_table_and_paste_its_snippet(lake) -> None:
    landing = lake["landing"]
    parquet_table(landing, "widgets", H7)
    first = parquet_table(landing, "widgets", H5)
    found = describe(landing, "widgets")
    assert found.name == "widgets" and found.first_hour == H5 and found.sample_file == str(first)
    assert found.columns == [
        ("id", "int64"),
        ("label", "string"),
        ("amount", "double"),
        ("cdc_operation_type", "string"),
        ("cdc_change_seq", "int64"),
        ("cdc_commit_timestamp", "timestamp[us, tz=UTC]"),
    ]
    assert found.primary_key == ("id",) and found.encoding.is_plain_parquet
    snippet = found.config_snippet()
    assert "# GUESS: the column 'id'" in snippet
    table = snippet_table(snippet, lake)
    assert table == TableConfig(name="widgets", primary_key=("id",), start=H5)
    assert table.start_partition_key == "2024-01-01-05:00"


def test_primary_key_guesses_are_marked_as_guesses(lake) -> None:
    assert guess_primary_key("customers", ["name", "customer_id"]) == (
        "customer_id",
        "the column 'customer_id'",
    )
    assert guess_primary_key("categories", ["category_id", "x"])[0] == "category_id"
    assert guess_primary_key("t", ["cdc_change_seq", "_fivetran_start", "code", "ID"])[0] == "ID"
    assert guess_primary_key("t", []) == ("id", "a placeholder, the columns are unknown")
    parquet_table(lake["landing"], "things", key="code")
    found = describe(lake["landing"], "things")
    # No id-like column: the proposal is a keyless table, which the config then reads as one.
    assert found.primary_key == ()
    snippet = found.config_snippet()
    assert "  keyless: true  # GUESS: no id column, so keyed by a hash of each row's" in snippet
    table = snippet_table(snippet, lake)
    assert table.keyless and table.primary_key is None and table.key == ("_fivetran_id",)


def test_describe_a_csv_table_types_from_its_rows_and_the_snippet_reads_it(lake) -> None:
    landing = lake["landing"]
    path = csv_file(landing, "payments", "part-1.csv", CSV_BODY)
    found = describe(landing, "payments")
    assert (found.encoding.format, found.encoding.compression) == ("csv", "none")
    assert found.columns == [
        ("payment_id", "long"),
        ("amount", "double"),
        ("method", "string"),
        ("paid_at", "timestamp"),
        ("cdc_operation_type", "string"),
        ("cdc_change_seq", "long"),
        ("cdc_commit_timestamp", "timestamp"),
    ]
    assert found.primary_key == ("payment_id",)  # 'payment' is not 'payments' singular: a guess
    table = snippet_table(found.config_snippet(), lake)
    assert table.format == "csv" and table.primary_key == ("payment_id",)
    assert table.columns == {
        "payment_id": "long",
        "amount": "double",
        "method": "string",
        "paid_at": "timestamp",
    }
    # A working TableConfig: the platform's CSV reader reads the file with it.
    events = read_csv_events(path.read_bytes(), table, str(path))
    assert events.column("payment_id").to_pylist() == [1, 2]
    assert events.column("method").to_pylist() == ["card", "cash, coins"]
    assert events.schema.field("paid_at").type == pa.timestamp("us", tz="UTC")


def test_describe_zstd_csv_reads_its_header_and_encrypted_files_say_columns_unknown(lake) -> None:
    landing = lake["landing"]
    csv_file(landing, "zipped", "part-1.csv.zst", encode_file_bytes(CSV_BODY, "zstd", "none", None))
    zipped = describe(landing, "zipped")
    assert (zipped.encoding.format, zipped.encoding.compression) == ("csv", "zstd")
    assert [c for c, _ in zipped.columns][:2] == ["payment_id", "amount"]
    table = snippet_table(zipped.config_snippet(), lake)
    assert (table.format, table.compression, table.encryption) == ("csv", "zstd", "none")

    key = os.urandom(32)
    sealed = encode_file_bytes(CSV_BODY, "zstd", "aes-256-cbc", key)
    csv_file(landing, "sealed", "part-1.csv.zst.aes", sealed)
    found = describe(landing, "sealed")
    assert found.columns == [] and found.encoding.encryption == "aes-256-cbc"
    assert (found.encoding.format, found.encoding.compression) == ("csv", "zstd")
    snippet = found.config_snippet()
    assert "columns unknown: the files are encrypted" in snippet
    assert "columns: {}  # REQUIRED for CSV" in snippet
    assert key.hex() not in snippet
    with pytest.raises(ConfigError, match="a CSV table must declare the type of every column"):
        snippet_table(snippet, lake)

    plaintext = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": [1]}), plaintext)
    blob = encode_file_bytes(plaintext.getvalue().to_pybytes(), "none", "aes-256-cbc", key)
    csv_file(landing, "vault", "part-1.parquet.aes", blob)
    vault = describe(landing, "vault")
    assert (vault.encoding.format, vault.encoding.encryption) == ("parquet", "aes-256-cbc")
    assert snippet_table(vault.config_snippet(), lake).encryption == "aes-256-cbc"


def test_an_unreadable_first_file_is_described_not_raised(lake) -> None:
    path = hour_folder(lake["landing"], "broken", H5)
    path.mkdir(parents=True)
    (path / "part-1.parquet").write_bytes(b"PAR1 truncated")
    found = describe(lake["landing"], "broken")
    assert found.columns == [] and found.notes and "could not be read" in found.notes[0]
    assert snippet_table(found.config_snippet(), lake).name == "broken"
    crushed = hour_folder(lake["landing"], "crushed", H5)
    crushed.mkdir(parents=True)
    (crushed / "part-1.csv.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\xff" * 64)  # bad frame
    found = describe(lake["landing"], "crushed")
    assert (found.encoding.format, found.encoding.compression) == ("csv", "zstd")
    assert found.columns == [] and "could not be read" in found.notes[0]
    assert "GUESS from the file name: format csv" in found.config_snippet()


# --- config: discover: ------------------------------------------------------------------------


def _raw(lake: dict[str, Path], body: str) -> dict:
    return yaml.safe_load(
        f"landing_root: {lake['landing']}\nwarehouse_root: {lake['warehouse']}\n"
        + textwrap.dedent(body)
    )


def test_discover_template_parses_and_tables_may_be_absent(lake) -> None:
    cfg = parse_config(
        _raw(lake, 'discover: {primary_key: [id], start: "2024-01-01-05:00"}\n'), lake["root"]
    )
    assert cfg.tables == () and cfg.discover == DiscoverTemplate(("id",), start=H5)
    cfg = parse_config(
        _raw(lake, 'tables: []\ndiscover: {primary_key: id, start: "2024-01-01-05:00"}\n'),
        lake["root"],
    )
    assert cfg.tables == () and cfg.discover is not None and cfg.discover.primary_key == ("id",)
    keyless = parse_config(
        _raw(lake, 'discover: {keyless: true, start: "2024-01-01-05:00"}\n'), lake["root"]
    ).discover
    assert keyless is not None and keyless.keyless and keyless.primary_key is None
    assert (
        parse_config(
            _raw(lake, 'tables:\n  - {name: a, primary_key: [id], start: "2024-01-01-00:00"}\n'),
            lake["root"],
        ).discover
        is None
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("tables: []\n", "'tables' must be a non-empty list"),
        ("discover: [id]\n", "field 'discover' must be a mapping"),
        (
            'discover: {primary_key: [id], start: "2024-01-01-00:00", format: csv}\n',
            "discover, field 'format': unknown key",
        ),
        ('discover: {start: "2024-01-01-00:00"}\n', "discover, field 'primary_key': required"),
        (
            'discover: {primary_key: [id], keyless: true, start: "2024-01-01-00:00"}\n',
            "discover, field 'keyless': give primary_key or keyless: true, not both",
        ),
        ("discover: {primary_key: [id]}\n", "discover, field 'start': required"),
        ('discover: {primary_key: [id], start: "2024-01-01-05:30"}\n', "must be on the hour"),
        (
            'discover: {primary_key: [cdc_change_seq], start: "2024-01-01-00:00"}\n',
            "discover, field 'primary_key': system column",
        ),
        (
            'tables: {}\ndiscover: {primary_key: [id], start: "2024-01-01-00:00"}\n',
            "'tables' must be a list",
        ),
    ],
)
def test_discover_errors_name_the_field(lake, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_raw(lake, body), lake["root"])


def test_with_discovered_tables_adds_plain_parquet_folders_from_the_template(lake) -> None:
    landing = lake["landing"]
    for name in ("orders", "widgets", "orders_current"):
        parquet_table(landing, name)
    csv_file(landing, "payments", "part-1.csv", CSV_BODY)
    listed = TableConfig(name="orders", primary_key=("id",), start=H5, current_table=True)
    plain = PlatformConfig(landing, lake["warehouse"], (listed,))
    assert with_discovered_tables(plain) is plain  # no template: nothing added
    template = DiscoverTemplate(("id",), start=H5 - timedelta(hours=5))
    platform = with_discovered_tables(
        PlatformConfig(landing, lake["warehouse"], (listed,), discover=template)
    )
    # CSV needs its columns declared; orders_current is the current table of orders
    assert platform.tables == (
        listed,
        TableConfig(
            name="widgets",
            primary_key=("id",),
            start=template.start,
            expected_delivery_hours=24,  # a discovered table's default cadence
        ),
    )
    keyless = DiscoverTemplate(start=H5, keyless=True)
    found = with_discovered_tables(
        PlatformConfig(landing, lake["warehouse"], (listed,), discover=keyless)
    )
    assert [t.key for t in found.tables] == [("id",), ("_fivetran_id",)]


# --- the sensor -------------------------------------------------------------------------------


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{SECRET_PATH}?{SECRET_QUERY}"


def tick(sensor: dg.SensorDefinition, cursor: str | None, url: str) -> tuple[str, str]:
    """One evaluation of the sensor: (its cursor, its skip message)."""
    context = dg.build_sensor_context(
        cursor=cursor,
        instance=dg.DagsterInstance.ephemeral(),
        resources={"alert_webhook": AlertWebhookResource(webhook_url=url, timeout_seconds=2)},
    )
    result = sensor.evaluate_tick(context)
    assert not result.run_requests
    assert result.cursor is not None and result.skip_message is not None
    return result.cursor, result.skip_message


def test_sensor_reports_each_new_folder_once_and_retries_undelivered_alerts(
    lake, webhook: Webhook, capfd: pytest.CaptureFixture[str]
) -> None:
    landing = lake["landing"]
    parquet_table(landing, "orders")
    parquet_table(landing, "alpha")
    csv_file(landing, "payments", "part-1.csv", CSV_BODY)
    listed = TableConfig(name="orders", primary_key=("id",), start=H5)
    sensor = build_new_tables_sensor(PlatformConfig(landing, lake["warehouse"], (listed,)))
    assert sensor.name == NEW_TABLES_SENSOR_NAME
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING

    capfd.readouterr()
    cursor, message = tick(sensor, None, webhook.secret_url)
    assert message == (
        "2 unlisted table folder(s) (alpha, payments): 2 new (alpha, payments), "
        "2 alert(s) sent, 0 pending"
    )
    assert json.loads(cursor) == {"reported": ["alpha", "payments"], "pending": []}
    bodies = {p.body["table"]: p.body for p in webhook.posted}
    assert set(bodies) == {"alpha", "payments"}
    alpha = bodies["alpha"]
    assert alpha["kind"] == "new_table" and alpha["first_hour"] == "2024-01-01-05:00"
    assert {"name": "id", "type": "int64"} in alpha["columns"]
    assert alpha["primary_key_guess"] == ["id"]
    assert alpha["sample_file"].startswith("alpha/year=2024/month=01/day=01/hour=05/")
    assert "paste this entry under tables:" in alpha["text"]
    assert snippet_table(alpha["config_snippet"], lake).name == "alpha"
    assert snippet_table(bodies["payments"]["config_snippet"], lake).format == "csv"
    assert all(SECRET_PATH not in p.raw.decode() for p in webhook.posted)
    logged = "".join(capfd.readouterr())
    assert "new table folder 'alpha'" in logged and "- name: alpha" in logged  # the tick log
    assert "SeCrEtToKeN123456" not in logged

    cursor, message = tick(sensor, cursor, webhook.secret_url)  # nothing new: nothing posted
    assert len(webhook.posted) == 2 and ": 0 new, 0 alert(s) sent" in message

    parquet_table(landing, "beta", H7)  # a folder landing later: reported on a later tick
    cursor, message = tick(sensor, cursor, webhook.secret_url)
    assert [p.body["table"] for p in webhook.posted[2:]] == ["beta"]
    assert "1 new (beta)" in message

    parquet_table(landing, "gamma")  # webhook down: the tick does not raise, the alert waits
    cursor, message = tick(sensor, cursor, closed_port_url())
    assert message.endswith("1 new (gamma), 0 alert(s) sent, 1 pending")
    state = json.loads(cursor)
    assert "gamma" in state["reported"] and state["pending"][0]["attempts"] == 1
    assert len(webhook.posted) == 3
    logged = "".join(capfd.readouterr())
    assert "alert not delivered (attempt 1, will retry)" in logged
    assert "SeCrEtToKeN123456" not in logged

    cursor, message = tick(sensor, cursor, webhook.secret_url)  # back up: delivered once
    assert [p.body["table"] for p in webhook.posted[3:]] == ["gamma"]
    assert message.endswith("0 new, 1 alert(s) sent, 0 pending")
    tick(sensor, cursor, webhook.secret_url)
    assert len(webhook.posted) == 4


def test_sensor_keeps_its_cursor_when_the_landing_root_is_gone(lake, webhook: Webhook) -> None:
    platform = PlatformConfig(lake["root"] / "unmounted", lake["warehouse"], ())
    sensor = build_new_tables_sensor(platform)
    cursor = json.dumps({"reported": ["alpha"], "pending": []})
    after, message = tick(sensor, cursor, webhook.secret_url)
    assert json.loads(after)["reported"] == ["alpha"] and "does not exist" in message
    assert webhook.posted == []


# --- discover: end to end ---------------------------------------------------------------------


def test_discover_config_gives_a_folder_an_asset_that_materializes(
    spark, lake, webhook: Webhook
) -> None:
    landing = lake["landing"]
    t1, t2 = H5 + timedelta(minutes=1), H5 + timedelta(minutes=2)
    write_parquet_events(
        landing,
        "widgets",
        H5,
        [
            ev("INSERT", 1, t1, 1, label="a"),
            ev("INSERT", 2, t1, 2, label="b"),
            ev("UPDATE", 3, t2, 1, label="c"),
        ],
    )
    csv_file(landing, "payments", "part-1.csv", CSV_BODY)
    config = lake["root"] / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\n"
        'discover: {primary_key: [id], start: "2024-01-01-00:00"}\n'
    )
    defs = build_definitions(load_config(config))
    dg.Definitions.validate_loadable(defs)
    key = dg.AssetKey("widgets")
    assert defs.resolve_asset_graph().get_all_asset_keys() == {key}  # payments is CSV: reported
    assert defs.resolve_sensor_def("widgets_landing_sensor") is not None
    assert defs.resolve_job_def("cdc_full_table_checks") is not None

    # The Definitions' own (unbound) asset and checks, run with the suite's resources.
    assets = [a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition) and key in a.keys]
    checks = [c for c in defs.asset_checks or [] if any(k.asset_key == key for k in c.check_keys)]
    result = dg.materialize(
        [*assets, *checks],
        partition_key=hour_to_partition_key(H5),
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
    )
    assert result.success
    assert all(e.passed for e in result.get_asset_check_evaluations())
    rows = history_rows(TablePaths.of(lake["warehouse"], "widgets").history)
    cols = ["id", "label", "_fivetran_start", "_fivetran_end", "_fivetran_active"]
    ms = timedelta(milliseconds=1)
    assert normalize(rows, cols) == normalize(
        [
            dict(zip(cols, r, strict=True))
            for r in [
                (1, "a", t1, t2 - ms, False),
                (1, "c", t2, TMAX, True),
                (2, "b", t1, TMAX, True),
            ]
        ],
        cols,
    )

    # The sensor says which folder got an asset and which needs its entry pasted.
    sensor = defs.resolve_sensor_def(NEW_TABLES_SENSOR_NAME)
    tick(sensor, None, webhook.secret_url)
    bodies = {p.body["table"]: p.body for p in webhook.posted}
    assert "its asset was created from the config's discover: template" in bodies["widgets"]["text"]
    assert "discover: covers plain Parquet only and its files are CSV" in bodies["payments"]["text"]


def test_discover_config_over_an_empty_landing_zone_builds_valid_definitions(lake) -> None:
    config = lake["root"] / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\n"
        'discover: {primary_key: [id], start: "2024-01-01-00:00"}\n'
    )
    defs = build_definitions(load_config(config))
    dg.Definitions.validate_loadable(defs)
    assert defs.resolve_asset_graph().get_all_asset_keys() == set()
    names = {s.name for s in defs.sensors or []}
    assert NEW_TABLES_SENSOR_NAME in names
    assert not any(j.name == "cdc_full_table_checks" for j in defs.resolve_all_job_defs())
