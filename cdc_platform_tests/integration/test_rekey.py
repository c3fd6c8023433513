"""``rekey_table`` (docs/HISTORY_MODE.md, "Changing the key"): the history rebuilt under the key the
config now names, from the change log, through the Dagster job; the checks pass on the result, new
hours apply under the new key, and a rekey back gives the identical table."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
from deltalake import DeltaTable

from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.history import current_table, table_key
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.table_key import REKEY_PROPERTY, Rekey
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import (
    materialize_with_checks,
    one_table_config,
    run_operator_job,
    write_parquet_events,
)

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)


def at(hour: datetime, minute: int) -> datetime:
    return hour + timedelta(minutes=minute)


# Key 1 moves from eu to us (a split under [id, region]); key 2 stays; key 3 is deleted.
EVENTS = [
    ev("INSERT", 1, at(H0, 1), 1, region="eu", status="new"),
    ev("INSERT", 2, at(H0, 2), 2, region="us", status="new"),
    ev("INSERT", 3, at(H0, 3), 3, region="eu", status="new"),
    ev("UPDATE", 4, at(H0, 4), 1, region="us", status="new"),
    ev("UPDATE", 5, at(H0, 5), 2, region="us", status="paid"),
    ev("DELETE", 6, at(H0, 6), 3, region="eu", status="new"),
]


def config(tmp_path: Path, key: str) -> PlatformConfig:
    return one_table_config(tmp_path, key)


def rekey_job(platform: PlatformConfig) -> dg.ExecuteInProcessResult:
    return run_operator_job(platform, "rekey_table", "rekey")


def metadata_of(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    (m,) = [
        e.event_specific_data.materialization  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type_value == "ASSET_MATERIALIZATION"
    ]
    return {k: v.value for k, v in m.metadata.items()}


def failure_of(result: dg.ExecuteInProcessResult) -> str:
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    return failure.event_specific_data.error.message  # type: ignore[union-attr]


def checks_passed(result: dg.ExecuteInProcessResult) -> bool:
    evaluations = result.get_asset_check_evaluations()
    return result.success and bool(evaluations) and all(e.passed for e in evaluations)


def table_rows(where: Any, version: int | None = None) -> tuple[list[str], list[tuple]]:
    """Every column of every row (``_fivetran_synced`` included), sorted: for identity."""
    tbl = DeltaTable(str(where), version=version).to_pyarrow_table()
    names = sorted(tbl.column_names)
    rows = [tuple(r[n] for n in names) for r in tbl.to_pylist()]
    return names, sorted(rows, key=lambda t: tuple((v is None, str(v)) for v in t))


def versions_of(where: Any) -> list[tuple]:
    names, rows = table_rows(where)
    keep = [names.index(c) for c in ("id", "region", "status", "_fivetran_start", "_fivetran_end")]
    return sorted((tuple(r[i] for i in keep) for r in rows), key=str)


def test_adding_a_column_to_the_key_splits_keys_and_a_rekey_back_gives_the_identical_table(
    spark, tmp_path
):
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    write_parquet_events(by_id.landing_path, "t", H0, EVENTS)
    assert checks_passed(materialize_with_checks(by_id, "t", H0))
    original_version = DeltaTable(str(paths.history)).version()
    original = table_rows(paths.history)

    by_region = config(tmp_path, "primary_key: [id, region]")
    refused = materialize_with_checks(by_region, "t", H0)
    assert not refused.success and "rekey_table" in failure_of(refused)

    result = rekey_job(by_region)
    assert result.success, failure_of(result)
    meta = metadata_of(result)
    assert meta["keys_before"] == 3 and meta["keys_after"] == 4
    assert (meta["keys_split"], meta["keys_merged"]) == (1, 0)
    assert meta["old_key"] == "primary_key: ['id']"
    assert meta["old_rows_at_version"] == original_version
    assert meta["checks_failed"] == []
    # Id 1's update to us opens key (1, us); nothing deleted (1, eu), which stays live (each
    # new key's versions are its own events' fold).
    tmax = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    got = versions_of(paths.history)
    assert [v for v in got if v[0] == 1] == [
        (1, "eu", "new", at(H0, 1), tmax),
        (1, "us", "new", at(H0, 4), tmax),
    ]
    assert table_key.recorded_key(Table.open(paths.history)) == ["id", "region"]
    # The old rows stay readable by time travel.
    assert table_rows(paths.history, original_version) == original

    # New hours apply under the new key, and every check passes.
    write_parquet_events(
        by_id.landing_path, "t", H1, [ev("UPDATE", 7, at(H1, 1), 1, region="us", status="paid")]
    )
    assert checks_passed(materialize_with_checks(by_region, "t", H1))

    # Back under [id]: the same table as a table keyed by id all along.
    back = rekey_job(by_id)
    assert back.success, failure_of(back)
    assert (metadata_of(back)["keys_merged"], metadata_of(back)["keys_split"]) == (1, 0)
    assert checks_passed(materialize_with_checks(by_id, "t", H1))
    once = config(tmp_path / "direct", "primary_key: [id]")
    Path(by_id.landing_path).rename(once.landing_path)
    for hour in (H0, H1):
        assert checks_passed(materialize_with_checks(once, "t", hour))
    direct = TablePaths.of(once.warehouse_root, "t")
    names, rows = table_rows(paths.history)
    synced = names.index("_fivetran_synced")
    strip = lambda rs: sorted((r[:synced] + r[synced + 1 :] for r in rs), key=str)  # noqa: E731
    assert strip(rows) == strip(table_rows(direct.history)[1])


def test_a_rekey_back_keeps_every_cell_including_fivetran_synced(spark, tmp_path):
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    write_parquet_events(by_id.landing_path, "t", H0, EVENTS)
    assert materialize_with_checks(by_id, "t", H0).success
    original = table_rows(paths.history)
    assert rekey_job(config(tmp_path, "primary_key: [id, region]")).success
    back = rekey_job(by_id)
    assert back.success and metadata_of(back)["versions_synced_kept"] == len(original[1])
    assert table_rows(paths.history) == original


def test_removing_a_column_merges_keys_and_events_sharing_a_seq_count_once(spark, tmp_path):
    by_region = config(tmp_path, "primary_key: [id, region]")
    paths = TablePaths.of(by_region.warehouse_root, "t")
    events = [
        ev("INSERT", 1, at(H0, 1), 1, region="eu", status="a"),
        ev("INSERT", 1, at(H0, 1), 1, region="us", status="b"),  # same id and seq as above
        ev("INSERT", 2, at(H0, 2), 2, region="eu", status="c"),
        ev("UPDATE", 3, at(H0, 3), 1, region="us", status="d"),
    ]
    write_parquet_events(by_region.landing_path, "t", H0, events)
    assert checks_passed(materialize_with_checks(by_region, "t", H0))

    by_id = config(tmp_path, "primary_key: [id]")
    result = rekey_job(by_id)
    assert result.success, failure_of(result)
    meta = metadata_of(result)
    assert (meta["keys_before"], meta["keys_after"]) == (3, 2)
    assert (meta["keys_merged"], meta["keys_split"]) == (1, 0)
    assert meta["events_counted_once"] == 1
    # Key 1: the first copy of seq 1 to land (row 1, eu) opens; seq 3 follows it.
    got = versions_of(paths.history)
    assert [v[:3] for v in got if v[0] == 1] == [(1, "eu", "a"), (1, "us", "d")]
    assert checks_passed(materialize_with_checks(by_id, "t", H0))


def test_keyed_to_keyless_and_back(spark, tmp_path):
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    events = [e for e in EVENTS if e["cdc_operation_type"] != "UPDATE"]  # images only
    write_parquet_events(by_id.landing_path, "t", H0, events)
    assert materialize_with_checks(by_id, "t", H0).success
    original = table_rows(paths.history)

    keyless = config(tmp_path, "keyless: true")
    result = rekey_job(keyless)
    assert result.success, failure_of(result)
    meta = metadata_of(result)
    assert meta["changelog_rewritten"] is True and meta["new_key"] == "keyless: true"
    log = Table.open(paths.changelog)
    assert log.arrow_schema.names[0] == "_fivetran_id"
    # A new file's rows get the ids the rewrite gave the logged events: a duplicate of a logged
    # image makes nothing new, and the checks pass.
    write_parquet_events(keyless.landing_path, "t", H1, [events[1] | {"cdc_change_seq": 9}])
    assert checks_passed(materialize_with_checks(keyless, "t", H1))
    assert len(table_rows(paths.history)[1]) == len(original[1])
    current_table.refresh(HistoryTable.of(spark, keyless, "t"))  # as the t_current asset does
    assert "_fivetran_id" in Table.open(paths.current).arrow_schema.names

    back = rekey_job(by_id)
    assert back.success, failure_of(back)
    assert "_fivetran_id" not in Table.open(paths.changelog).arrow_schema.names
    assert checks_passed(materialize_with_checks(by_id, "t", H1))
    current_table.refresh(HistoryTable.of(spark, by_id, "t"))  # keyed again: no id column
    assert "_fivetran_id" not in Table.open(paths.current).arrow_schema.names


def test_a_null_in_a_new_key_column_is_refused_naming_the_event(spark, tmp_path):
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    events = [*EVENTS, ev("INSERT", 7, at(H0, 7), 4, status="no region")]
    write_parquet_events(by_id.landing_path, "t", H0, events)
    assert materialize_with_checks(by_id, "t", H0).success
    before = DeltaTable(str(paths.history)).version()
    result = rekey_job(config(tmp_path, "primary_key: [id, region]"))
    assert not result.success
    message = failure_of(result)
    assert "row 7 of t/year=2024/month=01/day=01/hour=00/" in message
    assert "Nothing was written" in message and "no region" not in message
    assert DeltaTable(str(paths.history)).version() == before


def test_an_unfinished_rekey_refuses_every_run_until_it_runs_again(spark, tmp_path):
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    write_parquet_events(by_id.landing_path, "t", H0, EVENTS)
    assert materialize_with_checks(by_id, "t", H0).success
    original = table_rows(paths.history)
    # A crash after the rekey's first commit: the new key recorded, the rows not rebuilt.
    dt = DeltaTable(str(paths.history))
    dt.alter.set_table_properties(
        {
            table_key.PRIMARY_KEY_PROPERTY: table_key.to_json(["id", "region"]),
            REKEY_PROPERTY: Rekey(dt.version(), True, ("id",)).to_json(),
        },
        raise_if_not_exists=False,
    )
    by_region = config(tmp_path, "primary_key: [id, region]")
    for platform in (by_id, by_region):
        refused = materialize_with_checks(platform, "t", H0)
        assert not refused.success
        assert "did not finish" in failure_of(refused)
    assert table_rows(paths.history)[1] == original[1]

    assert rekey_job(by_region).success
    assert checks_passed(materialize_with_checks(by_region, "t", H0))
    state = table_key.recorded_rekey(Table.open(paths.history))
    assert state is not None and not state.pending and state.from_key == ("id",)


def test_a_rekey_keeps_forgotten_events_forgotten(spark, tmp_path):
    """A hard truncate's events stay out when their hour is read again under the new key."""
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    write_parquet_events(by_id.landing_path, "t", H0, EVENTS)
    assert materialize_with_checks(by_id, "t", H0).success
    truncated = run_operator_job(by_id, "truncate_table", "truncate", soft=False)
    assert truncated.success
    assert Table.open(paths.history).read(spark).count() == 0
    by_region = config(tmp_path, "primary_key: [id, region]")
    assert rekey_job(by_region).success
    # A late file in the same hour makes the hour read again, its old file too.
    write_parquet_events(
        by_id.landing_path, "t", H0, [ev("INSERT", 8, at(H0, 30), 5, region="eu", status="x")]
    )
    assert checks_passed(materialize_with_checks(by_region, "t", H0))
    ids = {r["id"] for r in Table.open(paths.history).read(spark).collect()}
    assert ids == {5}
    assert pa.types.is_integer(Table.open(paths.history).arrow_schema.field("id").type)


def test_a_rekey_that_stopped_after_rewriting_the_change_log_completes_when_run_again(
    spark, tmp_path
):
    """Keyless to keyed, stopped after step 2 (the log no longer has the old key's ids)."""
    from cdc_platform.lib.operations import rekey as steps

    keyless = config(tmp_path, "keyless: true")
    paths = TablePaths.of(keyless.warehouse_root, "t")
    events = [e for e in EVENTS if e["cdc_operation_type"] != "UPDATE"]
    write_parquet_events(keyless.landing_path, "t", H0, events)
    assert materialize_with_checks(keyless, "t", H0).success
    by_id = config(tmp_path, "primary_key: [id]")
    table = by_id.table("t")
    history = Table.open(paths.history)
    assert history.version is not None
    steps._mark(history, table, Rekey(history.version, True, ("_fivetran_id",)))
    log = Table.open(paths.changelog)
    steps._keyed_log(spark, table, log)
    assert "_fivetran_id" not in Table.open(paths.changelog).arrow_schema.names

    result = rekey_job(by_id)
    assert result.success, failure_of(result)
    meta = metadata_of(result)
    assert (meta["keys_before"], meta["keys_after"]) == (3, 3)
    assert checks_passed(materialize_with_checks(by_id, "t", H0))


def test_a_config_the_rekey_cannot_follow_is_refused_before_its_first_commit(spark, tmp_path):
    by_id = config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(by_id.warehouse_root, "t")
    write_parquet_events(by_id.landing_path, "t", H0, EVENTS)
    assert materialize_with_checks(by_id, "t", H0).success
    before = DeltaTable(str(paths.history)).version()
    typo = config(tmp_path, "primary_key: [id, region]\n    track_history_columns: [stauts]")
    result = rekey_job(typo)
    assert not result.success and "stauts" in failure_of(result)
    assert DeltaTable(str(paths.history)).version() == before
    assert table_key.recorded_rekey(Table.open(paths.history)) is None
    assert materialize_with_checks(by_id, "t", H0).success  # not left under way
