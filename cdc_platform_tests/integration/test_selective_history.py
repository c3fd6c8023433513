"""Selective history (``track_history_columns`` / ``ignore_history_columns``): a change to
untracked columns only opens no version; the live version takes the new values in place."""

from __future__ import annotations

import dataclasses
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import ConfigError, TableConfig, load_config, parse_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.merge import HistoryColumnsError, record_settings
from cdc_platform.lib.history.provenance import EVENTS, version_sources
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.versions import TMAX, HistoryColumns
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import UNMODIFIED, changed_columns, reference_history

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
T = [H0 + timedelta(minutes=m) for m in range(60)]
MS = timedelta(milliseconds=1)
COLUMNS = ["id", "status", "updated_at", "_fivetran_start", "_fivetran_end", "_fivetran_active"]

# Key 1: two updates that only touch updated_at (no version), then a status change, then a
# late event inside the first version that is not its last step (changes nothing), and one
# after its last step (becomes its values). Key 2: an untracked change, then a delete.
EVENTS_H0 = [
    ev("INSERT", 1, T[1], 1, status="new", updated_at=1),
    ev("UPDATE", 2, T[2], 1, status="new", updated_at=2),
    ev("UPDATE", 3, T[3], 1, status="new", updated_at=3),
    ev("UPDATE", 4, T[10], 1, status="paid", updated_at=10),
    ev("INSERT", 5, T[1], 2, status="new", updated_at=1),
    ev("UPDATE", 6, T[4], 2, status="new", updated_at=4),
    ev("DELETE", 7, T[5], 2),
]
LATE = [
    ev("UPDATE", 8, T[2] + MS, 1, status="new", updated_at=99),  # not the version's last step
    ev("UPDATE", 9, T[7], 1, status="new", updated_at=7),  # now the version's last step
]


def rows_of(table: Path | TablePaths) -> list[tuple]:
    paths = table if isinstance(table, TablePaths) else TablePaths.of(table, "s")
    return normalize(history_rows(paths.history), COLUMNS)


def checks_passed(spark, paths: TablePaths) -> dict[str, bool]:
    return {o.name: o.passed for o in invariants.run_checks(spark, paths, ["id"])}


def test_untracked_changes_update_the_live_version_in_place_through_the_asset(spark, tmp_path):
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        + textwrap.indent(
            '- name: s\n  primary_key: [id]\n  start: "2024-01-01-00:00"\n'
            "  ignore_history_columns: [updated_at]\n",
            "  ",
        )
    )
    platform = load_config(config)
    table = platform.table("s")
    assert table.history_columns == HistoryColumns(ignore=("updated_at",))
    defs = build_table_definitions(platform, table)

    def run() -> None:
        result = dg.materialize(
            [defs.asset, defs.checks],
            partition_key=H0.strftime("%Y-%m-%d-%H:%M"),
            instance=dg.DagsterInstance.ephemeral(),
            resources=dagster_resources(),
        )
        evaluations = result.get_asset_check_evaluations()
        assert len(evaluations) == len(invariants.CHECK_NAMES)
        assert all(e.passed for e in evaluations), [e.check_name for e in evaluations]

    write_parquet_events(platform.landing_path, "s", H0, EVENTS_H0)
    run()
    paths = TablePaths.of(platform.warehouse_root, "s")
    assert rows_of(paths) == normalize(
        [
            dict(zip(COLUMNS, r, strict=True))
            for r in [
                (1, "new", 3, T[1], T[10] - MS, False),
                (1, "paid", 10, T[10], TMAX, True),
                (2, "new", 4, T[1], T[5], False),
            ]
        ],
        COLUMNS,
    )
    write_parquet_events(platform.landing_path, "s", H0, LATE)
    run()
    assert rows_of(paths) == normalize(
        [
            dict(zip(COLUMNS, r, strict=True))
            for r in [
                (1, "new", 7, T[1], T[10] - MS, False),
                (1, "paid", 10, T[10], TMAX, True),
                (2, "new", 4, T[1], T[5], False),
            ]
        ],
        COLUMNS,
    )
    assert rows_of(paths) == normalize(
        reference_history([*EVENTS_H0, *LATE], ["id"], untracked={"updated_at"}), COLUMNS
    )
    # Changed columns name tracked columns only.
    stored = {
        (r["id"], r["_fivetran_start"]): r["_cdc_changed_columns"]
        for r in history_rows(paths.history, drop=())
    }
    assert stored == {(1, T[1]): None, (1, T[10]): ["status"], (2, T[1]): None}
    assert stored == changed_columns(
        history_rows(paths.history, drop=()), ["id"], untracked={"updated_at"}
    )


def test_fast_path_updates_in_place_and_keeps_the_start(spark, lake):
    """In-order events of a key fold from its current row alone: the in-place update too."""
    table = TableConfig(name="s", primary_key=("id",), start=H0, track_history_columns=("status",))
    landing, warehouse = lake["landing"], lake["warehouse"]
    write_parquet_events(landing, "s", H0, [ev("INSERT", 1, T[1], 1, status="a", updated_at=1)])
    materialize(spark, table, landing, warehouse, [H0])
    later = [
        ev("UPDATE", 2, H1 + timedelta(minutes=1), 1, status="a", updated_at=2),
        ev("UPDATE", 3, H1 + timedelta(minutes=2), 1, status="a", updated_at=3, note="n"),
    ]
    write_parquet_events(landing, "s", H1, later)
    run = materialize(spark, table, landing, warehouse, [H1])
    assert run.merge.fast_keys == 1 and run.merge.slow_keys == 0
    assert run.merge.versions_opened == 0
    rows = history_rows(TablePaths.of(warehouse, "s").history, drop=("_fivetran_synced",))
    assert len(rows) == 1
    # A column that appears later is untracked under a track list: in place as well.
    assert rows[0]["updated_at"] == 3 and rows[0]["note"] == "n"
    assert rows[0]["_fivetran_start"] == T[1] and rows[0]["_fivetran_active"]
    assert rows[0]["_cdc_last_event_at"] == H1 + timedelta(minutes=2)
    assert all(checks_passed(spark, TablePaths.of(warehouse, "s")).values())


def test_changing_the_setting_recomputes_the_table_once(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, "s")
    every = TableConfig(name="s", primary_key=("id",), start=H0)
    selective = dataclasses.replace(every, ignore_history_columns=("UPDATED_AT",))
    write_parquet_events(landing, "s", H0, EVENTS_H0)
    materialize(spark, every, landing, warehouse, [H0])
    assert rows_of(paths) == normalize(reference_history(EVENTS_H0, ["id"]), COLUMNS)

    # No new file: the new setting alone recomputes every key, and is recorded on the table.
    run = materialize(spark, selective, landing, warehouse, [H0])
    assert run.merge.slow_keys == 2
    expected = reference_history(EVENTS_H0, ["id"], untracked={"updated_at"})
    assert rows_of(paths) == normalize(expected, COLUMNS)
    assert HistoryColumns.of_table(DeltaTable(str(paths.history))).same_as(
        HistoryColumns(ignore=("updated_at",))
    )
    assert all(checks_passed(spark, paths).values())
    again = materialize(spark, selective, landing, warehouse, [H0])
    assert again.merge.keys_affected == 0  # recorded: no second recomputation

    # And back: every column keeps history again.
    materialize(spark, every, landing, warehouse, [H0])
    assert rows_of(paths) == normalize(reference_history(EVENTS_H0, ["id"]), COLUMNS)
    assert HistoryColumns.of_table(DeltaTable(str(paths.history))).tracks_everything
    assert all(checks_passed(spark, paths).values())


def _overwrite(paths: TablePaths, change) -> None:
    """What a buggy writer does: the same table (setting included), other rows."""
    dt = DeltaTable(str(paths.history))
    tbl = dt.to_pyarrow_table()
    rows = pa.Table.from_pylist(change(tbl.to_pylist()), schema=tbl.schema)
    write_deltalake(str(paths.history), rows, mode="overwrite")
    assert HistoryColumns.of_table(DeltaTable(str(paths.history))) == HistoryColumns.of_table(dt)


@pytest.mark.parametrize("corruption", ["stale_untracked", "noop_version"])
def test_matches_change_log_catches_a_wrong_in_place_fold(spark, lake, corruption):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, "s")
    table = TableConfig(
        name="s",
        primary_key=("id",),
        start=H0,
        ignore_history_columns=("updated_at",),
    )
    write_parquet_events(landing, "s", H0, EVENTS_H0)
    materialize(spark, table, landing, warehouse, [H0])
    assert all(checks_passed(spark, paths).values())

    def stale_untracked(rows: list[dict]) -> list[dict]:
        # The writer forgot the in-place update: key 1's first version keeps updated_at=1.
        for r in rows:
            if r["id"] == 1 and r["_fivetran_start"] == T[1]:
                r["updated_at"] = 1
        return rows

    def noop_version(rows: list[dict]) -> list[dict]:
        # The writer opened a version for an untracked change (key 1 at T[2]).
        first = next(r for r in rows if r["id"] == 1 and r["_fivetran_start"] == T[1])
        split = dict(first, _fivetran_start=T[2], updated_at=3, _cdc_changed_columns=[])
        first.update(updated_at=1, _fivetran_end=T[2] - MS, _cdc_current=False)
        return [*rows, split]

    _overwrite(
        paths, {"stale_untracked": stale_untracked, "noop_version": noop_version}[corruption]
    )
    passed = checks_passed(spark, paths)
    assert not passed[invariants.MATCHES_CHANGELOG]
    assert {n for n, ok in passed.items() if not ok} == {invariants.MATCHES_CHANGELOG}


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"track_history_columns": ["a"], "ignore_history_columns": ["b"]}, "not both"),
        ({"ignore_history_columns": ["id"]}, "primary key"),
        ({"ignore_history_columns": "updated_at"}, "list of column names"),
        ({"track_history_columns": ["a", "A"]}, "twice"),
        ({"ignore_history_columns": ["_fivetran_synced"]}, "system column"),
        ({"track_history_columns": []}, "at least one column"),
    ],
)
def test_config_rejects_bad_lists(tmp_path, fields, why):
    raw = {
        "landing_root": "landing",
        "warehouse_root": "warehouse",
        "tables": [{"name": "s", "primary_key": ["id"], "start": "2024-01-01-00:00", **fields}],
    }
    with pytest.raises(ConfigError, match=why) as err:
        parse_config(raw, tmp_path)
    assert "table 's'" in str(err.value)


def test_a_setting_naming_a_column_the_table_lacks_merges_nothing(spark, lake):
    """A typo in a track list would untrack every column: the run fails instead, naming it,
    and the events it logged are merged once the config is fixed."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, "s")
    typo = TableConfig(name="s", primary_key=("id",), start=H0, track_history_columns=("stauts",))
    write_parquet_events(landing, "s", H0, EVENTS_H0)
    with pytest.raises(HistoryColumnsError, match=r"name \['stauts'\], which the table does not"):
        materialize(spark, typo, landing, warehouse, [H0])
    assert not delta.exists(paths.history)
    fixed = dataclasses.replace(typo, track_history_columns=("status",))
    materialize(spark, fixed, landing, warehouse, [H0])
    expected = reference_history(EVENTS_H0, ["id"], untracked={"updated_at"})
    assert rows_of(paths) == normalize(expected, COLUMNS)


def test_the_setting_is_not_recorded_over_another_writers_commit(spark, lake):
    """Recorded strictly right after the data commit it describes; if any commit came in
    between, the table keeps the old setting, so the next run recomputes it again."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, "s")
    write_parquet_events(landing, "s", H0, EVENTS_H0)
    materialize(
        spark, TableConfig(name="s", primary_key=("id",), start=H0), landing, warehouse, [H0]
    )
    dt = DeltaTable(str(paths.history))
    data_version = dt.version()
    delta.commit(dt, [], [], delta.table_arrow_schema(dt))  # another writer's commit
    selective = HistoryColumns(ignore=("updated_at",))
    assert not record_settings(Table.open(paths.history), ["id"], selective, data_version)
    assert HistoryColumns.of_table(DeltaTable(str(paths.history))).tracks_everything
    assert record_settings(Table.open(paths.history), ["id"], selective, data_version + 1)
    assert HistoryColumns.of_table(DeltaTable(str(paths.history))).same_as(selective)


def test_provenance_of_a_selective_version_lists_every_event_it_covers(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    table = TableConfig(
        name="s",
        primary_key=("id",),
        start=H0,
        ignore_history_columns=("updated_at",),
    )
    write_parquet_events(landing, "s", H0, EVENTS_H0)
    materialize(spark, table, landing, warehouse, [H0])
    sources = {
        (r["id"], r["_fivetran_start"]): [e["cdc_change_seq"] for e in r[EVENTS]]
        for r in version_sources(HistoryTable(spark, table, warehouse)).collect()
    }
    # Key 1's first version took updated_at from seqs 2 and 3; key 2's version ends with its
    # delete.
    assert sources == {
        (1, T[1].replace(tzinfo=None)): [1, 2, 3],
        (1, T[10].replace(tzinfo=None)): [4],
        (2, T[1].replace(tzinfo=None)): [5, 6, 7],
    }


def test_a_late_event_before_an_in_place_change_keeps_the_earlier_untracked_value(spark, lake):
    """A late partial update inside a version whose untracked value changed in place later:
    its unmodified untracked cell takes the value it had at the late event's time, not the
    version's last (the stored row holds the last step's values, so it cannot stand for the
    version's first step when the key is refolded)."""
    table = TableConfig(
        name="u",
        primary_key=("id",),
        start=H0,
        format="csv",
        null_string="<null>",
        unmodified_string="<unmodified>",
        columns={"id": "long", "t": "long", "u": "string"},
        track_history_columns=("t",),
    )
    unmod = UNMODIFIED
    applied = [
        ev("INSERT", 1, T[1], 1, t=1, u="a"),
        ev("UPDATE", 2, T[10], 1, t=2, u=unmod),
        ev("UPDATE", 3, T[30], 1, t=unmod, u="b"),
    ]
    late = [ev("UPDATE", 4, T[20], 1, t=3, u=unmod)]

    def write(hour: datetime, rows: list[dict]) -> None:
        folder = hour_folder(lake["landing"], "u", hour)
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["id,t,u,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp"]
        for r in rows:
            cells = [r["id"], r["t"], r["u"], r["cdc_operation_type"], r["cdc_change_seq"]]
            text = ["<unmodified>" if c is unmod else str(c) for c in cells]
            lines.append(",".join([*text, r["cdc_commit_timestamp"].isoformat()]))
        (folder / "events.csv").write_text("\n".join(lines) + "\n")

    write(H0, applied)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H0])
    write(H1, late)
    run = materialize(spark, table, lake["landing"], lake["warehouse"], [H1])
    assert run.merge.slow_keys == 1
    columns = ["id", "t", "u", "_fivetran_start", "_fivetran_end", "_fivetran_active"]
    got = normalize(history_rows(TablePaths.of(lake["warehouse"], "u").history), columns)
    expected = reference_history([*applied, *late], ["id"], untracked={"u"})
    assert got == normalize(expected, columns)
    assert ("a" in {r[2] for r in got}) and len(got) == 3  # [10, 20) kept u = "a"
