"""Point-in-time reads (``cdc_platform.read``) and the ``<table>_current`` asset.

The history table is built by the real pipeline from landing files with updates, a no-op
update, deletes, a re-insert after a delete, an insert and a delete in one millisecond, a
commit time with microseconds and a column that appears later. Every read form (Spark, Arrow,
SQL in DuckDB and Polars) is compared at many instants with a reference computed here, in plain
Python, from the rule of docs/HISTORY_MODE.md section 7 over all of the table's rows; a few
instants are also spelled out by hand, so a wrong reference fails too.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import dagster as dg
import duckdb
import polars as pl
import pytest

from cdc_platform import read
from cdc_platform.definitions import build_definitions
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tables.current import CURRENT_TABLES_SENSOR
from cdc_platform.lib.columns import ACTIVE, END, START, STATE_COLUMNS, TMAX
from cdc_platform.lib.config import PlatformConfig, TableConfig, load_config
from cdc_platform.lib.history import current_table
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations import maintenance
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev

T0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = T0, T0 + timedelta(hours=1)  # delivery hours (landing folders)
H3 = T0 + timedelta(hours=2)
MS = timedelta(milliseconds=1)
US = timedelta(microseconds=1)
SEC = timedelta(seconds=1)
STATE = STATE_COLUMNS  # the merge's own columns: no read returns them


def s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


HOUR1 = [
    ev("INSERT", 1, s(0), "a", v=1),
    ev("INSERT", 2, s(5), "b", v=10),
    ev("UPDATE", 3, s(10), "a", v=2),
    ev("INSERT", 4, s(1), "e", v=50),
    ev("DELETE", 5, s(2), "e", v=None),
    # insert and delete in one millisecond (rule 5): a version that starts and ends at 15 s
    ev("INSERT", 6, s(15), "c", v=30),
    ev("DELETE", 7, s(15) + 300 * US, "c", v=None),
    ev("UPDATE", 8, s(6), "b", v=10),  # no-op update: no version
    ev("INSERT", 9, s(12.3456), "f", v=60),  # starts at 12.345 s (truncated)
]
HOUR2 = [  # a new column, `note`, which no file of the first run has
    ev("DELETE", 10, s(20), "a", v=None, note=None),
    ev("INSERT", 11, s(30), "a", v=3, note="back"),  # re-insert after the delete
    ev("UPDATE", 12, s(40), "b", v=11, note="x"),
    ev("UPDATE", 13, s(45), "f", v=61, note=None),
    ev("INSERT", 14, s(50), "d", v=70, note="new"),
]

# The valid (key -> v) at some instants, worked out by hand from the events above.
BY_HAND = {
    s(0) - MS: {},  # before any version
    s(0): {"a": 1},  # exactly at a start
    s(2): {"a": 1, "e": 50},  # exactly at a delete's end: valid through that millisecond
    s(2) + MS: {"a": 1},
    s(10) - MS: {"a": 1, "b": 10},  # exactly at an end (the next version starts 1 ms later)
    s(10) - 500 * US: {"a": 1, "b": 10},  # inside that last millisecond
    s(10): {"a": 2, "b": 10},
    s(12.345) - US: {"a": 2, "b": 10},
    s(12.345): {"a": 2, "b": 10, "f": 60},
    s(15): {"a": 2, "b": 10, "c": 30, "f": 60},  # rule 5: valid in its one millisecond only
    s(15) + MS: {"a": 2, "b": 10, "f": 60},
    s(20): {"a": 2, "b": 10, "f": 60},
    s(25): {"b": 10, "f": 60},  # between a's delete and its re-insert
    s(60): {"a": 3, "b": 11, "d": 70, "f": 61},  # after the last event
}
INSTANTS = [*BY_HAND, s(30) - MS, s(30), s(45) - MS, s(45), T0 + timedelta(days=365), TMAX]


@pytest.fixture(scope="module")
def history(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The history table after two runs: closed, deleted and live files, old and new columns."""
    root = tmp_path_factory.mktemp("read")
    platform = PlatformConfig(root / "landing", Location.of(root / "warehouse"), ())
    table = TableConfig(name="t", primary_key=("id",), start=H1)
    for hour, events in ((H1, HOUR1), (H2, HOUR2)):
        write_parquet_events(platform.landing_path, table.name, hour, events)
        materialize(spark, table, platform.landing_path, platform.warehouse_root, [hour])
    return TablePaths.of(platform.warehouse_root, table.name).history.path


def _utc(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return value


def _rows(rows: Iterable[Mapping[str, Any]]) -> list[tuple]:
    """Rows as sorted tuples of (column, value), timestamps as aware UTC."""
    out = [tuple(sorted((k, _utc(v)) for k, v in r.items())) for r in rows]
    return sorted(out, key=repr)


def _all_rows(history: Path) -> list[dict[str, Any]]:
    return delta.read_arrow(history).to_pylist()


def reference(history: Path, ts: datetime) -> list[tuple]:
    """The contract's rule, in plain Python, over every row of the table."""
    ms = ts.astimezone(UTC)
    ms = ms.replace(microsecond=ms.microsecond // 1000 * 1000)
    valid = [r for r in _all_rows(history) if _utc(r[START]) <= ms <= _utc(r[END])]
    return _rows({k: v for k, v in r.items() if k not in STATE} for r in valid)


def _spark_rows(df: Any) -> list[tuple]:
    return _rows(df.toArrow().to_pylist())


def _duckdb_rows(sql: str) -> list[tuple]:
    return _rows(duckdb.connect().sql(sql).to_arrow_table().to_pylist())


def _polars_rows(history: Path, sql: str) -> list[tuple]:
    frame = pl.SQLContext({history.name: pl.scan_delta(str(history))}).execute(sql, eager=True)
    return _rows(frame.to_dicts())


def test_the_reference_agrees_with_the_hand_worked_instants(history):
    for ts, expected in BY_HAND.items():
        got = {dict(r)["id"]: dict(r)["v"] for r in reference(history, ts)}
        assert got == expected, ts


@pytest.mark.parametrize("ts", INSTANTS, ids=lambda t: t.isoformat())
def test_as_of_equals_the_contract_rule_in_every_form(spark, history, ts):
    expected = reference(history, ts)
    assert _spark_rows(read.as_of(history, ts, spark=spark)) == expected
    assert _rows(read.as_of_arrow(history, ts).to_table().to_pylist()) == expected
    assert _duckdb_rows(read.as_of_sql(history, ts)) == expected
    assert _polars_rows(history, read.as_of_sql(history, ts, engine="polars")) == expected
    # DuckDB scans the Arrow dataset itself, with its filter
    con = duckdb.connect()
    con.register("dataset", read.as_of_arrow(history, ts))
    assert _rows(con.sql("select * from dataset").to_arrow_table().to_pylist()) == expected


def test_rows_carry_the_fivetran_columns_and_never_the_state_columns(spark, history):
    df = read.as_of(history, s(60), spark=spark)
    columns = ["id", "v", "note", START, END, ACTIVE, "_fivetran_synced"]
    assert df.columns == columns
    assert read.as_of_arrow(history, s(60)).schema.names == columns
    sql_columns = duckdb.connect().sql(read.as_of_sql(history, s(60))).columns
    assert sql_columns == columns


def test_an_early_instant_reads_only_old_files_yet_has_the_later_column(spark, history):
    """At 1 s only the first run's files can hold a valid row, and none of them has `note`:
    Spark and Arrow fill it from the table schema, the DuckDB SQL adds a file that has it."""
    early = read.as_of_arrow(history, s(1))
    everything = delta.snapshot_files(delta.open_table(history))
    assert 0 < len(early.files) < len(everything)  # pyright: ignore[reportAttributeAccessIssue]
    rows = early.to_table().to_pylist()
    assert {r["id"]: (r["v"], r["note"]) for r in rows} == {"a": (1, None), "e": (50, None)}
    assert "note" in duckdb.connect().sql(read.as_of_sql(history, s(1))).columns


def test_current_is_the_active_rows_read_from_live_files_only(spark, history):
    active = [
        {k: v for k, v in r.items() if k not in STATE} for r in _all_rows(history) if r[ACTIVE]
    ]
    expected = _rows(active)
    assert {dict(r)["id"] for r in expected} == {"a", "b", "d", "f"}
    assert _spark_rows(read.current(history, spark=spark)) == expected
    assert _rows(read.current_arrow(history).to_table().to_pylist()) == expected
    assert _duckdb_rows(read.current_sql(history)) == expected
    assert _polars_rows(history, read.current_sql(history, engine="polars")) == expected
    assert reference(history, TMAX) == expected  # current() is as_of(TMAX)

    # Only live-segment files are opened (the writer puts each segment in its own folder).
    spark_files = read.current(history, spark=spark).inputFiles()
    arrow_files = read.current_arrow(history).files  # pyright: ignore[reportAttributeAccessIssue]
    sql = read.current_sql(history)
    for files in (spark_files, arrow_files):
        assert files and all("/live/" in f for f in files), files
    assert "/live/" in sql and "/closed/" not in sql and "/deleted/" not in sql
    assert read.current_sql(history, engine="polars").splitlines()[1] == 'FROM "t"'


def test_a_pinned_version_reads_that_version(spark, history):
    first = delta.open_table(history, 1)  # version 0 creates the table, 1 is the first run
    assert first.version() == 1
    got = _spark_rows(read.current(history, spark=spark, version=1))
    assert {dict(r)["id"]: dict(r)["v"] for r in got} == {"a": 2, "b": 10, "f": 60}
    sql = read.current_sql(history, version=1)
    assert {dict(r)["id"] for r in _duckdb_rows(sql)} == {"a", "b", "f"}


def test_instants_naive_is_utc_zones_convert_strings_parse_nonsense_is_refused():
    plus2 = timezone(timedelta(hours=2))
    at = datetime(2024, 1, 1, 10, 0, 0, 123999, tzinfo=UTC)
    assert read.as_of_instant(at) == datetime(2024, 1, 1, 10, 0, 0, 123000, tzinfo=UTC)
    assert read.as_of_instant(at.replace(tzinfo=None)) == read.as_of_instant(at)
    assert read.as_of_instant(datetime(2024, 1, 1, 12, 0, 0, 123999, tzinfo=plus2)) == (
        read.as_of_instant(at)
    )
    assert read.as_of_instant("2024-01-01T12:00:00.1239+02:00") == read.as_of_instant(at)
    assert read.as_of_instant("2024-01-01 10:00:00,123") == read.as_of_instant(at)
    assert read.as_of_instant("2024-01-01") == datetime(2024, 1, 1, tzinfo=UTC)
    assert read.as_of_instant(datetime.max) == TMAX
    for bad in ("yesterday", "2024-13-01", ""):
        with pytest.raises(ValueError, match="ISO-8601"):
            read.as_of_instant(bad)
    for wrong in (date(2024, 1, 1), 1704067200, True, None):
        with pytest.raises(TypeError, match="datetime or an ISO-8601 string"):
            read.as_of_instant(wrong)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="representable"):
        read.as_of_instant(datetime(1, 1, 1, tzinfo=plus2))


def test_sql_text_quotes_names_and_pins_a_utc_millisecond(history):
    sql = read.as_of_sql(
        history,
        datetime(2024, 1, 1, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=-5))),
        relation="delta_scan('/x')",
    )
    assert sql.splitlines() == [
        'SELECT "id", "v", "note", "_fivetran_start", "_fivetran_end", "_fivetran_active", '
        '"_fivetran_synced"',
        "FROM delta_scan('/x')",
        "WHERE \"_fivetran_start\" <= CAST('2024-01-01 08:04:05.678+00:00' AS TIMESTAMPTZ)",
        "  AND \"_fivetran_end\" >= CAST('2024-01-01 08:04:05.678+00:00' AS TIMESTAMPTZ)",
    ]
    assert read.sql_identifier('we"ird') == '"we""ird"'
    assert read.sql_string("it's") == "'it''s'"
    with pytest.raises(ValueError, match="engine"):
        read.current_sql(history, engine="sqlite")  # pyright: ignore[reportArgumentType]


def test_errors_name_what_is_missing(spark, tmp_path):
    with pytest.raises(FileNotFoundError, match="no Delta table"):
        read.current_arrow(tmp_path / "nothing")
    with pytest.raises(TypeError, match="path or TablePaths"):
        read.current_arrow(42)  # pyright: ignore[reportArgumentType]


# -- the <table>_current asset ------------------------------------------------------------------


def _platform(root: Path) -> PlatformConfig:
    config = root / "cdc_platform.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            landing_root: landing
            warehouse_root: warehouse
            tables:
              - name: t
                primary_key: [id]
                start: "2024-01-01-00:00"
                current_table: true
              - name: plain
                primary_key: [id]
                start: "2024-01-01-00:00"
            """
        )
    )
    (root / "landing").mkdir()
    return load_config(config)


def _current_rows(paths: TablePaths) -> list[tuple]:
    return _rows(delta.read_arrow(paths.current).to_pylist())


def _scd1(spark: Any, paths: TablePaths) -> list[tuple]:
    df = read.current(paths, spark=spark)
    return _spark_rows(df.drop(START, END, ACTIVE, "_fivetran_synced"))


def _commit(table: Path, version: int) -> tuple[list[str], list[str], dict[str, Any]]:
    lines = (table / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    actions = [json.loads(line) for line in lines]
    adds = [a["add"]["path"] for a in actions if "add" in a]
    removes = [a["remove"]["path"] for a in actions if "remove" in a]
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    return adds, removes, info


def test_current_table_asset_follows_the_history_asset(spark, tmp_path):
    platform = _platform(tmp_path)
    table = platform.table("t")
    paths = TablePaths.of(platform.warehouse_root, "t")
    defs = build_table_definitions(platform, table)
    assert defs.current is not None
    current_key = dg.AssetKey("t_current")
    instance = dg.DagsterInstance.ephemeral()
    resources = dagster_resources()

    def tick(cursor: Any = None) -> tuple[int, Any]:
        assert defs.current is not None
        result = dg.evaluate_automation_conditions(
            defs=dg.Definitions(assets=[defs.asset, defs.current], resources=resources),
            instance=instance,
            cursor=cursor,
        )
        return result.get_num_requested(current_key), result.cursor

    def materialize_history(hour: datetime) -> None:
        run = dg.materialize(
            [defs.asset, defs.checks],
            partition_key=hour.strftime("%Y-%m-%d-%H:%M"),
            instance=instance,
            resources=resources,
        )
        assert run.success

    def materialize_current() -> dict[str, Any]:
        assert defs.current is not None
        run = dg.materialize([defs.current], instance=instance, resources=resources)
        assert run.success
        [event] = run.get_asset_materialization_events()
        return {k: v.value for k, v in event.materialization.metadata.items()}

    # Nothing to show before the history table exists (most hourly partitions stay missing
    # for ever: plain eager() would wait for them and never run).
    requested, cursor = tick()
    assert requested == 0

    write_parquet_events(platform.landing_path, "t", H1, HOUR1)
    materialize_history(H1)
    requested, cursor = tick(cursor)
    assert requested == 1
    meta = materialize_current()
    assert _current_rows(paths) == _scd1(spark, paths)
    assert {dict(r)["id"]: dict(r)["v"] for r in _current_rows(paths)} == {
        "a": 2,
        "b": 10,
        "f": 60,
    }
    assert meta["dagster/row_count"] == 3 and meta["history_version"] == 1
    first = meta["delta_version"]
    first_files = {f.path for f in delta.snapshot_files(delta.open_table(paths.current))}
    requested, cursor = tick(cursor)
    assert requested == 0  # up to date

    write_parquet_events(platform.landing_path, "t", H2, HOUR2)
    materialize_history(H2)
    requested, cursor = tick(cursor)
    assert requested == 1
    meta = materialize_current()
    assert _current_rows(paths) == _scd1(spark, paths)
    assert {dict(r)["id"]: (dict(r)["v"], dict(r)["note"]) for r in _current_rows(paths)} == {
        "a": (3, "back"),
        "b": (11, "x"),
        "d": (70, "new"),
        "f": (61, None),
    }
    assert meta["dagster/row_count"] == 4 and meta["files_removed"] == len(first_files)
    # The whole content was replaced by exactly one commit: every old file out, new ones in.
    assert meta["delta_version"] == first + 1
    adds, removes, info = _commit(paths.current.path, first + 1)
    assert set(removes) == first_files and adds and not set(adds) & first_files
    history_version = delta.open_table(paths.history).version()
    assert info[current_table.HISTORY_VERSION] == meta["history_version"] == history_version

    # VACUUM removes the replaced files only when asked to include the current table.
    def in_current(removed: list[str]) -> set[str]:
        return {p for p in removed if p.startswith(f"{paths.current}/")}

    assert not in_current(maintenance.vacuum(paths, 0, enforce_retention_duration=False))
    removed = maintenance.vacuum(paths, 0, enforce_retention_duration=False, current_table=True)
    old_files = {str(paths.current / f) for f in first_files}
    assert {p for p in in_current(removed) if p.endswith(".parquet")} == old_files
    assert _current_rows(paths) == _scd1(spark, paths)


def test_an_empty_live_set_empties_the_current_table(spark, tmp_path):
    platform = _platform(tmp_path)
    table = platform.table("t")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(platform.landing_path, "t", H1, HOUR1[:1])
    materialize(spark, table, platform.landing_path, platform.warehouse_root, [H1])
    assert current_table.refresh(HistoryTable.of(spark, platform, table)).rows == 1
    write_parquet_events(platform.landing_path, "t", H2, [ev("DELETE", 2, s(9), "a", v=None)])
    materialize(spark, table, platform.landing_path, platform.warehouse_root, [H2])
    result = current_table.refresh(HistoryTable.of(spark, platform, table))
    assert (result.rows, result.files_added, result.files_removed) == (0, 0, 1)
    assert delta.read_arrow(paths.current).num_rows == 0
    assert delta.read_arrow(paths.current).schema.names == ["id", "v"]


def test_definitions_have_the_current_asset_and_its_sensor_only_when_asked(tmp_path):
    platform = _platform(tmp_path)
    defs = build_definitions(platform)
    graph = defs.resolve_asset_graph()
    assert dg.AssetKey("t_current") in graph.get_all_asset_keys()
    assert dg.AssetKey("plain_current") not in graph.get_all_asset_keys()
    assert graph.get(dg.AssetKey("t_current")).parent_keys == {dg.AssetKey("t")}
    sensor = defs.resolve_sensor_def(CURRENT_TABLES_SENSOR)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    without = PlatformConfig(
        platform.landing_path, platform.warehouse_root, (platform.table("plain"),)
    )
    names = {s.name for s in build_definitions(without).sensors or []}
    assert CURRENT_TABLES_SENSOR not in names


def test_the_current_table_waits_while_the_historys_blocking_checks_fail(spark, tmp_path):
    """Readers of ``<table>_current`` never see a history that just failed a blocking check:
    a planted duplicate active row keeps the current table at its last good state."""
    from deltalake import DeltaTable

    platform = _platform(tmp_path)
    defs = build_table_definitions(platform, platform.table("t"))
    assert defs.current is not None
    paths = TablePaths.of(platform.warehouse_root, "t")
    instance = dg.DagsterInstance.ephemeral()
    resources = dagster_resources()
    current_key = dg.AssetKey("t_current")
    both = dg.Definitions(
        assets=[defs.asset, defs.current], asset_checks=[defs.checks], resources=resources
    )

    def tick(cursor: Any) -> tuple[int, Any]:
        result = dg.evaluate_automation_conditions(defs=both, instance=instance, cursor=cursor)
        return result.get_num_requested(current_key), result.cursor

    def history_run(hour: datetime) -> bool:
        return dg.materialize(
            [defs.asset, defs.checks],
            partition_key=hour.strftime("%Y-%m-%d-%H:%M"),
            instance=instance,
            resources=resources,
            raise_on_error=False,
        ).success

    requested, cursor = tick(None)  # the first evaluation: nothing yet
    write_parquet_events(platform.landing_path, "t", H1, HOUR1)
    assert history_run(H1)
    requested, cursor = tick(cursor)
    assert requested == 1
    assert dg.materialize([defs.current], instance=instance, resources=resources).success
    good = sorted(dict(r)["id"] for r in _current_rows(paths))
    requested, cursor = tick(cursor)
    assert requested == 0  # up to date

    # Another writer changes a closed version of key a (the merge never reads closed rows of
    # an in-order key); the next hour touches a, and its checks see the history disagree.
    DeltaTable(paths.history.uri).update(predicate="id = 'a' AND v = 1", updates={"v": "999"})
    write_parquet_events(platform.landing_path, "t", H2, HOUR2)
    assert not history_run(H2)  # matches_change_log (blocking) failed after the commit
    latest = instance.get_latest_materialization_event(dg.AssetKey("t"))
    assert latest is not None and latest.run_id == instance.get_runs(limit=1)[0].run_id
    requested, cursor = tick(cursor)
    assert requested == 0
    # A clean hour of another key does not open the gate: after a failure the whole table is
    # checked again, and key a is still wrong.
    write_parquet_events(platform.landing_path, "t", H3, [ev("INSERT", 30, s(70), "z", v=1)])
    assert not history_run(H3)
    requested, cursor = tick(cursor)
    assert requested == 0
    assert sorted(dict(r)["id"] for r in _current_rows(paths)) == good
