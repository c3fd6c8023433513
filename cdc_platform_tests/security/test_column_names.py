"""Hostile column and key names: names with dots and backticks, and names of the
merge's own working columns, are names end to end; the config refuses key names that would collide
with system columns or carry control characters."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from cdc_platform.lib.config import ConfigError, TableConfig, parse_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events
from cdc_platform_tests.security.pipeline_runs import H0, H1, MS, TMAX_TS, paths, run
from cdc_platform_tests.security.sites import H5, SECRET, TS


def test_a_backtick_in_a_key_name_is_a_name_and_encrypted_keys_are_redacted(spark, site) -> None:
    key = "we`ird` OR true OR `x"
    table = TableConfig(name="orders", primary_key=(key,), start=H5)
    rows = [ev("INSERT", 1, TS, SECRET, key_column=key, v=1)]
    write_parquet_events(site["landing"], "orders", H5, rows)
    materialize(spark, table, site["landing"], site["warehouse"], [H5])
    paths = TablePaths.of(site["warehouse"], "orders")
    # Two active versions of the key: the checks run (the name was SQL text: a parse error)
    # and fail, and the sample of an encrypted table's check never shows the key.
    history = DeltaTable(str(paths.history)).to_pyarrow_table()
    write_deltalake(str(paths.history), pa.concat_tables([history, history]), mode="overwrite")
    failed = {
        o.name: o
        for o in invariants.run_checks(spark, paths, table.key, hide_keys=True)
        if not o.passed
    }
    assert failed[invariants.ONE_ACTIVE].failing == 1
    assert all(o.sample == [invariants.REDACTED] for o in failed.values())
    assert SECRET not in repr(failed)


# Named like working columns of the fold and the checks, now or before.
WORKING_NAMES = ["_rn", "_seq", "_ms", "_opened", "_closed", "_del", "_img", "ms", "img", "count"]
WORKING_NAMES += ["has_image", "ends_deleted", "a.b", "a`b2"]


@pytest.mark.parametrize("key", ["order.id", "a`b", "count", "ms"])
def test_hostile_column_names_survive_end_to_end(spark, lake, key):
    """Key and data columns named like working columns, with dots and backticks: merged, and
    checked (whole table and the last run's keys) without a clash."""
    table = TableConfig(name="t", primary_key=(key,), start=H0)
    names = [n for n in WORKING_NAMES if n != key]

    def row(op: str, seq: int, ts: datetime, k: int, v: int) -> dict[str, Any]:
        return ev(op, seq, ts, k, key_column=key, **{n: v * 10 + i for i, n in enumerate(names)})

    first = [row("INSERT", 1, H0, 1, 1), row("INSERT", 2, H0, 2, 1)]
    write_parquet_events(lake["landing"], "t", H0, first)
    assert run(spark, lake, [H0], table).quarantined == ()
    # Key 1: a real change and a no-op; key 2: a change in the same hour as its delete.
    later = [
        row("UPDATE", 3, H0 + MS, 1, 2),
        row("UPDATE", 4, H0 + 2 * MS, 1, 2),  # no-op: no new version
        row("UPDATE", 5, H0 + MS, 2, 3),
        ev("DELETE", 6, H0 + 3 * MS, 2, key_column=key),
    ]
    write_parquet_events(lake["landing"], "t", H1, later)
    assert run(spark, lake, [H1], table).quarantined == ()
    rows = history_rows(paths(lake).history)
    got = sorted(
        (
            r[key],
            r["_fivetran_start"],
            r["_fivetran_end"],
            r["_fivetran_active"],
            *[r[n] for n in names],
        )
        for r in rows
    )
    vals = lambda v: tuple(v * 10 + i for i in range(len(names)))  # noqa: E731
    assert got == [
        (1, H0, H0, False, *vals(1)),
        (1, H0 + MS, TMAX_TS, True, *vals(2)),
        (2, H0, H0, False, *vals(1)),
        (2, H0 + MS, H0 + 3 * MS, False, *vals(3)),
    ]
    # Nothing in the change log blocks a later run.
    write_parquet_events(
        lake["landing"], "t", H1 + timedelta(hours=1), [row("INSERT", 7, H1, 3, 4)]
    )
    since = DeltaTable(str(paths(lake).history)).version()
    later_run = run(spark, lake, [H1 + timedelta(hours=1)], table)
    assert later_run.merge.keys_affected == 1
    scope = invariants.touched_keys(spark, paths(lake), [key], since)
    assert scope is not None and scope.values == [3]
    for checked in (None, scope):
        outcomes = invariants.run_checks(spark, paths(lake), [key], checked)
        assert [o.name for o in outcomes if not o.passed] == []


@pytest.mark.parametrize(
    ("pk", "message"),
    [
        (["id", "ID"], "lists a column twice (names are case-insensitive in Delta)"),
        (["_CDC_id"], "system column(s) ['_CDC_id'] cannot be part of the key"),
        (["Cdc_change_seq"], "system column(s) ['Cdc_change_seq'] cannot be part of the key"),
        (["a\nb"], "contain control characters"),
        (["order.id", "a`b", "a b"], None),  # any other name works: Spark names are quoted
    ],
)
def test_primary_key_names_are_validated(tmp_path, pk, message):

    raw = {
        "landing_root": "l",
        "warehouse_root": "w",
        "tables": [{"name": "t", "primary_key": pk, "start": "2024-01-01-00:00"}],
    }
    if message is None:
        assert parse_config(raw, tmp_path).tables[0].primary_key == tuple(pk)
        return
    with pytest.raises(ConfigError) as err:
        parse_config(raw, tmp_path)
    assert message in str(err.value)
