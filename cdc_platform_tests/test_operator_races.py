"""Operator jobs against the runs beside them, and against their own inputs (issue 20, items
7 to 14): each race is driven deterministically (a real event logged between an operator's
decision and its commit, through a seam of the real code path), on real Spark and Delta.

The contract's "Nothing lost" (docs/HISTORY_MODE.md, section 5) is what each test holds: only
a user removes events, and only the events the user's decision named.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_platform import read
from cdc_platform.lib import delta, invariants
from cdc_platform.lib.adoption import AdoptionError, adopt
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.resync import ResyncError, resync
from cdc_platform.lib.timestamps import CLOCK_SKEW
from cdc_platform.lib.truncation import truncate
from cdc_platform.lib.warehouse import TablePaths
from cdc_platform_tests.helpers import write_parquet_events
from cdc_platform_tests.helpers import event as ev

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
TABLE = TableConfig(name="orders", primary_key=("id",), start=H0)
MS = timedelta(milliseconds=1)
S0, S1 = datetime(2024, 1, 2, tzinfo=UTC), datetime(2024, 1, 3, tzinfo=UTC)
T = datetime(2024, 1, 2, 12, tzinfo=UTC)  # between S0 and S1


def logged(paths: TablePaths) -> list[tuple]:
    """The change log's (key, seq), sorted."""
    rows = delta.read_arrow(paths.changelog, ["id", "cdc_change_seq"]).to_pylist()
    return sorted((r["id"], r["cdc_change_seq"]) for r in rows)


def checks_pass(spark, paths: TablePaths) -> None:
    outcomes = invariants.run_checks(spark, paths, TABLE.primary_key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]


# -- item 8: a hard truncate decides each key once, over every change-log file -------------------


def test_a_hard_truncate_keeps_every_delete_of_a_delete_only_key_logged_after_t(spark, lake):
    """Key 9 has only deletes: one logged at S0 (before T), in the change-log file that is
    rewritten because key 1 goes, and one logged at S1 (after T), in another file. The key
    stays (its last event was logged after T), so both deletes stay: deciding again over the
    rewritten file alone saw only the older delete and dropped it, uncounted and unforgotten."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    hour0 = [ev("INSERT", 1, H0 + MS, 1, status="new"), ev("DELETE", 2, H0 + 2 * MS, 9)]
    write_parquet_events(landing, TABLE.name, H0, hour0, name="h0.parquet")
    materialize(spark, TABLE, landing, warehouse, [H0], synced_at=S0)
    write_parquet_events(landing, TABLE.name, H1, [ev("DELETE", 3, H1, 9)], name="h1.parquet")
    materialize(spark, TABLE, landing, warehouse, [H1], synced_at=S1)
    paths = TablePaths.of(warehouse, TABLE.name)

    r = truncate(spark, TABLE, warehouse, T, soft=False, now=S1 + MS)
    assert (r.keys, r.events_removed) == (1, 1)  # key 1 and its one event
    assert logged(paths) == [(9, 2), (9, 3)]
    assert [k["id"] for k in delta.read_arrow(paths.delete_only_keys).to_pylist()] == [9]
    checks_pass(spark, paths)


# -- item 13: time literals are exact before 1582 ----------------------------------------------


def test_as_of_the_dawn_of_time_reads_adopted_soft_deleted_rows(spark, lake):
    """An adopted soft-deleted row is a version that starts and ends at 0001-01-01 (contract
    section 7: valid in that millisecond). ``F.lit(datetime)`` moved the instant by days, so
    Spark's ``as_of`` missed it while Arrow's found it."""
    source = lake["root"] / "export"
    source.mkdir()
    pq.write_table(
        pa.table({"id": [1, 2], "status": ["a", "gone"], "_fivetran_deleted": [False, True]}),
        source / "part-0.parquet",
    )
    adopt(spark, TABLE, lake["warehouse"], source, now=S0)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    dawn = "0001-01-01T00:00:00Z"
    spark_rows = read.as_of(paths, dawn, spark=spark).select("id", "status").collect()
    assert [tuple(r) for r in spark_rows] == [(2, "gone")]
    assert read.as_of_arrow(paths, dawn).to_table().column("id").to_pylist() == [2]


# -- item 12: operator times in the future are refused --------------------------------------------


def test_a_resync_or_an_adoption_in_the_future_is_refused(spark, lake):
    """A re-sync at 9999-01-01 (or an adopted table synced then) would put versions after every
    CDC event logged until then: the table would be stuck. Refused, as truncate refuses a
    ``before`` in the future; clock skew of up to ``CLOCK_SKEW`` is allowed."""
    warehouse = lake["warehouse"]
    paths = TablePaths.of(warehouse, TABLE.name)
    folder = lake["root"] / "snapshot"
    folder.mkdir()
    pq.write_table(pa.table({"id": [1], "status": ["a"]}), folder / "part-0.parquet")
    for at, now in [(datetime(9999, 1, 1, tzinfo=UTC), None), (S0 + CLOCK_SKEW + MS, S0)]:
        with pytest.raises(ResyncError, match="in the future"):
            resync(
                spark,
                TABLE,
                lake["landing"],
                warehouse,
                folder,
                at,
                now=now,
                snapshot_roots=[lake["root"]],
            )
    source = lake["root"] / "export"
    source.mkdir()
    synced = pa.array([datetime(9999, 1, 1, tzinfo=UTC)], pa.timestamp("us", tz="UTC"))
    pq.write_table(
        pa.table({"id": [1], "status": ["a"], "_fivetran_synced": synced}),
        source / "part-0.parquet",
    )
    with pytest.raises(AdoptionError, match="_fivetran_synced is 9999-01-01.*in the future"):
        adopt(spark, TABLE, warehouse, source, now=S0)
    assert not delta.exists(paths.changelog)  # nothing was written
