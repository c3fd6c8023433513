"""Config validation names the table and the field; a missing Java stops with one clear line."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from cdc_platform.lib.config import ConfigError, TableConfig, load_config, parse_config
from cdc_platform.lib.spark.session import JavaMissingError, check_java

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_valid_config_resolves_paths_against_its_folder(tmp_path):
    cfg = load_config(
        _config(
            tmp_path,
            """\
            landing_root: land
            warehouse_root: /abs/wh
            tables:
              - {name: orders, primary_key: [id], start: "2024-01-01-00:00"}
              - name: pay
                primary_key: id
                start: "2024-02-01-05:00"
                format: CSV
                compression: zstd
                encryption: aes-256-cbc
                columns: {id: long, amount: "decimal(10,2)"}
                lookback_hours: 4
            """,
        )
    )
    assert cfg.landing_root == (tmp_path / "land").resolve()
    assert str(cfg.warehouse_root) == "/abs/wh"
    pay = cfg.table("pay")
    assert pay.primary_key == ("id",) and pay.format == "csv" and pay.lookback_hours == 4
    assert pay.start_partition_key == "2024-02-01-05:00" and pay.is_encoded
    assert not cfg.table("orders").is_encoded


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", primery: x}',
            "table 'orders', field 'primery': unknown key",
        ),
        (
            '{name: orders, start: "2024-01-01-00:00"}',
            "table 'orders', field 'primary_key': required",
        ),
        (
            '{name: orders, primary_key: [id], start: "2024-13-01-00:00"}',
            "table 'orders', field 'start': '2024-13-01-00:00' is not a date",
        ),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:30"}',
            "table 'orders', field 'start': '2024-01-01-00:30' must be on the hour",
        ),
        ("{name: orders, primary_key: [id]}", "table 'orders', field 'start': required"),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", format: json}',
            "table 'orders', field 'format': 'json' is not one of",
        ),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", format: csv}',
            "table 'orders', field 'columns': a CSV table must declare",
        ),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", columns: {id: int128}}',
            "table 'orders', field 'columns': column 'id' has unknown type",
        ),
        (
            '{name: orders, keyless: true, start: "2024-01-01-00:00", format: csv,'
            " columns: {_fivetran_id: string, a: long}}",
            "table 'orders', field 'columns': column '_fivetran_id' uses a reserved system prefix",
        ),
        ('{name: 1orders, primary_key: [id], start: "2024-01-01-00:00"}', "field 'name'"),
        (
            '{name: _cdc, primary_key: [id], start: "2024-01-01-00:00"}',
            "table '_cdc', field 'name': must not start with '_'",
        ),
        (
            '{name: _orders, primary_key: [id], start: "2024-01-01-00:00"}',
            "table '_orders', field 'name': must not start with '_'",
        ),
        ('{name: .cdc, primary_key: [id], start: "2024-01-01-00:00"}', "field 'name'"),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", current_table: "yes"}',
            "table 'orders', field 'current_table': 'yes' must be true or false",
        ),
        ('{name: a/b, primary_key: [id], start: "2024-01-01-00:00"}', "field 'name'"),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", group: "a b"}',
            "table 'orders', field 'group': letters, digits and underscores",
        ),
        (
            '{name: orders, primary_key: [id], start: "2024-01-01-00:00", group: [x]}',
            "table 'orders', field 'group'",
        ),
    ],
)
def test_bad_table_config_is_rejected_naming_table_and_field(tmp_path, table, message):
    path = _config(tmp_path, f"landing_root: l\nwarehouse_root: w\ntables:\n  - {table}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("landing", "warehouse", "message"),
    [
        ("data", "data", "field 'warehouse_root': the same folder as landing_root"),
        ("data", "./data/", "field 'warehouse_root': the same folder as landing_root"),
        ("data", "data/warehouse", "field 'warehouse_root'"),
        ("data/landing", "data", "field 'landing_root'"),
        ("data/x/../landing", "data/landing/wh", "field 'warehouse_root'"),
    ],
)
def test_overlapping_roots_are_rejected_naming_the_field(tmp_path, landing, warehouse, message):
    table = '{name: orders, primary_key: [id], start: "2024-01-01-00:00"}'
    path = _config(
        tmp_path, f"landing_root: {landing}\nwarehouse_root: {warehouse}\ntables:\n  - {table}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_sibling_roots_with_a_common_prefix_are_fine(tmp_path):
    table = '{name: orders, primary_key: [id], start: "2024-01-01-00:00"}'
    cfg = load_config(
        _config(tmp_path, f"landing_root: data\nwarehouse_root: data2\ntables:\n  - {table}\n")
    )
    assert cfg.warehouse_root.path == tmp_path / "data2"


def test_table_names_differing_only_in_case_are_one_folder(tmp_path):
    tables = (
        '  - {name: Orders, primary_key: [id], start: "2024-01-01-00:00"}\n'
        '  - {name: orders, primary_key: [id], start: "2024-01-01-00:00"}\n'
    )
    with pytest.raises(ConfigError, match="defined twice"):
        load_config(_config(tmp_path, f"landing_root: l\nwarehouse_root: w\ntables:\n{tables}"))


def test_a_current_table_may_not_take_another_tables_name(tmp_path):
    tables = (
        '  - {name: orders, primary_key: [id], start: "2024-01-01-00:00", current_table: true}\n'
        '  - {name: Orders_Current, primary_key: [id], start: "2024-01-01-00:00"}\n'
    )
    path = _config(tmp_path, f"landing_root: l\nwarehouse_root: w\ntables:\n{tables}")
    with pytest.raises(ConfigError, match="its current table 'orders_current' has the name"):
        load_config(path)
    flagged = (
        '  - {name: orders, primary_key: [id], start: "2024-01-01-00:00", current_table: true}\n'
    )
    cfg = load_config(_config(tmp_path, f"landing_root: l\nwarehouse_root: w\ntables:\n{flagged}"))
    assert cfg.table("orders").current_table


def test_unknown_top_level_key_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(
            _config(tmp_path, "landing_root: l\nwarehouse_root: w\ntables: []\nwarehose: x\n")
        )
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_the_repo_config_describes_the_demo_tables():
    cfg = load_config(REPO / "cdc_platform.yaml")
    assert [t.name for t in cfg.tables] == ["customers", "orders", "payments"]


def test_missing_java_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(JavaMissingError, match="install a Java 17 runtime"):
        check_java()
    env = {"PATH": str(tmp_path), "HOME": os.environ.get("HOME", "/root")}
    for target in ("test", "demo"):
        proc = subprocess.run(
            ["/usr/bin/make", "-s", target], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert proc.returncode != 0
        assert proc.stdout.strip().splitlines() == [
            "Java not found: install a Java 17 runtime (Debian: apt-get install openjdk-17-jre-headless) and run this again."
        ]


def test_a_long_lived_session_keeps_a_bounded_ui_history(spark):
    """The shared test session outlives thousands of SQL executions, as a Spark Connect server
    or a long backfill does. Spark keeps each execution's plan and metrics for its UI; unbounded
    (1000 by default, with many-column plans) that filled the driver's heap and later
    aggregations failed with AGGREGATE_OUT_OF_MEMORY."""
    executions = 60
    for i in range(executions):
        spark.range(3).selectExpr(f"id + {i} AS x").groupBy("x").count().collect()
    store = spark._jsparkSession.sharedState().statusStore()
    assert store.executionsCount() < executions / 2


def test_expected_delivery_hours_become_the_assets_freshness_policy(tmp_path):
    """Listed tables expect nothing unless told; a discover: template's tables default to a day."""
    from datetime import timedelta

    import dagster as dg

    from cdc_platform.defs.tables import build_table_definitions

    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\n"
        "discover: {primary_key: [id], start: '2024-01-01-00:00'}\ntables:\n"
        "  - {name: hourly, primary_key: [id], start: '2024-01-01-00:00', expected_delivery_hours: 2}\n"
        "  - {name: unknown, primary_key: [id], start: '2024-01-01-00:00'}\n"
    )
    platform = load_config(config)
    assert platform.discover is not None and platform.discover.expected_delivery_hours == 24
    (spec,) = build_table_definitions(platform, platform.table("hourly")).asset.specs
    assert spec.freshness_policy == dg.FreshnessPolicy.time_window(
        fail_window=timedelta(hours=4), warn_window=timedelta(hours=2)
    )
    (spec,) = build_table_definitions(platform, platform.table("unknown")).asset.specs
    assert spec.freshness_policy is None
    with pytest.raises(ConfigError, match="expected_delivery_hours"):
        parse_config(
            {
                "landing_root": "l",
                "warehouse_root": "w",
                "tables": [
                    {
                        "name": "x",
                        "primary_key": ["id"],
                        "start": "2024-01-01-00:00",
                        "expected_delivery_hours": 0,
                    }
                ],
            },
            tmp_path,
        )


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        (
            {"unapplied_alert_minutes": 10},
            r"10 min must be longer than twice retry_backoff_seconds",
        ),
        ({"retry_backoff_seconds": 1800}, r"60 min must be longer than twice .*1800 s"),
        ({"unapplied_alert_minutes": 0}, r"unapplied_alert_minutes"),
    ],
)
def test_an_unapplied_alert_sooner_than_the_retries_is_refused(tmp_path, keys, error):
    """An hour is first looked at again one backoff after its request: an alert threshold
    within two backoffs would alert on a healthy table."""
    table = {"name": "x", "primary_key": ["id"], "start": "2024-01-01-00:00", **keys}
    with pytest.raises(ConfigError, match=error):
        parse_config({"landing_root": "l", "warehouse_root": "w", "tables": [table]}, tmp_path)
    table = {**table, "unapplied_alert_minutes": 61, "retry_backoff_seconds": 1800}
    parsed = parse_config({"landing_root": "l", "warehouse_root": "w", "tables": [table]}, tmp_path)
    assert parsed.table("x").unapplied_alert_minutes == 61


def test_a_table_built_in_code_is_validated_as_the_file_is():
    """The models are the parser: a table built or changed in code (tests, discovery, operator
    jobs) meets the same rules, so no invalid TableConfig reaches a run."""
    import dataclasses

    import pydantic

    table = TableConfig(name="orders", primary_key="id", start="2024-01-01-05:00")  # type: ignore[arg-type]
    assert table.primary_key == ("id",) and table.start_partition_key == "2024-01-01-05:00"
    with pytest.raises(pydantic.ValidationError, match="must not start with '_'"):
        dataclasses.replace(table, name="_cdc")
    with pytest.raises(pydantic.ValidationError, match="always identify the version"):
        dataclasses.replace(table, ignore_history_columns=("ID",))
    with pytest.raises(pydantic.ValidationError, match="must be a positive integer"):
        dataclasses.replace(table, lookback_hours=True)
    widened = dataclasses.replace(table, compression="ZSTD")
    assert widened.compression == "zstd" and widened.is_encoded


@pytest.mark.parametrize(
    ("extra", "table", "error"),
    [
        ({}, {"start": "{y}2024-01-01 05:30:00"}, "field 'start': .* must be on the hour"),
        ({"discover": None}, {}, "field 'discover' must be a mapping"),
        ({}, {"track_history_columns": None}, "track_history_columns': must be a list"),
        ({"landing_sensor": "FLEET"}, {}, "'FLEET' is not one of"),
        ({"warehouse_storage_options": {}}, {}, "storage options are for an object-store"),
    ],
)
def test_what_yaml_makes_of_a_value_is_held_to_the_same_rules(tmp_path, extra, table, error):
    """An unquoted YAML timestamp is a datetime, a key with no value is None: neither slips
    past a rule the written-out value would meet."""
    row = {"name": "t", "primary_key": ["id"], "start": "2024-01-01-00:00"}
    row |= {k: yaml.safe_load(v[3:]) if str(v).startswith("{y}") else v for k, v in table.items()}
    raw = {"landing_root": "l", "warehouse_root": "w", "tables": [row], **extra}
    with pytest.raises(ConfigError, match=error):
        parse_config(raw, tmp_path)


def test_an_aware_yaml_timestamp_on_the_hour_is_read_in_utc(tmp_path):
    raw = {"landing_root": "l", "warehouse_root": "w"}
    start = yaml.safe_load("2024-01-01T05:00:00+02:00")
    row = {"name": "t", "primary_key": ["id"], "start": start}
    table = parse_config({**raw, "tables": [row]}, tmp_path).table("t")
    assert table.start_partition_key == "2024-01-01-03:00"


def test_a_refused_secret_is_in_no_error_nor_its_context(tmp_path):
    secret = "wJalrXUtnFEMI-not-a-real-key"
    raw = {
        "landing_root": "l",
        "warehouse_root": "s3://bucket/wh",
        "warehouse_storage_options": {"aws_secret_access_key": secret, "region": ["x"]},
        "tables": [{"name": "t", "primary_key": ["id"], "start": "2024-01-01-00:00"}],
    }
    with pytest.raises(ConfigError, match="holds a secret") as err:
        parse_config(raw, tmp_path)
    assert err.value.__context__ is None and err.value.__cause__ is None
    assert secret not in str(err.value)


def test_a_source_root_reached_through_a_link_still_overlaps_the_warehouse(tmp_path):
    (tmp_path / "real" / "wh").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    raw = {
        "landing_root": "l",
        "warehouse_root": str(tmp_path / "link" / "wh"),
        "snapshot_roots": [str(tmp_path / "real" / "wh" / "x")],
        "tables": [{"name": "t", "primary_key": ["id"], "start": "2024-01-01-00:00"}],
    }
    with pytest.raises(ConfigError, match=r"snapshot_roots.*overlaps"):
        parse_config(raw, tmp_path)
