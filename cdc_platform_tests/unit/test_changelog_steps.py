"""The change-log append's steps (``history.changelog``), each on a few rows: which copy of
an event is logged, which events are kept out, and how the rows are cast and laid out."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from cdc_platform.lib.history import changelog
from cdc_platform.lib.ledgers.erased_keys import ErasedKeys, key_hashes

EVENTS = (
    "id long, v string, cdc_operation_type string, cdc_change_seq long, "
    "cdc_commit_timestamp timestamp, _cdc_source_file string, _cdc_source_row long"
)
SALT = b"0123456789abcdef-unit-test-salt!"


def at(second: int) -> datetime:
    return datetime(2026, 3, 1, 12, 0, second, tzinfo=UTC)


def events(spark, rows):
    """Events of key ``id`` as (id, v, seq, second, source file, source row)."""
    return spark.createDataFrame(
        [(i, v, "UPDATE", seq, at(s), f, r) for i, v, seq, s, f, r in rows], EVENTS
    )


def test_stamped_records_when_the_batch_is_logged(spark):
    out = changelog.stamped(events(spark, [(1, "a", 1, 0, "f", 0)]), at(30))
    expected = spark.createDataFrame(
        [(1, "a", "UPDATE", 1, at(0), "f", 0, at(30))], f"{EVENTS}, _cdc_ingested_at timestamp"
    )
    assertDataFrameEqual(out, expected)


def test_without_files_drops_every_event_of_a_revoked_file(spark):
    batch = events(
        spark, [(1, "a", 1, 0, "bad", 0), (2, "b", 2, 0, "ok", 0), (3, "c", 3, 0, "bad", 1)]
    )
    assertDataFrameEqual(
        changelog.without_files(batch, {"bad", "never-landed"}),
        events(spark, [(2, "b", 2, 0, "ok", 0)]),
    )
    assertDataFrameEqual(changelog.without_files(batch, set()), batch)


def test_first_copies_keeps_each_key_and_seq_once_by_source_file_then_row(spark):
    batch = events(
        spark,
        [
            (1, "late file", 5, 0, "b.parquet", 0),
            (1, "second row", 5, 0, "a.parquet", 7),
            (1, "first row", 5, 0, "a.parquet", 2),
            (1, "another seq", 6, 1, "b.parquet", 1),
            (2, "same seq, other key", 5, 0, "b.parquet", 2),
        ],
    )
    expected = events(
        spark,
        [
            (1, "first row", 5, 0, "a.parquet", 2),
            (1, "another seq", 6, 1, "b.parquet", 1),
            (2, "same seq, other key", 5, 0, "b.parquet", 2),
        ],
    )
    assertDataFrameEqual(changelog.first_copies(batch, ["id"]), expected)


def test_first_copies_compares_every_key_column(spark):
    schema = "a long, b string, cdc_change_seq long, _cdc_source_file string, _cdc_source_row long"
    batch = spark.createDataFrame(
        [(1, "x", 9, "f", 1), (1, "x", 9, "f", 0), (1, "y", 9, "f", 2)], schema
    )
    expected = spark.createDataFrame([(1, "x", 9, "f", 0), (1, "y", 9, "f", 2)], schema)
    assertDataFrameEqual(changelog.first_copies(batch, ["a", "b"]), expected)


def test_without_events_drops_what_is_logged_already_by_key_and_seq(spark):
    batch = events(
        spark,
        [(1, "logged", 5, 0, "f", 0), (1, "new seq", 6, 1, "f", 1), (2, "new key", 5, 0, "f", 2)],
    )
    logged = spark.createDataFrame([(1, 5), (3, 7)], "id long, cdc_change_seq long")
    expected = events(spark, [(1, "new seq", 6, 1, "f", 1), (2, "new key", 5, 0, "f", 2)])
    # The join puts its columns first; ``in_schema`` orders them as the table's afterwards.
    assertDataFrameEqual(changelog.without_events(batch, logged), expected, ignoreColumnOrder=True)
    assertDataFrameEqual(changelog.without_events(batch, None), batch)


def test_without_events_drops_a_forgotten_event(spark):
    batch = events(spark, [(1, "forgotten", 5, 0, "f", 0), (1, "later", 6, 1, "f", 1)])
    forgotten = spark.createDataFrame([(1, 5)], "id long, cdc_change_seq long")
    expected = events(spark, [(1, "later", 6, 1, "f", 1)])
    assertDataFrameEqual(
        changelog.without_events(batch, forgotten), expected, ignoreColumnOrder=True
    )


def test_without_events_takes_a_ledger_key_column_the_batch_lacks_as_null(spark):
    """The ledger was keyed on (id, region) before a rekey; this batch has no region: its
    events are matched with a null region, which names no event (as in any key join), and
    the batch keeps its own columns."""
    batch = events(spark, [(1, "kept", 5, 0, "f", 0)])
    forgotten = spark.createDataFrame(
        [(1, "eu", 5), (1, None, 5)], "id long, region string, cdc_change_seq long"
    )
    assertDataFrameEqual(changelog.without_events(batch, forgotten), batch, ignoreColumnOrder=True)


def test_in_schema_casts_up_to_a_wider_table_and_fills_a_missing_column(spark):
    """The change log widened ``code`` to a string and gained ``note`` after this batch was
    read: the batch's integer is cast as the widening cast the rows already there."""
    batch = spark.createDataFrame([(1, 7), (2, None)], "id long, code int")
    table = pa.schema(
        [pa.field("note", pa.string()), pa.field("id", pa.int64()), pa.field("code", pa.string())]
    )
    expected = spark.createDataFrame(
        [(None, 1, "7"), (None, 2, None)], "note string, id long, code string"
    )
    assertDataFrameEqual(changelog.in_schema(batch, table), expected)


def test_without_erased_drops_an_erased_keys_events(spark):
    batch = events(
        spark, [(1, "a", 1, 0, "f", 0), (2, "erased", 2, 0, "f", 1), (2, "again", 3, 1, "f", 2)]
    )
    types = pa.schema([pa.field("id", pa.int64())])
    erased = ErasedKeys.of(
        {types: key_hashes({"id": pa.array([2], pa.int64())}, 1, SALT).to_pylist()}, SALT
    )
    assertDataFrameEqual(
        changelog.without_erased(batch, erased, ["id"]), events(spark, [(1, "a", 1, 0, "f", 0)])
    )
    assertDataFrameEqual(changelog.without_erased(batch, None, ["id"]), batch)


def test_into_files_splits_a_big_append_by_commit_time(spark, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(changelog, "LOG_ROWS_PER_FILE", 1)
    batch = events(
        spark, [(1, "c", 3, 30, "f", 0), (2, "a", 1, 10, "f", 1), (3, "b", 2, 20, "f", 2)]
    )
    placed = changelog.into_files(batch, 3, ["id"]).select(
        "id", F.spark_partition_id().alias("part")
    )
    expected = spark.createDataFrame([(2, 0), (3, 1), (1, 2)], "id long, part int")
    assertDataFrameEqual(placed, expected, ignoreNullable=True)
    small = changelog.into_files(batch, 0, ["id"])
    assert small.rdd.getNumPartitions() == 1
