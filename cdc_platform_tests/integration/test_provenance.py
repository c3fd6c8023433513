"""Provenance: every history version traced back to the landing rows that made it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history.provenance import EVENTS, NoHistoryError, version_sources
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.pipeline import materialize
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
T = H0 + timedelta(minutes=5)
MS = timedelta(milliseconds=1)
US = timedelta(microseconds=1)
TABLE = TableConfig(name="p", primary_key=("id",), start=H0)


def utc(t: datetime) -> datetime:
    """Spark hands timestamps back naive, in its session time zone (UTC)."""
    return t.replace(tzinfo=UTC)


def test_each_version_traces_to_its_opening_events(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    first = [
        ev("INSERT", 1, T, 1, status="new"),  # row 1
        ev("UPDATE", 2, T + 300 * US, 1, status="paid"),  # row 2: same millisecond as row 1
        ev("INSERT", 3, T, 2, status="new"),  # row 3
        ev("UPDATE", 4, T + 10 * MS, 2, status="new"),  # row 4: no change, no version
        ev("UPDATE", 5, T + 20 * MS, 2, status="sent"),  # row 5
        ev("INSERT", 6, T + 30 * MS, 3, status="x"),  # row 6: inserted and deleted at once
        ev("DELETE", 7, T + 30 * MS + 5 * US, 3),  # row 7
    ]
    write_parquet_events(landing, "p", H0, first, name="a.parquet")
    synced_1 = datetime(2024, 2, 1, tzinfo=UTC)
    materialize(spark, TABLE, landing, warehouse, [H0], synced_at=synced_1)

    # An hour later, a late file in the first folder: an event older than everything else.
    second = [ev("UPDATE", 8, H1 + MS, 1, status="done")]
    write_parquet_events(landing, "p", H1, second, name="b.parquet")
    late = [ev("INSERT", 9, T - timedelta(days=1), 2, status="born")]
    write_parquet_events(landing, "p", H0, late, name="late.parquet")
    synced_2 = datetime(2024, 2, 2, tzinfo=UTC)
    materialize(spark, TABLE, landing, warehouse, [H0, H1], synced_at=synced_2)

    a = "p/year=2024/month=01/day=01/hour=00/a.parquet"
    b = "p/year=2024/month=01/day=01/hour=01/b.parquet"
    old = "p/year=2024/month=01/day=01/hour=00/late.parquet"
    rows = version_sources(HistoryTable(spark, TABLE, warehouse)).collect()
    got = {
        (r["id"], utc(r["_fivetran_start"])): [
            (
                e["cdc_change_seq"],
                e["cdc_operation_type"],
                e["_cdc_source_file"],
                e["_cdc_source_row"],
                utc(e["_cdc_ingested_at"]),
            )
            for e in r[EVENTS]
        ]
        for r in rows
    }
    ms = T.replace(microsecond=0)
    assert got == {
        (1, ms): [(1, "INSERT", a, 1, synced_1), (2, "UPDATE", a, 2, synced_1)],
        (1, H1 + MS): [(8, "UPDATE", b, 1, synced_2)],
        (2, ms - timedelta(days=1)): [(9, "INSERT", old, 1, synced_2)],
        (2, ms): [(3, "INSERT", a, 3, synced_1)],
        (2, ms + 20 * MS): [(5, "UPDATE", a, 5, synced_1)],
        (3, ms + 30 * MS): [(6, "INSERT", a, 6, synced_1), (7, "DELETE", a, 7, synced_1)],
    }

    # Narrowed to some keys, the lookup reads only those.
    keys = spark.createDataFrame([(3,)], "id long")
    narrowed = version_sources(HistoryTable(spark, TABLE, warehouse), keys).collect()
    assert [(r["id"], len(r[EVENTS]), r["_fivetran_active"]) for r in narrowed] == [(3, 2, False)]


def test_a_table_never_materialized_says_so(spark, lake):
    with pytest.raises(NoHistoryError, match="materialize it first"):
        version_sources(HistoryTable(spark, TABLE, lake["warehouse"]))
