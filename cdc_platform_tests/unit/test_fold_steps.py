"""The fold's steps (``history.versions``), each on a few rows: which copy of a seq counts,
and how a key's events are put in (millisecond, seq) order, imaged and stepped (docs/
HISTORY_MODE.md section 3), before the versions are drawn from the steps."""

from __future__ import annotations

from datetime import UTC, datetime

from pyspark.sql import DataFrame
from pyspark.testing import assertDataFrameEqual

from cdc_platform.lib.columns import HistoryColumns
from cdc_platform.lib.history import versions

EVENTS = (
    "id long, v string, w long, cdc_operation_type string, cdc_change_seq long, "
    "cdc_commit_timestamp timestamp, _cdc_unmodified array<string>"
)
COPIES = (
    "id long, v string, cdc_change_seq long, _cdc_ingested_at timestamp, "
    "_cdc_source_file string, _cdc_source_row long"
)
IMAGE = "struct<v:string,w:bigint>"


def at(second: int, micro: int = 0) -> datetime:
    return datetime(2026, 3, 1, 12, 0, second, micro, tzinfo=UTC)


def events(spark, rows) -> DataFrame:
    """Events as (id, v, w, op, seq, time, unmodified columns)."""
    return spark.createDataFrame(rows, EVENTS)


def steps_of(df: DataFrame, resolve_unmodified: bool = True) -> DataFrame:
    """The events through the ordering steps, the working columns named for reading."""
    return (
        df.transform(versions.fold_order, ["id"], ["v", "w"])
        .transform(versions.event_images, ["id"], ["v", "w"], resolve_unmodified)
        .transform(versions.millisecond_steps, ["id"])
        .toDF("id", "ms", "has_image", "ends_deleted", "img")
    )


def test_dedupe_events_keeps_the_first_copy_to_land_of_each_seq(spark):
    """Copies of one (key, seq): the earliest ingested wins, then the file, then the row; a
    seq shared by two keys is two events."""
    copies = spark.createDataFrame(
        [
            (1, "ingested later", 5, at(20), "a", 0),
            (1, "file b", 5, at(10), "b", 0),
            (1, "row 3", 5, at(10), "a", 3),
            (1, "row 1", 5, at(10), "a", 1),
            (1, "next seq", 6, at(30), "z", 0),
            (2, "other key", 5, at(40), "z", 9),
        ],
        COPIES,
    )
    expected = spark.createDataFrame(
        [
            (1, "row 1", 5, at(10), "a", 1),
            (1, "next seq", 6, at(30), "z", 0),
            (2, "other key", 5, at(40), "z", 9),
        ],
        COPIES,
    )
    assertDataFrameEqual(versions.dedupe_events(copies, ["id"]), expected)


def test_dedupe_events_orders_by_what_the_events_carry(spark):
    """Events with no ingestion time (replayed rows, a re-sync's snapshot) tie on the file."""
    schema = "id long, cdc_change_seq long, _cdc_source_file string"
    copies = spark.createDataFrame([(1, 5, "b"), (1, 5, "a"), (1, 4, "c")], schema)
    expected = spark.createDataFrame([(1, 5, "a"), (1, 4, "c")], schema)
    assertDataFrameEqual(versions.dedupe_events(copies, ["id"]), expected)


def test_fold_order_truncates_to_the_millisecond_and_reads_the_operation(spark):
    rows = [
        (1, "a", 1, "INSERT", 1, at(1, 999), None),
        (1, None, None, "delete", 2, at(2, 1500), ["w"]),
    ]
    expected = spark.createDataFrame(
        [(1, "a", 1, 1, at(1), False, []), (1, None, None, 2, at(2, 1000), True, ["w"])],
        "id long, v string, w long, seq long, ms timestamp, del boolean, unmod array<string>",
    )
    out = versions.fold_order(events(spark, rows), ["id"], ["v", "w"])
    assertDataFrameEqual(out.toDF(*expected.columns), expected)


def test_event_images_resolve_unmodified_cells_in_millisecond_then_seq_order(spark):
    """Seq 2 is earlier by its microseconds but later by its seq in the same millisecond: it
    takes seq 1's ``w``. Seq 4 follows a delete and still takes the last image's ``w``
    (rule 1: "even if the key has been deleted since")."""
    rows = [
        (1, "b", None, "UPDATE", 2, at(1, 100), ["w"]),
        (1, "a", 7, "INSERT", 1, at(1, 900), None),
        (1, None, None, "DELETE", 3, at(2), None),
        (1, "c", None, "INSERT", 4, at(3), ["w"]),
    ]
    ordered = versions.fold_order(events(spark, rows), ["id"], ["v", "w"])
    images = versions.event_images(ordered, ["id"], ["v", "w"])
    expected = spark.createDataFrame(
        [
            (1, 1, at(1), False, ("a", 7)),
            (1, 2, at(1), False, ("b", 7)),
            (1, 3, at(2), True, ("b", 7)),  # a delete's image is never a step's
            (1, 4, at(3), False, ("c", 7)),
        ],
        f"id long, seq long, ms timestamp, del boolean, img {IMAGE}",
    )
    assertDataFrameEqual(images.toDF(*expected.columns), expected)


def test_event_images_of_events_without_unmodified_markers_are_their_own_cells(spark):
    rows = [
        (1, "a", 7, "INSERT", 1, at(1), None),
        (1, "b", None, "UPDATE", 2, at(2), None),
    ]
    ordered = versions.fold_order(events(spark, rows), ["id"], ["v", "w"])
    own = versions.event_images(ordered, ["id"], ["v", "w"], resolve_unmodified=False)
    expected = spark.createDataFrame(
        [(1, 1, at(1), False, ("a", 7)), (1, 2, at(2), False, ("b", None))],
        f"id long, seq long, ms timestamp, del boolean, img {IMAGE}",
    )
    assertDataFrameEqual(own.toDF(*expected.columns), expected)


def test_millisecond_steps_take_the_last_event_by_seq(spark):
    """Within a millisecond the seq decides, not the arrival: key 1 inserts then deletes (the
    step ends deleted and keeps the insert's image, rule 5), key 2 deletes then inserts, key
    3's later seq is its image, key 4 only deletes (no image)."""
    rows = [
        (1, None, None, "DELETE", 2, at(1), None),
        (1, "a", 1, "INSERT", 1, at(1), None),
        (2, "b", 1, "INSERT", 2, at(1), None),
        (2, None, None, "DELETE", 1, at(1), None),
        (3, "last", 2, "UPDATE", 9, at(1, 10), None),
        (3, "first", 1, "UPDATE", 8, at(1, 20), None),
        (4, None, None, "DELETE", 1, at(1), None),
    ]
    expected = spark.createDataFrame(
        [
            (1, at(1), True, True, ("a", 1)),
            (2, at(1), True, False, ("b", 1)),
            (3, at(1), True, False, ("last", 2)),
            (4, at(1), False, True, None),
        ],
        f"id long, ms timestamp, has_image boolean, ends_deleted boolean, img {IMAGE}",
    )
    assertDataFrameEqual(steps_of(events(spark, rows)), expected)


def test_openings_open_a_version_on_a_change_only(spark):
    """Rules 2 and 3: the same image again opens nothing while the key is live; a change
    does; a delete closes the key, so the same image after it opens a version again."""
    rows = [
        (1, "a", 1, "INSERT", 1, at(1), None),
        (1, "a", 1, "UPDATE", 2, at(2), None),
        (1, "b", 1, "UPDATE", 3, at(3), None),
        (1, None, None, "DELETE", 4, at(4), None),
        (1, "b", 1, "INSERT", 5, at(5), None),
    ]
    stepped = (
        events(spark, rows)
        .transform(versions.fold_order, ["id"], ["v", "w"])
        .transform(versions.event_images, ["id"], ["v", "w"])
        .transform(versions.millisecond_steps, ["id"])
    )
    opened = versions.openings(stepped, ["id"], ["v", "w"])
    out = opened.toDF("id", "ms", "has_image", "ends_deleted", "img", "live", "prev", "opens")
    expected = spark.createDataFrame(
        [
            (at(1), False, True),  # the first image opens
            (at(2), True, False),  # the same image while live: nothing (rule 2)
            (at(3), True, True),  # a change opens (rule 3)
            (at(4), True, False),  # a delete opens nothing
            (at(5), False, True),  # the same image after the delete opens again
        ],
        "ms timestamp, live boolean, opens boolean",
    )
    assertDataFrameEqual(out.select("ms", "live", "opens"), expected)


def test_openings_fold_an_untracked_change_into_the_live_version(spark):
    """Selective history: a change of ``w`` alone opens nothing, and the live version takes
    the image of its last step (its ``w`` updated in place)."""
    rows = [
        (1, "a", 1, "INSERT", 1, at(1), None),
        (1, "a", 2, "UPDATE", 2, at(2), None),
        (1, "a", 3, "UPDATE", 3, at(3), None),
        (1, "b", 3, "UPDATE", 4, at(4), None),
    ]
    stepped = (
        events(spark, rows)
        .transform(versions.fold_order, ["id"], ["v", "w"])
        .transform(versions.event_images, ["id"], ["v", "w"])
        .transform(versions.millisecond_steps, ["id"])
    )
    ignore_w = HistoryColumns(ignore=("w",))
    opened = versions.openings(stepped, ["id"], ["v", "w"], ignore_w)
    out = opened.toDF(
        "id", "ms", "has_image", "ends_deleted", "img", "live", "prev", "opens", "version"
    )
    expected = spark.createDataFrame(
        [
            (at(1), True, ("a", 3)),
            (at(2), False, ("a", 3)),
            (at(3), False, ("a", 3)),
            (at(4), True, ("b", 3)),
        ],
        f"ms timestamp, opens boolean, img {IMAGE}",
    )
    assertDataFrameEqual(out.select("ms", "opens", "img"), expected)
