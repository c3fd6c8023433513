"""Malformed rows and cells, through the real pipeline: every file the pipeline cannot
process (types it cannot compare, out-of-range values, bad schemas, extreme timestamps) is set
aside with a reason naming the row and column, the rest of the hour is
applied, and nothing that reaches the change log can make a later run fail."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.storage.table import Table
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events
from cdc_platform_tests.security.pipeline_runs import (
    H0,
    H1,
    MS,
    TMAX_TS,
    paths,
    reasons,
    run,
)


def write_table(lake, hour: datetime, name: str, tbl: pa.Table, table: str = "t") -> Path:
    folder = hour_folder(lake["landing"], table, hour)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(tbl, folder / name)
    return folder / name


def cdc_arrays(ops: Sequence[str], seqs: Sequence[int], stamps: Sequence[datetime]) -> list:
    return [
        pa.array(ops, pa.string()),
        pa.array(seqs, pa.int64()),
        pa.array(stamps, pa.timestamp("us", tz="UTC")),
    ]


def test_string_commit_timestamps_mixed_zoned_naive_and_nanoseconds(spark, lake):
    stamps = [
        "2024-01-01T05:00:00Z",
        "2024-01-01T07:00:01+02:00",
        "2024-01-01 05:00:02",  # naive = UTC
        "2024-01-01T05:00:03.123456789Z",  # 9 digits: truncated to microseconds
        "2024-01-01T05:00:04.987654321",
    ]
    n = len(stamps)
    good = pa.table(
        {
            "id": [1] * n,
            "v": list(range(n)),
            "cdc_operation_type": ["INSERT"] + ["UPDATE"] * (n - 1),
            "cdc_change_seq": list(range(1, n + 1)),
            "cdc_commit_timestamp": stamps,
        }
    )
    write_table(lake, H0, "good.parquet", good)
    bad = pa.table(
        {
            "id": [2, 2, 2],
            "v": [1, 2, 3],
            "cdc_operation_type": ["INSERT", "UPDATE", "UPDATE"],
            "cdc_change_seq": [10, 11, 12],
            "cdc_commit_timestamp": ["2024-01-01T05:00:00Z", "2024-01-01 06:00:00", "soon"],
        }
    )
    write_table(lake, H0, "bad.parquet", bad)
    result = run(spark, lake, [H0])
    assert [q.row for q in result.quarantined] == [3]
    assert reasons(lake) == {
        "bad.parquet": "row 3, column 'cdc_commit_timestamp': 'soon' is not an ISO-8601 timestamp"
    }
    starts = sorted(r["_fivetran_start"] for r in history_rows(paths(lake).history))
    base = datetime(2024, 1, 1, 5, tzinfo=UTC)
    assert starts == [
        base,
        base + timedelta(seconds=1),
        base + timedelta(seconds=2),
        base + timedelta(seconds=3, milliseconds=123),
        base + timedelta(seconds=4, milliseconds=987),
    ]


BERLIN = "Europe/Berlin"


T1 = datetime(2024, 1, 1, 5, 0, 1, tzinfo=UTC)


T2 = datetime(2024, 1, 1, 5, 0, 2, 500000, tzinfo=UTC)


# name: (Arrow type, first value, second value, the two as the table stores them; None: see
# _expected)
SUPPORTED: dict[str, tuple[pa.DataType, Any, Any, tuple[Any, Any] | None]] = {
    "bool": (pa.bool_(), False, True, (False, True)),
    "int8": (pa.int8(), -1, 2, (-1, 2)),
    "int16": (pa.int16(), -1, 2, (-1, 2)),
    "int32": (pa.int32(), -1, 2, (-1, 2)),
    "int64": (pa.int64(), -(2**63), 2**63 - 1, (-(2**63), 2**63 - 1)),
    "uint8": (pa.uint8(), 1, 255, (1, 255)),
    "uint16": (pa.uint16(), 1, 65535, (1, 65535)),
    "uint32": (pa.uint32(), 1, 2**32 - 1, (1, 2**32 - 1)),
    "uint64": (pa.uint64(), 1, 2**63 - 1, (1, 2**63 - 1)),
    "float16": (pa.float16(), np.float16(1.5), np.float16(-2.5), (1.5, -2.5)),
    "float32": (pa.float32(), 1.5, 2.25, (1.5, 2.25)),
    "float64": (pa.float64(), 1.5, float("inf"), (1.5, float("inf"))),
    "dec_small": (pa.decimal128(5, 2), Decimal("1.25"), Decimal("2.50"), None),
    "dec_38": (pa.decimal128(38, 10), Decimal("1.0000000001"), Decimal("9" * 28), None),
    "dec256_20": (pa.decimal256(20, 2), Decimal("1.25"), Decimal("-3.50"), None),
    "string": (pa.string(), "a", "é", ("a", "é")),
    "large_string": (pa.large_string(), "a", "b", ("a", "b")),
    "binary": (pa.binary(), b"\x00a", b"b", (b"\x00a", b"b")),
    "large_binary": (pa.large_binary(), b"a", b"b", (b"a", b"b")),
    "fixed_binary": (pa.binary(2), b"ab", b"cd", (b"ab", b"cd")),
    "date32": (pa.date32(), date(2024, 1, 1), date(9999, 12, 31), None),
    "date64": (pa.date64(), date(2024, 1, 1), date(1, 1, 1), None),
    "time32": (pa.time32("ms"), time(5, 0, 1), time(5, 0, 2, 500000), None),
    "time64": (pa.time64("us"), time(5, 0, 1), time(5, 0, 2, 5), None),
    "ts_s": (pa.timestamp("s"), T1.replace(tzinfo=None), T1.replace(second=3, tzinfo=None), None),
    "ts_ms": (pa.timestamp("ms", tz=BERLIN), T1, T2, (T1, T2)),
    "ts_us": (pa.timestamp("us"), T1.replace(tzinfo=None), T2.replace(tzinfo=None), (T1, T2)),
    "ts_ns_tz": (pa.timestamp("ns", tz="UTC"), T1, T2, (T1, T2)),
    "list": (pa.list_(pa.int32()), [1, 2], [3], ([1, 2], [3])),
    "large_list": (pa.large_list(pa.string()), ["a"], ["b", None], (["a"], ["b", None])),
    "fixed_list": (pa.list_(pa.int32(), 2), [1, 2], [3, 4], ([1, 2], [3, 4])),
    "struct": (
        pa.struct([("a", pa.int32()), ("b", pa.string())]),
        {"a": 1, "b": "x"},
        {"a": 1, "b": "y"},
        ({"a": 1, "b": "x"}, {"a": 1, "b": "y"}),
    ),
    "list_struct": (
        pa.list_(pa.struct([("x", pa.int64())])),
        [{"x": 1}],
        [{"x": 2}],
        ([{"x": 1}], [{"x": 2}]),
    ),
    "dictionary": (pa.dictionary(pa.int32(), pa.string()), "a", "b", ("a", "b")),
    "map": (
        pa.map_(pa.int32(), pa.string()),
        [(1, "a"), (2, None)],
        [(2, None), (1, "b")],
        ([(1, "a"), (2, None)], [(2, None), (1, "b")]),
    ),
    # Durations are kept as int64 microseconds; nanoseconds floored, as timestamps' are.
    "duration_s": (pa.duration("s"), timedelta(seconds=1), timedelta(hours=2), (10**6, 72 * 10**8)),
    "duration_ns": (pa.duration("ns"), 5001, -1500, (5, -2)),
}


REJECTED: dict[str, tuple[pa.DataType, Any, str]] = {
    "struct_map": (
        pa.struct([("m", pa.map_(pa.string(), pa.int32()))]),
        {"m": [("k", 1)]},
        "a map inside a list, struct or map is not supported",
    ),
    "map_map": (
        pa.map_(pa.string(), pa.map_(pa.string(), pa.int32())),
        [("k", [("j", 1)])],
        "a map inside a list, struct or map is not supported",
    ),
    "list_duration": (
        pa.list_(pa.duration("s")),
        [timedelta(seconds=1)],
        "a duration inside a list or struct is not supported",
    ),
    "dec256_50": (pa.decimal256(50, 2), Decimal("1.25"), "decimal precision 50 is above"),
}


def _expected(name: str) -> tuple[Any, Any]:
    t, a, b, stored = SUPPORTED[name]
    if stored is not None:
        return stored
    if pa.types.is_time(t):
        return tuple(pa.array([a, b], t).cast(pa.string()).to_pylist())  # Delta has no time
    if name == "ts_s":
        return a.replace(tzinfo=UTC), b.replace(tzinfo=UTC)
    return a, b


def _one_column_file(lake, hour, name, t, values, ops, seqs, stamps, key) -> None:
    columns = [pa.array([key] * len(values), pa.int64()), pa.array(values, t)]
    tbl = pa.Table.from_arrays(
        [*columns, *cdc_arrays(ops, seqs, stamps)],
        names=["id", f"c_{name}", "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
    )
    write_table(lake, hour, f"{name}.parquet", tbl)


def test_every_arrow_type_is_kept_compared_or_set_aside(spark, lake):
    t0 = datetime(2024, 1, 1, 0, 1, tzinfo=UTC)
    for i, (name, (t, a, b, _)) in enumerate(SUPPORTED.items()):
        seqs = [100 * i + 1, 100 * i + 2, 100 * i + 3]
        ops = ["INSERT", "UPDATE", "UPDATE"]
        stamps = [t0, t0 + MS, t0 + 2 * MS]  # the third event is a no-op: no new version
        _one_column_file(lake, H0, name, t, [a, b, b], ops, seqs, stamps, key=i)
    for j, (name, (t, v, _)) in enumerate(REJECTED.items()):
        _one_column_file(lake, H0, name, t, [v], ["INSERT"], [9000 + j], [t0], key=1000 + j)
    # An all-null (untyped) column: no evidence of a type, so no column yet.
    _one_column_file(lake, H0, "null", pa.null(), [None], ["INSERT"], [8999], [t0], key=999)

    first = run(spark, lake, [H0])
    set_aside = reasons(lake)
    assert sorted(set_aside) == sorted(f"{n}.parquet" for n in REJECTED)
    for name, (_, _, why) in REJECTED.items():
        assert set_aside[f"{name}.parquet"].startswith(f"column 'c_{name}' has type ")
        assert why in set_aside[f"{name}.parquet"]
    assert first.events_new == 3 * len(SUPPORTED) + 1

    # A second hour brings every type back to its first value: no type clash with the change
    # log's own schema (nested types included), and the fold compares every type.
    t1 = t0 + timedelta(hours=1)
    for i, (name, (t, a, _, _)) in enumerate(SUPPORTED.items()):
        _one_column_file(lake, H1, name, t, [a], ["UPDATE"], [100 * i + 4], [t1], key=i)
    second = run(spark, lake, [H1])
    assert second.quarantined == ()

    rows = history_rows(paths(lake).history)
    schema = DeltaTable(str(paths(lake).history)).schema().to_arrow()
    assert "c_null" not in schema.names
    assert not any(f"c_{n}" in schema.names for n in REJECTED)
    for i, name in enumerate(SUPPORTED):
        versions = sorted((r for r in rows if r["id"] == i), key=lambda r: r["_fivetran_start"])
        first_value, second_value = _expected(name)
        assert [r[f"c_{name}"] for r in versions] == [first_value, second_value, first_value], name
        assert [r["_fivetran_active"] for r in versions] == [False, False, True], name


def test_a_parquet_interval_is_kept_as_its_twelve_bytes(spark, lake):
    """Parquet's INTERVAL (months, days, milliseconds: three little-endian unsigned 32-bit
    integers) has no Delta type: it is kept as the fixed-size binary Arrow reads it as, which
    any engine decodes (docs/history-table.md, types). DuckDB writes it, as exports do."""
    folder = hour_folder(lake["landing"], "t", H0)
    folder.mkdir(parents=True, exist_ok=True)
    duckdb.sql(
        "COPY (SELECT 1::BIGINT AS id, INTERVAL '14 months 3 days 4.5 seconds' AS wait,"
        " 'INSERT' AS cdc_operation_type, 1::BIGINT AS cdc_change_seq,"
        " TIMESTAMPTZ '2024-01-01 00:01:00+00' AS cdc_commit_timestamp)"
        f" TO '{folder / 'iv.parquet'}' (FORMAT PARQUET)"
    )
    assert run(spark, lake, [H0]).quarantined == ()
    (row,) = history_rows(paths(lake).history)
    assert struct.unpack("<III", row["wait"]) == (14, 3, 4500)


def test_a_duration_is_no_change_seq(spark, lake):
    """A data column's duration is kept as microseconds; a seq that is a duration is refused,
    not multiplied into an order it never had."""
    tbl = pa.Table.from_arrays(
        [
            pa.array([1], pa.int64()),
            pa.array(["INSERT"]),
            pa.array([5], pa.duration("s")),
            pa.array([H0], pa.timestamp("us", tz="UTC")),
        ],
        names=["id", "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
    )
    write_table(lake, H0, "seq.parquet", tbl)
    run(spark, lake, [H0])
    assert reasons(lake) == {
        "seq.parquet": "column 'cdc_change_seq' has type duration[s]: a change column is never one"
    }


def test_out_of_range_uint64_sets_the_file_aside_naming_row_and_column(spark, lake):
    write_parquet_events(lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1)], name="ok.parquet")
    big_seq = pa.Table.from_arrays(
        [
            pa.array([2, 3], pa.int64()),
            pa.array(["INSERT", "INSERT"]),
            pa.array([5, 2**63], pa.uint64()),
            pa.array([H0, H0], pa.timestamp("us", tz="UTC")),
        ],
        names=["id", "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
    )
    write_table(lake, H0, "seq.parquet", big_seq)
    big_value = pa.Table.from_arrays(
        [
            pa.array([4], pa.int64()),
            pa.array([2**64 - 1], pa.uint64()),
            *cdc_arrays(["INSERT"], [9], [H0]),
        ],
        names=["id", "w", "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
    )
    write_table(lake, H0, "value.parquet", big_value)
    long_ago = pa.Table.from_arrays(  # 2^62 seconds: no 64-bit count of microseconds holds it
        [
            pa.array([5], pa.int64()),
            pa.array([2**62], pa.duration("s")),
            *cdc_arrays(["INSERT"], [10], [H0]),
        ],
        names=["id", "d", "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
    )
    write_table(lake, H0, "duration.parquet", long_ago)
    run(spark, lake, [H0])
    assert reasons(lake) == {
        "duration.parquet": (
            "row 1, column 'd': 4611686018427387904 s is out of range (a duration is kept as"
            " 64-bit microseconds)"
        ),
        "seq.parquet": (
            "row 2, column 'cdc_change_seq': 9223372036854775808 is out of range for a 64-bit"
            " integer"
        ),
        "value.parquet": (
            "row 1, column 'w': 18446744073709551615 is out of range for a 64-bit integer"
        ),
    }
    assert [(r["id"], r["v"]) for r in history_rows(paths(lake).history)] == [(1, 1)]


def test_bad_schemas_and_extreme_timestamps_are_set_aside_the_rest_applied(spark, lake):
    def file(name: str, columns: Mapping[str, pa.Array], ts: datetime = H0, op="INSERT") -> None:
        n = len(next(iter(columns.values())))
        arrays = [*columns.values(), *cdc_arrays([op] * n, [len(name)] * n, [ts] * n)]
        names = [*columns, "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"]
        write_table(lake, H0, name, pa.Table.from_arrays(arrays, names=names))

    one = pa.array([1], pa.int64())
    file("twice.parquet", {"id": pa.array([2]), "v": one, "v ": one})  # written as 'v', 'v '
    pq.write_table(  # duplicate column names: pyarrow writes them as they are
        pa.Table.from_arrays(
            [pa.array([2]), one, one, *cdc_arrays(["INSERT"], [3], [H0])],
            names=["id", "v", "v", "cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
        ),
        hour_folder(lake["landing"], "t", H0) / "dup.parquet",
    )
    file("id_case.parquet", {"id": pa.array([3]), "Id": pa.array([4])})
    file("val_case.parquet", {"id": pa.array([3]), "val": one, "Val": one})
    file("unmodified.parquet", {"id": pa.array([5]), "_cdc_unmodified": pa.array(["v"])})
    file("source.parquet", {"id": pa.array([5]), "_cdc_source_file": pa.array(["x"])})
    at_tmax = TMAX_TS
    file("tmax.parquet", {"id": pa.array([6])}, ts=at_tmax)
    file("after_tmax.parquet", {"id": pa.array([6])}, ts=at_tmax + timedelta(microseconds=500))
    file(
        "just_before.parquet",
        {"id": pa.array([7]), "v": one},
        ts=at_tmax - timedelta(microseconds=1),
    )
    file("good.parquet", {"id": pa.array([1]), "v": one})
    write_parquet_events(  # a DELETE exactly at TMAX must not leave anything half-applied
        lake["landing"], "t", H0, [ev("DELETE", 99, TMAX_TS, 7)], name="delete_tmax.parquet"
    )

    result = run(spark, lake, [H0])
    got = reasons(lake)
    range_reason = (
        "row 1: cdc_commit_timestamp is out of range (must be before 9999-12-31T23:59:59.999Z)"
    )
    assert got == {
        "dup.parquet": "column 'v' appears twice",
        "id_case.parquet": (
            "columns 'id' and 'Id' differ only in case (Delta column names are case-insensitive)"
        ),
        "val_case.parquet": (
            "columns 'val' and 'Val' differ only in case (Delta column names are case-insensitive)"
        ),
        "unmodified.parquet": "column '_cdc_unmodified' has type string, expected list<string>",
        "source.parquet": "column '_cdc_source_file' uses a reserved system prefix (_fivetran_, _cdc_)",
        "tmax.parquet": range_reason,
        "after_tmax.parquet": range_reason,
        "delete_tmax.parquet": range_reason,
    }
    assert {q.partition for q in result.quarantined} == {"2024-01-01-00:00"}
    rows = {r["id"]: r for r in history_rows(paths(lake).history)}
    assert set(rows) == {1, 2, 7}  # good, 'v ' beside 'v', and the last valid millisecond
    assert rows[2]["v "] == 1
    assert rows[7]["_fivetran_start"] == TMAX_TS - MS and rows[7]["_fivetran_active"] is True

    # A later file whose column differs from the table's only in case is set aside too.
    write_parquet_events(
        lake["landing"], "t", H1, [ev("UPDATE", 200, H1, 1, V=2)], name="case.parquet"
    )
    run(spark, lake, [H1])
    assert reasons(lake)["case.parquet"] == (
        "column 'V' differs only in case from the table's column 'v'"
        " (Delta column names are case-insensitive)"
    )


def test_replay_without_new_events_leaves_no_empty_change_log_folder(spark, lake):
    write_parquet_events(lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1)])
    run(spark, lake, [H0])
    data = paths(lake).changelog.path / "data"
    before = sorted(os.listdir(data))
    again = run(spark, lake, [H0])
    assert again.events_new == 0
    assert sorted(os.listdir(data)) == before
    assert all(os.listdir(data / d) for d in before)


def test_pending_files_recompute_only_when_the_applied_version_was_cleaned_up(
    tmp_path, monkeypatch
):
    from deltalake import write_deltalake

    from cdc_platform.lib.history import changelog
    from cdc_platform.lib.storage import delta

    path = tmp_path / "log"
    data = pa.table({"x": [1]})
    write_deltalake(
        str(path), data, configuration={"delta.logRetentionDuration": "interval 0 seconds"}
    )
    for _ in range(3):
        write_deltalake(str(path), data, mode="append")

    def pending_files(applied_version: int) -> tuple[list[delta.DataFile], int]:
        """The log's files added after ``applied_version``, and its current version."""
        log = Table.open(path)
        assert log.version is not None
        return changelog.files_since(log, applied_version), log.version

    pending, version = pending_files(1)
    assert (len(pending), version) == (2, 3)
    real_open = delta.open_table

    def denied(table_path: Path, version: int | None = None) -> DeltaTable:
        if version is not None:
            raise PermissionError(13, "Permission denied", str(table_path))
        return real_open(table_path, version)

    monkeypatch.setattr(delta, "open_table", denied)
    with pytest.raises(PermissionError):  # any other error is raised, not "recompute all"
        pending_files(1)
    monkeypatch.setattr(delta, "open_table", real_open)
    dt = DeltaTable(str(path))
    dt.create_checkpoint()
    dt.cleanup_metadata()
    pending, version = pending_files(1)  # version 1 is gone: every file
    assert (len(pending), version) == (4, 3)
