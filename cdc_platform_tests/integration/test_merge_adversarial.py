"""Adversarial scenarios for the segmented merge (lib/history/merge/): fast path, slow path, the
delete-only side table, compaction and crashes, each compared with ``reference_history``."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history.merge import write as merge_write
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.maintenance import compact
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, normalize, write_parquet_events
from cdc_platform_tests.reference import reference_history

H0 = datetime(2024, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)
MIN = timedelta(minutes=1)
HOUR = timedelta(hours=1)
TABLE = TableConfig(name="adv", primary_key=("id",), start=H0)
SYSTEM = ["_fivetran_start", "_fivetran_end", "_fivetran_active"]


class _Lake:
    """One table in one lake: land events in an hour, materialize it, compare with the reference."""

    def __init__(
        self, spark: Any, landing: Path, warehouse: Path, table: TableConfig = TABLE
    ) -> None:
        self.spark, self.landing, self.warehouse, self.table = spark, landing, warehouse, table
        self.events: list[dict[str, Any]] = []
        self.paths = TablePaths.of(warehouse, table.name)

    def run(self, hour: datetime, events: list[dict[str, Any]]) -> Any:
        if events:
            write_parquet_events(self.landing, self.table.name, hour, events)
        self.events += events
        return materialize(self.spark, self.table, self.landing, self.warehouse, [hour])

    def check(self, data: list[str]) -> None:
        pk = list(self.table.key)
        columns = [*pk, *data, *SYSTEM]
        expected = reference_history(self.events, pk)
        actual = history_rows(self.paths.history)
        assert normalize(actual, columns) == normalize(expected, columns)


@pytest.fixture()
def t(spark, lake) -> _Lake:
    return _Lake(spark, lake["landing"], lake["warehouse"])


# -- the delete-only side table, crashes and compaction -------------------------------------


def _crash_before_side_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next history commit succeeds, then the process dies before the side-table commit."""

    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("killed between the history commit and the side-table commit")

    monkeypatch.setattr(merge_write, "store_delete_only_keys", crash)


def test_crash_before_side_table_then_late_insert(t, monkeypatch):
    t.run(H0, [ev("INSERT", 1, H0 + MIN, 1, v=1)])
    with monkeypatch.context() as m:
        _crash_before_side_table(m)
        with pytest.raises(RuntimeError, match="killed"):
            t.run(H0 + HOUR, [ev("DELETE", 2, H0 + HOUR + MIN, 2)])
    # An insert of key 2 older than its delete: the delete must close it.
    t.run(H0 + 2 * HOUR, [ev("INSERT", 3, H0 + 30 * MIN, 2, v=2)])
    t.check(["v"])


def test_crash_before_side_table_then_changelog_compaction_then_late_insert(t, monkeypatch):
    """Compaction stamps the side table with the compacted log version even though its rows
    are stale (the crash left them behind), so the next run trusts them: key 2's delete is
    forgotten and its older insert opens a live version."""
    t.run(H0, [ev("INSERT", 1, H0 + MIN, 1, v=1)])
    with monkeypatch.context() as m:
        _crash_before_side_table(m)
        with pytest.raises(RuntimeError, match="killed"):
            t.run(H0 + HOUR, [ev("DELETE", 2, H0 + HOUR + MIN, 2)])
    compact(HistoryTable(t.spark, t.table, t.warehouse))
    t.run(H0 + 2 * HOUR, [ev("INSERT", 3, H0 + 30 * MIN, 2, v=2)])
    t.check(["v"])


def test_crash_before_side_table_then_a_file_widens_the_key(t, monkeypatch):
    """The stale side table is recomputed from the log version the history table reflects;
    a widening since rewrote the log with the key as text: that version is read with its own
    types and the key cast up, so the run goes through (it failed on every run before)."""
    import pyarrow as pa

    cdc = [
        pa.field("cdc_operation_type", pa.string()),
        pa.field("cdc_change_seq", pa.int64()),
        pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
    ]
    wide = pa.schema([pa.field("id", pa.string()), pa.field("v", pa.int64()), *cdc])
    t.run(H0, [ev("INSERT", 1, H0 + MIN, 1, v=1)])
    with monkeypatch.context() as m:
        _crash_before_side_table(m)
        with pytest.raises(RuntimeError, match="killed"):
            t.run(H0 + HOUR, [ev("DELETE", 2, H0 + HOUR + MIN, 2)])
    late = [ev("INSERT", 3, H0 + 30 * MIN, "2", v=2), ev("INSERT", 4, H0 + 2 * HOUR, "A", v=3)]
    write_parquet_events(t.landing, t.table.name, H0 + 2 * HOUR, late, schema=wide)
    widens_keys = replace(t.table, widen_types="all")  # a key widens only when allowed
    materialize(t.spark, widens_keys, t.landing, t.warehouse, [H0 + 2 * HOUR])
    # As text, the keys' events fold as the reference folds them (key "2": insert, then delete).
    t.events = [{**e, "id": str(e["id"])} for e in [*t.events, *late]]
    t.check(["v"])


# -- fast path, state events, same milliseconds across runs -----------------------------------


def test_fast_path_state_replays_across_runs(t):
    """Each key's current row stands in for its past; one run per hour, mixed cases."""
    m0 = H0 + MIN
    t.run(
        H0,
        [
            ev("INSERT", 1, m0, 1, v=1),  # key 1: rule 5 as the current row
            ev("DELETE", 2, m0, 1),
            ev("DELETE", 3, m0, 2),  # key 2: delete-only
            ev("INSERT", 4, m0, 3, v=3),  # key 3: live, then a same-ms event next run
            ev("INSERT", 5, m0, 4, v=4),  # key 4: live, no-op update later
            ev("UPDATE", 6, m0 + MIN, 4, v=4),
            ev("INSERT", 7, m0, 5, v=5),  # key 5: deleted, then a re-delivery
            ev("DELETE", 8, m0 + MIN, 5),
            ev("DELETE", 9, m0 + 2 * MIN, 5),
        ],
    )
    h1 = H0 + HOUR
    t.run(
        h1,
        [
            ev("INSERT", 10, h1, 1, v=1),  # same image after rule 5: a new version
            ev("INSERT", 11, h1, 2, v=2),  # delete-only key becomes live
            ev("UPDATE", 12, m0 + 900 * timedelta(microseconds=1), 3, v=33),  # same ms
            ev("DELETE", 13, m0 + MIN, 4),  # delete at the key's last event (no-op update ms)
            ev("DELETE", 9, m0 + 2 * MIN, 5),  # a duplicate seq from an earlier run
            ev("INSERT", 14, h1, 5, v=5),
        ],
    )
    h2 = H0 + 2 * HOUR
    t.run(
        h2,
        [
            ev("DELETE", 15, h2, 2),
            ev("INSERT", 16, h2, 4, v=44),
            ev("UPDATE", 17, h2, 3, v=33),  # no-op
            ev("DELETE", 18, h2, 3),  # update to the live image then delete: ends at h2
            ev("INSERT", 19, h2, 6, v=6),  # new key, rule 5
            ev("DELETE", 20, h2, 6),
        ],
    )
    h3 = H0 + 3 * HOUR
    t.run(
        h3,
        [
            ev("UPDATE", 21, h3, 6, v=6),
            ev("DELETE", 22, h3 + MS, 6),
            ev("INSERT", 23, h3 + MS, 6, v=6),  # delete then insert of a not-live key
            ev("INSERT", 24, h2, 3, v=3),  # same ms as key 3's rule-4 end, larger seq
        ],
    )
    t.check(["v"])


def test_schema_drift_column_added_while_fast_path_replays(t):
    t.run(H0, [ev("INSERT", 1, H0, 1, a="x"), ev("INSERT", 2, H0, 2, a="y")])
    t.run(H0 + HOUR, [ev("DELETE", 3, H0 + HOUR, 2)])
    h2 = H0 + 2 * HOUR
    t.run(
        h2,
        [
            ev("UPDATE", 4, h2, 1, a="x", b=None),  # new column, null: no change
            ev("UPDATE", 5, h2 + MS, 1, a="x", b=7),
            ev("INSERT", 6, h2, 2, a="y", b=None),  # after a delete: new version
        ],
    )
    t.check(["a", "b"])


# -- keys, column names, paths --------------------------------------------------------------


def test_multi_column_key_with_dotted_names_fast_and_slow(spark, lake):
    table = TableConfig(name="mk", primary_key=("k.a", "k b"), start=H0)
    t = _Lake(spark, lake["landing"], lake["warehouse"], table)

    def e(op: str, seq: int, ts: datetime, a: int, b: str, **cols: Any) -> dict[str, Any]:
        row = ev(op, seq, ts, a, key_column="k.a", **cols)
        return {"k b": b, **row}

    t.run(H0, [e("INSERT", 1, H0, 1, "x", **{"v.w": 1}), e("INSERT", 2, H0, 1, "y", **{"v.w": 2})])
    h1 = H0 + HOUR
    t.run(h1, [e("UPDATE", 3, h1, 1, "x", **{"v.w": 3}), e("DELETE", 4, h1, 2, "x")])
    t.run(H0 + 2 * HOUR, [e("UPDATE", 5, H0 + 30 * MIN, 1, "x", **{"v.w": 5})])  # late
    t.check(["v.w"])


def test_timestamp_primary_key_late_event(spark, lake):
    """A late event prunes files by key statistics; here the key is a timestamp."""
    table = TableConfig(name="tk", primary_key=("id",), start=H0)
    t = _Lake(spark, lake["landing"], lake["warehouse"], table)
    k1, k2 = datetime(2020, 5, 1, tzinfo=UTC), datetime(2021, 5, 1, tzinfo=UTC)
    t.run(H0, [ev("INSERT", 1, H0, k1, v=1), ev("INSERT", 2, H0, k2, v=2)])
    t.run(H0 + HOUR, [ev("UPDATE", 3, H0 + HOUR, k1, v=3)])
    t.run(H0 + 2 * HOUR, [ev("UPDATE", 4, H0 + 30 * MIN, k1, v=4)])  # late: slow path
    t.check(["v"])


def test_warehouse_path_with_odd_characters(spark, lake):
    """``_FILE`` (input_file_name -> table-relative path) with a space, '#', '+' and non-ASCII.
    ('%41' breaks delta-rs itself and '[x]' Spark's glob: both outside the merge.)"""
    warehouse = lake["root"] / "ware house #1 +é"
    warehouse.mkdir()
    t = _Lake(spark, lake["landing"], warehouse)
    t.run(H0, [ev("INSERT", 1, H0, 1, v=1), ev("INSERT", 2, H0, 2, v=2)])
    t.run(H0 + HOUR, [ev("UPDATE", 3, H0 + HOUR, 1, v=3)])  # fast: rewrites the live file
    t.run(H0 + 2 * HOUR, [ev("UPDATE", 4, H0 + 30 * MIN, 1, v=4)])  # slow: closed files
    t.check(["v"])
