"""Each edge case of real CDC, bad input, idempotence and readability, through the pipeline."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history.versions import TMAX
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    CDC_FIELDS,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import reference_history

H0 = datetime(2024, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)
TABLE = TableConfig(name="t", primary_key=("id",), start=H0)


def run(spark, lake, hours, table: TableConfig = TABLE):
    return materialize(spark, table, lake["landing"], lake["warehouse"], hours)


def table_path(lake, name: str = "t") -> Path:
    return TablePaths.of(lake["warehouse"], name).history.path


def assert_matches_reference(lake, events, columns, name: str = "t") -> None:
    expected = reference_history(events, ["id"])
    cols = ["id", *columns, "_fivetran_start", "_fivetran_end", "_fivetran_active"]
    assert normalize(history_rows(table_path(lake, name)), cols) == normalize(expected, cols)


def test_duplicates_same_ms_update_first_and_unknown_deletes(spark, lake):
    t1 = H0 + timedelta(minutes=5, microseconds=250)
    events = [
        ev("UPDATE", 10, t1, 1, name="first-seen-as-update"),  # UPDATE before INSERT
        ev("insert", 11, t1 + timedelta(microseconds=400), 1, name="same-ms-1"),  # same millisecond
        ev("UPDATE", 12, t1 + timedelta(microseconds=700), 1, name="same-ms-2"),
        ev("DELETE", 13, t1 + timedelta(minutes=1), 99),  # delete of a key never seen
        ev("INSERT", 14, t1 + timedelta(minutes=2), 2, name="b"),
        ev("DELETE", 15, t1 + timedelta(minutes=2), 2),  # insert + delete in one ms: start = end
        ev(
            "UPDATE", 16, t1 + timedelta(minutes=3), 1, name="same-ms-2"
        ),  # visibly identical: no-op
    ]
    write_parquet_events(lake["landing"], "t", H0, events[:4])
    write_parquet_events(lake["landing"], "t", H0, events[2:])  # seq 12 and 13 delivered twice
    result = run(spark, lake, [H0])
    assert result.events_read == 9 and result.events_new == 7
    assert_matches_reference(lake, events, ["name"])
    rows = {(r["id"], r["_fivetran_start"]): r for r in history_rows(table_path(lake))}
    ms = lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000)  # noqa: E731
    assert rows[(1, ms(t1))]["name"] == "same-ms-2"
    assert rows[(1, ms(t1))]["_fivetran_active"] is True
    b = rows[(2, ms(t1 + timedelta(minutes=2)))]
    assert b["_fivetran_start"] == b["_fivetran_end"] and b["_fivetran_active"] is False
    assert 99 not in {k for k, _ in rows}


def test_late_file_in_old_folder_and_events_from_earlier_hours(spark, lake):
    e1 = ev("INSERT", 1, H0 + timedelta(minutes=1), 1, v=1)
    e3 = ev("UPDATE", 3, H0 + timedelta(hours=2, minutes=1), 1, v=3)
    late = ev("UPDATE", 2, H0 + timedelta(hours=1, minutes=1), 1, v=2)  # committed hour 1
    write_parquet_events(lake["landing"], "t", H0, [e1])
    write_parquet_events(lake["landing"], "t", H0 + timedelta(hours=2), [e3])
    run(spark, lake, [H0 + timedelta(hours=2)])  # out of order on purpose
    run(spark, lake, [H0])
    # The late event lands in hour 4's folder (a folder's hour is not the commit hour) ...
    write_parquet_events(lake["landing"], "t", H0 + timedelta(hours=4), [late])
    run(spark, lake, [H0 + timedelta(hours=4)])
    # ... and another copy in hour 0's folder, which was already materialized.
    write_parquet_events(lake["landing"], "t", H0, [late])
    run(spark, lake, [H0])
    assert_matches_reference(lake, [e1, late, e3], ["v"])
    assert [
        r["v"] for r in sorted(history_rows(table_path(lake)), key=lambda r: r["_fivetran_start"])
    ] == [1, 2, 3]


def test_columns_appear_and_disappear(spark, lake):
    early = [
        ev("INSERT", 1, H0, 1, name="a", fax="555"),
        ev("INSERT", 2, H0, 2, name="b", fax="556"),
    ]
    later = [
        ev("UPDATE", 3, H0 + timedelta(hours=1), 1, name="a", points=10)
    ]  # fax gone, points new
    write_parquet_events(lake["landing"], "t", H0, early)
    write_parquet_events(lake["landing"], "t", H0 + timedelta(hours=1), later)
    run(spark, lake, [H0])
    run(spark, lake, [H0 + timedelta(hours=1)])
    schema = DeltaTable(str(table_path(lake))).schema().to_arrow()
    assert {"name", "fax", "points"} <= set(schema.names)  # columns are added, never dropped
    assert_matches_reference(lake, early + later, ["name", "fax", "points"])


def test_empty_and_missing_hour_folders_change_nothing(spark, lake):
    hour_folder(lake["landing"], "t", H0).mkdir(parents=True)  # empty folder
    result = run(spark, lake, [H0, H0 + timedelta(hours=1)])  # second one does not exist
    assert result.files_read == 0 and result.merge.history_version is None
    assert not table_path(lake).exists()
    write_parquet_events(
        lake["landing"], "t", H0 + timedelta(hours=2), [ev("INSERT", 1, H0, 1, v=1)]
    )
    run(spark, lake, [H0 + timedelta(hours=2)])
    version = DeltaTable(str(table_path(lake))).version()
    run(spark, lake, [H0 + timedelta(hours=3)])
    assert DeltaTable(str(table_path(lake))).version() == version


def test_rematerializing_without_new_files_changes_no_row(spark, lake):
    write_parquet_events(
        lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1), ev("UPDATE", 2, H0 + MS, 1, v=2)]
    )
    run(spark, lake, [H0])
    dt = DeltaTable(str(table_path(lake)))
    before_version, before = dt.version(), history_rows(table_path(lake), drop=())
    again = run(spark, lake, [H0])
    assert again.events_new == 0 and again.merge.keys_affected == 0
    assert DeltaTable(str(table_path(lake))).version() == before_version
    assert history_rows(table_path(lake), drop=()) == before  # _fivetran_synced too


def test_synced_kept_for_unchanged_versions(spark, lake):
    write_parquet_events(
        lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1), ev("INSERT", 2, H0, 2, v=1)]
    )
    first = run(spark, lake, [H0])
    write_parquet_events(
        lake["landing"],
        "t",
        H0 + timedelta(hours=1),
        [ev("UPDATE", 3, H0 + timedelta(hours=1), 1, v=2)],
    )
    second = run(spark, lake, [H0 + timedelta(hours=1)])
    rows = {(r["id"], r["v"]): r for r in history_rows(table_path(lake), drop=())}
    assert rows[(2, 1)]["_fivetran_synced"] == first.synced_at  # untouched key
    assert rows[(1, 1)]["_fivetran_synced"] == second.synced_at  # its end changed: rewritten
    assert rows[(1, 2)]["_fivetran_synced"] == second.synced_at
    assert second.merge.versions_opened == 1 and second.merge.versions_closed == 1
    assert second.merge.keys_affected == 1


@pytest.mark.parametrize(
    ("bad_rows", "reason"),
    [
        ([ev("INSERT", 5, H0, None, v=1)], "row 2: primary key column 'id' is null"),
        (
            [ev("UPSERT", 5, H0, 7, v=1)],
            "row 2: cdc_operation_type 'UPSERT' is not INSERT, UPDATE or DELETE",
        ),
        ([ev("INSERT", None, H0, 7, v=1)], "row 2: cdc_change_seq is missing"),
        ([ev("INSERT", 5, None, 7, v=1)], "row 2: cdc_commit_timestamp is missing"),
    ],
    ids=["null-key", "unknown-op", "missing-seq", "missing-timestamp"],
)
def test_bad_rows_set_the_whole_file_aside(spark, lake, bad_rows, reason):
    good = write_parquet_events(
        lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1)], name="good.parquet"
    )
    rows = [ev("INSERT", 4, H0, 4, v=4), *bad_rows]
    bad = write_parquet_events(lake["landing"], "t", H0, rows, name="bad.parquet")
    before = bad.read_bytes()
    result = run(spark, lake, [H0])
    assert [q.file for q in result.quarantined] == [
        "t/year=2024/month=01/day=01/hour=00/bad.parquet"
    ]
    assert result.quarantined[0].reason == reason and result.quarantined[0].row == 2
    assert {r["id"] for r in history_rows(table_path(lake))} == {1}  # key 4 not half-applied
    assert bad.read_bytes() == before and good.exists()
    assert [
        q.file for q in quarantine.current(TablePaths.of(lake["warehouse"], "t").quarantine)
    ] == [result.quarantined[0].file]
    # Re-delivered, fixed: the file comes in and leaves the quarantine.
    write_parquet_events(
        lake["landing"], "t", H0, [ev("INSERT", 4, H0, 4, v=4)], name="bad.parquet"
    )
    fixed = run(spark, lake, [H0])
    assert not fixed.quarantined and fixed.events_new == 1
    assert {r["id"] for r in history_rows(table_path(lake))} == {1, 4}
    assert quarantine.current(TablePaths.of(lake["warehouse"], "t").quarantine) == []


def test_not_parquet_and_type_clash_are_set_aside(spark, lake):
    write_parquet_events(lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1)])
    folder = hour_folder(lake["landing"], "t", H0)
    (folder / "notes.parquet").write_text("this is not parquet")
    (folder / "_SUCCESS").write_text("")  # markers are not data
    run(spark, lake, [H0])
    write_parquet_events(
        lake["landing"], "t", H0 + timedelta(hours=1), [ev("UPDATE", 2, H0 + MS, 1, v=True)]
    )
    result = run(spark, lake, [H0 + timedelta(hours=1)])
    reasons = {
        q.file.rsplit("/", 1)[1]: q.reason
        for q in quarantine.current(TablePaths.of(lake["warehouse"], "t").quarantine)
    }
    assert reasons["notes.parquet"].startswith("not a readable Parquet file")
    assert (
        "column 'v' has type bool in this file but int64 in the table, and neither widens"
        in result.quarantined[0].reason
    )
    assert [r["v"] for r in history_rows(table_path(lake))] == [1]


def test_tables_are_standard_delta_for_other_readers(spark, lake):
    events = [
        ev("INSERT", 1, H0, 1, v=1.5, s="x"),
        ev("UPDATE", 2, H0 + timedelta(hours=1), 1, v=2.5, s="y"),
    ]
    write_parquet_events(lake["landing"], "t", H0, events)
    run(spark, lake, [H0])
    path = table_path(lake)
    log = [
        json.loads(line)
        for line in (path / "_delta_log" / "00000000000000000000.json").read_text().splitlines()
    ]
    protocol = next(a["protocol"] for a in log if "protocol" in a)
    assert protocol["minReaderVersion"] == 1
    dt = DeltaTable(str(path))
    for f in dt.file_uris():
        meta = pq.read_metadata(f)
        assert not any(
            meta.schema.column(i).physical_type == "INT96" for i in range(meta.num_columns)
        )
    adds = [
        json.loads(line)["add"]
        for p in sorted((path / "_delta_log").glob("*.json"))
        for line in p.read_text().splitlines()
        if '"add"' in line
    ]
    # One file per segment: the closed version and the live one, each with exact statistics,
    # so `WHERE _fivetran_active` skips the closed file from its min/max alone.
    stats = sorted(
        (json.loads(a["stats"]) for a in adds), key=lambda s: s["minValues"]["_fivetran_start"]
    )
    closed, live = stats
    assert (closed["numRecords"], live["numRecords"]) == (1, 1)
    assert closed["minValues"]["_fivetran_start"] == "2024-01-01T00:00:00.000Z"
    assert closed["maxValues"]["_fivetran_active"] is False
    assert live["minValues"]["_fivetran_active"] is True
    assert live["maxValues"]["_fivetran_end"] == "9999-12-31T23:59:59.999Z"
    polars_rows = pl.read_delta(str(path)).sort("_fivetran_start")
    assert polars_rows["v"].to_list() == [1.5, 2.5]
    assert polars_rows["_fivetran_end"].to_list()[1].year == 9999
    dataset = dt.to_pyarrow_dataset()  # noqa: F841 (read by DuckDB below)
    relation = duckdb.sql("select s from dataset where _fivetran_active")
    assert relation is not None  # a query, so a relation
    assert relation.fetchall() == [("y",)]
    assert history_rows(path)[-1]["_fivetran_end"] == TMAX


# -- plain Parquet through Spark's own reader ---------------------------------------------------


def test_plain_normalized_parquet_is_read_natively_and_gives_the_same_events(spark, lake):
    """A plain Parquet file already in the normalized types is validated in Spark SQL and read
    by Spark's vectorized reader (no Python decoding); a file needing conversion (int32, ms
    timestamps, naive data timestamps) is decoded in Python; both give the same events as
    decoding everything in Python, and a bad native file is set aside with the same reason."""
    from cdc_platform.lib.landing.reading.file_reader import LandingReader
    from cdc_platform.lib.landing.reading.passes import (
        event_schema,
        inspect_files,
        read_events,
        unify_schema,
    )

    t1 = H0 + timedelta(minutes=1, microseconds=7)
    rows = [
        ev("insert", 1, t1, 1, name="a", at=datetime(2024, 1, 1, 3, tzinfo=UTC)),
        ev("Update", 2, t1 + MS, 1, name="b", at=None),
        ev("DELETE", 3, t1 + 2 * MS, 1),
        ev("INSERT", 4, t1, 2, name="c", at=datetime(2024, 1, 1, 4, tzinfo=UTC)),
    ]
    native_schema = pa.schema(
        [
            pa.field("id", pa.int64()),
            pa.field("name", pa.string()),
            pa.field("at", pa.timestamp("us")),  # naive: UTC, read as is by Spark
            pa.field("cdc_operation_type", pa.string()),
            pa.field("cdc_change_seq", pa.int64()),
            pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
        ]
    )
    converted_schema = pa.schema(
        [
            pa.field("id", pa.int32()),
            pa.field("name", pa.string()),
            pa.field("at", pa.timestamp("ms")),
            pa.field("cdc_operation_type", pa.string()),
            pa.field("cdc_change_seq", pa.int32()),
            pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
        ]
    )
    later = [{**r, "cdc_change_seq": r["cdc_change_seq"] + 10} for r in rows]
    write_parquet_events(lake["landing"], "t", H0, rows, native_schema, name="plain.parquet")
    write_parquet_events(lake["landing"], "t", H0, later, converted_schema, name="conv.parquet")
    bad = [*rows[:2], ev("upsert", 99, t1, 3, name="x"), ev("INSERT", 98, None, 4)]
    write_parquet_events(lake["landing"], "t", H0, bad, native_schema, name="bad.parquet")

    reader = LandingReader(TABLE, lake["landing"])
    folder = hour_folder(lake["landing"], "t", H0)
    paths = sorted(str(p) for p in folder.iterdir())
    native = inspect_files(spark, reader, paths)
    python = inspect_files(spark, reader, paths, native=False)
    by_name = {Path(r.path).name: r for r in native}
    assert by_name["plain.parquet"].native and by_name["plain.parquet"].source_uri
    assert not by_name["conv.parquet"].native
    # The same verdicts, counts and reasons either way, the bad row named by file and row.
    assert [
        (r.num_rows, r.error, r.error_row, r.bad_rows, r.seq_min, r.seq_max) for r in native
    ] == [(r.num_rows, r.error, r.error_row, r.bad_rows, r.seq_min, r.seq_max) for r in python]
    assert by_name["bad.parquet"].error == (
        "row 3: cdc_operation_type 'UPSERT' is not INSERT, UPDATE or DELETE (2 bad rows in all)"
    )

    good = [r for r in native if r.ok]
    schema = event_schema(unify_schema(None, good)[0])
    uris = {r.path: r.source_uri for r in good if r.native and r.source_uri}
    both = read_events(spark, reader, [r.path for r in good], schema, uris).collect()
    decoded = read_events(spark, reader, [r.path for r in good], schema).collect()
    assert len(both) == 8 and sorted(both, key=repr) == sorted(decoded, key=repr)

    result = run(spark, lake, [H0])
    assert result.read_natively == ("t/year=2024/month=01/day=01/hour=00/plain.parquet",)
    assert [q.file.rsplit("/", 1)[1] for q in result.quarantined] == ["bad.parquet"]
    assert result.events_read == 8 and result.events_new == 8
    assert_matches_reference(lake, [*rows, *later], ["name", "at"])


def test_narrow_integers_floats_and_large_strings_are_read_natively(spark, lake):
    """Columns Spark's reader widens exactly as the Python decoder does (int8 to uint32 to
    int64, float32 to float64, large and dictionary strings to string) keep a plain file on
    the native path; the values and the table's types are those of decoding in Python, and
    an int32 key or a uint64 column (which may be out of range) behave as they should."""
    t1 = H0 + timedelta(minutes=1)
    rows = [
        ev("INSERT", 1, t1, 2**31 - 1, i8=-128, u32=2**32 - 1, f=0.5, s="a", d="p"),
        ev("INSERT", 2, t1, -(2**31), i8=127, u32=0, f=-2.25, s=None, d="q"),
        ev("UPDATE", 3, t1 + MS, 2**31 - 1, i8=None, u32=None, f=None, s="b", d=None),
    ]
    widened = pa.schema(
        [
            pa.field("id", pa.int32()),
            pa.field("i8", pa.int8()),
            pa.field("u32", pa.uint32()),
            pa.field("f", pa.float32()),
            pa.field("s", pa.large_string()),
            pa.field("d", pa.dictionary(pa.int32(), pa.string())),
            *CDC_FIELDS,
        ]
    )
    write_parquet_events(lake["landing"], "t", H0, rows, widened, name="narrow.parquet")
    unsigned = pa.schema([pa.field("id", pa.int64()), pa.field("big", pa.uint64()), *CDC_FIELDS])
    big = [ev("INSERT", 4, t1, 7, big=2**63)]
    write_parquet_events(lake["landing"], "t", H0, big, unsigned, name="u64.parquet")

    result = run(spark, lake, [H0])
    assert result.read_natively == ("t/year=2024/month=01/day=01/hour=00/narrow.parquet",)
    # uint64 goes through Python, which sets a value above 2^63-1 aside, naming row and column.
    assert [(q.file.rsplit("/", 1)[1], q.row) for q in result.quarantined] == [("u64.parquet", 1)]
    assert "column 'big'" in result.quarantined[0].reason
    types = {f.name: f.type for f in DeltaTable(table_path(lake)).schema().fields}
    assert [str(types[c]) for c in ("id", "i8", "u32", "f", "s", "d")] == [
        *['PrimitiveType("long")'] * 3,
        'PrimitiveType("double")',
        *['PrimitiveType("string")'] * 2,
    ]
    assert_matches_reference(lake, rows, ["i8", "u32", "f", "s", "d"])


# -- times before the 1582 calendar change ------------------------------------------------------


def _t(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


@pytest.mark.parametrize(
    ("first", "late"),
    [
        pytest.param(  # the late version ends just before the next: it must not be cut away
            [ev("INSERT", 1, _t(100, 1, 1), 1, v=1), ev("UPDATE", 2, _t(100, 1, 5, 12), 1, v=2)],
            [ev("UPDATE", 3, _t(100, 1, 5), 1, v=3)],
            id="year-100",
        ),
        pytest.param(  # a closed version ending before the cut is not written twice
            [
                ev("INSERT", 1, _t(1500, 1, 1), 1, v=1),
                ev("DELETE", 2, _t(1500, 1, 25), 1),
                ev("INSERT", 3, _t(1500, 3, 1), 1, v=2),
            ],
            [ev("UPDATE", 4, _t(1500, 2, 1), 1, v=3)],
            id="year-1500",
        ),
    ],
)
def test_late_events_before_the_gregorian_calendar_are_cut_exactly(spark, lake, first, late):
    """The slow path's time bound reaches Spark as microseconds: ``F.lit(datetime)`` would
    move a pre-1582 bound by days (found by review: a lost version, a duplicated one)."""
    write_parquet_events(lake["landing"], "t", H0, first)
    run(spark, lake, [H0])
    write_parquet_events(lake["landing"], "t", H0 + timedelta(hours=1), late)
    result = run(spark, lake, [H0 + timedelta(hours=1)])
    assert result.merge.slow_keys == 1
    assert_matches_reference(lake, [*first, *late], ["v"])
