"""A file that widens a column's type widens the table's column (never narrows, never drops);
a narrower or late file of the old type is cast up; an incompatible type is still set aside.
On real Delta tables: the change log, the history table, its side tables and the current
table all take the wider type, every value kept, and the merge goes on from its watermark."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pyarrow as pa
import pytest

from cdc_platform.lib.columns import TS_TYPE
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import current_table, invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.schema import widest
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, normalize, write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
TABLE = TableConfig(name="w", primary_key=("id",), start=H0)
TMAX = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
MS = timedelta(milliseconds=1)
CDC = [
    pa.field("cdc_operation_type", pa.string()),
    pa.field("cdc_change_seq", pa.int64()),
    pa.field("cdc_commit_timestamp", TS_TYPE),
]
OLD = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("price", pa.decimal128(10, 2)),
        pa.field("day", pa.date32()),
        pa.field("code", pa.int64()),
        *CDC,
    ]
)
NEW = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("price", pa.decimal128(12, 3)),
        pa.field("day", TS_TYPE),
        pa.field("code", pa.string()),
        *CDC,
    ]
)
COLUMNS = ["id", "price", "day", "code", "_fivetran_start", "_fivetran_end", "_fivetran_active"]


def at(hour: datetime, minute: int) -> datetime:
    return hour + timedelta(minutes=minute)


def midnight(d: date) -> datetime:
    return datetime(d.year, d.month, d.day, tzinfo=UTC)


@pytest.mark.parametrize(
    ("a", "b", "wider"),
    [
        (pa.decimal128(10, 2), pa.decimal128(12, 2), pa.decimal128(12, 2)),
        (pa.decimal128(10, 4), pa.decimal128(12, 2), pa.decimal128(14, 4)),
        (pa.decimal128(38, 0), pa.decimal128(38, 2), None),  # 40 digits: no decimal holds both
        (pa.date32(), TS_TYPE, TS_TYPE),
        (pa.int64(), pa.string(), pa.string()),
        (pa.float64(), pa.string(), pa.string()),
        (pa.bool_(), pa.string(), pa.string()),
        (TS_TYPE, pa.string(), pa.string()),
        (pa.date32(), pa.string(), pa.string()),
        (pa.int64(), pa.float64(), None),  # not lossless for large integers
        (pa.int64(), pa.bool_(), None),
        (pa.binary(), pa.string(), None),
        (pa.list_(pa.int64()), pa.string(), None),
        (pa.int64(), pa.date32(), None),
    ],
)
def test_the_widening_rules_are_symmetric(a, b, wider):
    assert widest(a, b) == wider and widest(b, a) == wider


def test_a_wider_file_widens_every_table_and_keeps_every_value(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, TABLE.name)
    d1, d2 = date(2024, 1, 2), date(2024, 1, 3)
    hour0 = [
        ev("INSERT", 1, at(H0, 1), 1, price=Decimal("1.50"), day=d1, code=7),
        ev("INSERT", 2, at(H0, 2), 2, price=Decimal("2.00"), day=d1, code=8),
        ev("DELETE", 3, at(H0, 3), 3),  # a key with no version: the side table holds it
    ]
    write_parquet_events(landing, TABLE.name, H0, hour0, schema=OLD)
    materialize(spark, TABLE, landing, warehouse, [H0])
    current_table.refresh(HistoryTable(spark, TABLE, warehouse))

    # Key 1: the same values in the wider types (no new version). Key 2: a real change.
    hour1 = [
        ev("UPDATE", 10, at(H1, 1), 1, price=Decimal("1.500"), day=midnight(d1), code="7"),
        ev("UPDATE", 11, at(H1, 2), 2, price=Decimal("2.125"), day=at(H1, 0), code="x-8"),
    ]
    write_parquet_events(landing, TABLE.name, H1, hour1, schema=NEW, name="wide.parquet")
    out = materialize(spark, TABLE, landing, warehouse, [H1])
    assert out.quarantined == ()
    # The change log was rewritten in the wider types: every key is recomputed, this once.
    assert out.merge.keys_affected == 3

    wide = {"price": pa.decimal128(12, 3), "day": TS_TYPE, "code": pa.string()}
    for table in (paths.changelog, paths.history):
        schema = delta.table_arrow_schema(delta.open_table(table))
        assert {n: schema.field(n).type for n in wide} == wide, table
    assert normalize(history_rows(paths.history), COLUMNS) == [
        (1, Decimal("1.500"), midnight(d1), "7", at(H0, 1), TMAX, True),
        (2, Decimal("2.000"), midnight(d1), "8", at(H0, 2), at(H1, 2) - MS, False),
        (2, Decimal("2.125"), at(H1, 0), "x-8", at(H1, 2), TMAX, True),
    ]

    # A late file of the old types is cast up, not set aside; key 3 (delete-only) comes back
    # only if its insert is later than its delete: this one is earlier, so it stays away.
    late = [
        ev("UPDATE", 20, at(H0, 30), 1, price=Decimal("9.99"), day=d2, code=9),
        ev("INSERT", 21, at(H0, 0), 3, price=Decimal("3.00"), day=d2, code=3),
    ]
    write_parquet_events(landing, TABLE.name, H0, late, schema=OLD, name="late.parquet")
    out = materialize(spark, TABLE, landing, warehouse, [H0])
    assert out.quarantined == () and out.events_new == 2
    assert out.merge.keys_affected == 2  # from the watermark again
    ones = [r for r in normalize(history_rows(paths.history), COLUMNS) if r[0] in (1, 3)]
    assert len(ones) == 4 and set(ones) == {
        (1, Decimal("1.500"), midnight(d1), "7", at(H0, 1), at(H0, 30) - MS, False),
        (1, Decimal("9.990"), midnight(d2), "9", at(H0, 30), at(H1, 1) - MS, False),
        (1, Decimal("1.500"), midnight(d1), "7", at(H1, 1), TMAX, True),
        (3, Decimal("3.000"), midnight(d2), "3", at(H0, 0), at(H0, 3), False),
    }
    current_table.refresh(HistoryTable(spark, TABLE, warehouse))  # built in the old types: widened
    schema = delta.table_arrow_schema(delta.open_table(paths.current))
    assert {n: schema.field(n).type for n in wide} == wide
    current = delta.read_arrow(paths.current).to_pylist()
    assert sorted((r["id"], r["code"]) for r in current) == [(1, "7"), (2, "x-8")]
    outcomes = invariants.run_checks(spark, paths, TABLE.key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]

    # Narrowing back is not a change of type: a file with the old types is cast up, and a
    # type that neither widens nor is widened (binary against a string) is set aside.
    clash = pa.schema([pa.field("id", pa.int64()), pa.field("code", pa.binary()), *CDC])
    write_parquet_events(
        landing, TABLE.name, H2, [ev("UPDATE", 30, at(H2, 1), 1, code=b"7")], clash, "b.parquet"
    )
    out = materialize(spark, TABLE, landing, warehouse, [H2])
    (q,) = out.quarantined
    assert "column 'code' has type binary in this file but string in the table" in q.reason


def test_a_primary_key_column_widens_only_when_the_table_allows_it(spark, lake):
    """One file with the key as text widened the key for good (change log, history, current
    table): by default (``widen_types: data``) it is set aside, saying how to accept it; with
    ``widen_types: all`` the same hour read again widens the key."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, TABLE.name)
    narrow = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.int64()), *CDC])
    wide = pa.schema([pa.field("id", pa.string()), pa.field("v", pa.int64()), *CDC])
    write_parquet_events(
        landing,
        TABLE.name,
        H0,
        [ev("INSERT", 1, at(H0, 1), 1, v=1), ev("DELETE", 2, at(H0, 2), 2)],
        schema=narrow,
    )
    materialize(spark, TABLE, landing, warehouse, [H0])
    write_parquet_events(
        landing,
        TABLE.name,
        H1,
        [ev("INSERT", 3, at(H1, 1), "A-1", v=5), ev("UPDATE", 4, at(H1, 2), "1", v=2)],
        schema=wide,
    )
    out = materialize(spark, TABLE, landing, warehouse, [H1])
    (q,) = out.quarantined
    assert "column 'id' has type string in this file but int64 in the table" in q.reason
    assert "set `widen_types: all`" in q.reason
    assert delta.table_arrow_schema(delta.open_table(paths.changelog)).field("id").type == (
        pa.int64()
    )
    materialize(spark, replace(TABLE, widen_types="all"), landing, warehouse, [H1])
    for table in (paths.changelog, paths.history, paths.delete_only_keys):
        assert delta.table_arrow_schema(delta.open_table(table)).field("id").type == pa.string()
    assert [r["id"] for r in delta.read_arrow(paths.delete_only_keys).to_pylist()] == ["2"]
    assert normalize(history_rows(paths.history), ["id", "v", "_fivetran_active"]) == [
        ("1", 1, False),
        ("1", 2, True),
        ("A-1", 5, True),
    ]
    outcomes = invariants.run_checks(spark, paths, TABLE.key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]


def test_an_append_narrower_than_the_change_log_is_cast_up(spark, lake):
    """A batch read before another run widened the log (a race) is appended with the log's
    types, cast by Arrow as the widening cast the rows already there: no file of the old type
    lands in the widened table."""
    import pyarrow.parquet as pq

    from cdc_platform.lib.history import changelog

    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, TABLE.name)
    narrow = pa.schema([pa.field("id", pa.int64()), pa.field("code", pa.int64()), *CDC])
    wide = pa.schema([pa.field("id", pa.int64()), pa.field("code", pa.string()), *CDC])
    write_parquet_events(
        landing, TABLE.name, H0, [ev("INSERT", 1, at(H0, 1), 1, code="x")], schema=wide
    )
    materialize(spark, TABLE, landing, warehouse, [H0])
    batch = pa.table(
        {
            "id": [2],
            "code": pa.array([7], pa.int64()),
            "cdc_operation_type": ["INSERT"],
            "cdc_change_seq": [2],
            "cdc_commit_timestamp": pa.array([at(H0, 2)], TS_TYPE),
            "_cdc_source_file": ["w/raced.parquet"],
            "_cdc_source_row": [0],
        },
        schema=pa.schema(
            [
                *narrow,
                pa.field("_cdc_source_file", pa.string()),
                pa.field("_cdc_source_row", pa.int64()),
            ]
        ),
    )
    raced = changelog.Batch(spark.createDataFrame(batch), ["id"], (2, 2), 1, H1)
    out = changelog.append(spark, paths.changelog, raced)
    assert out.new_events == 1
    files = delta.absolute_paths(
        paths.changelog, delta.snapshot_files(delta.open_table(paths.changelog))
    )
    assert {pq.read_schema(f).field("code").type for f in files} == {pa.string()}
    assert sorted((r["id"], r["code"]) for r in delta.read_arrow(paths.changelog).to_pylist()) == [
        (1, "x"),
        (2, "7"),
    ]
