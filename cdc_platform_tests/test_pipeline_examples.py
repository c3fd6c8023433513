"""The seeds' worked examples, through the real pipeline: Spark, change log, Delta on disk."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import TMAX
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.warehouse import TablePaths
from cdc_platform_tests.helpers import history_rows, write_parquet_events

H0 = datetime(2020, 1, 1, 0, tzinfo=UTC)
MS = timedelta(milliseconds=1)


def _table(name: str, pk: str = "id") -> TableConfig:
    return TableConfig(name=name, primary_key=(pk,), start=H0)


def test_seed_001_abc_example_with_delete(spark, lake):
    """seeds/001: a and b inserted, a updated and c inserted a day later, b deleted on day 3."""
    t = _table("abc")
    d1, d2, d3 = H0, H0 + timedelta(days=1), H0 + timedelta(days=2)
    ev = lambda op, seq, ts, id_, counter: {  # noqa: E731
        "id": id_,
        "counter": counter,
        "cdc_operation_type": op,
        "cdc_change_seq": seq,
        "cdc_commit_timestamp": ts,
    }
    write_parquet_events(
        lake["landing"], "abc", d1, [ev("INSERT", 1, d1, "a", 10), ev("INSERT", 2, d1, "b", 20)]
    )
    write_parquet_events(
        lake["landing"],
        "abc",
        d2,
        [ev("UPDATE", 3, d2, "a", 30), ev("UPDATE", 4, d1, "b", 20), ev("INSERT", 5, d2, "c", 40)],
    )
    write_parquet_events(lake["landing"], "abc", d3, [ev("DELETE", 6, d3, "b", None)])

    for hour in (d1, d2, d3):
        materialize(spark, t, lake["landing"], lake["warehouse"], [hour])

    rows = history_rows(TablePaths.of(lake["warehouse"], "abc").history)
    expected = [
        {
            "id": "a",
            "counter": 10,
            "_fivetran_start": d1,
            "_fivetran_end": d2 - MS,
            "_fivetran_active": False,
        },
        {
            "id": "a",
            "counter": 30,
            "_fivetran_start": d2,
            "_fivetran_end": TMAX,
            "_fivetran_active": True,
        },
        {
            "id": "b",
            "counter": 20,
            "_fivetran_start": d1,
            "_fivetran_end": d3,
            "_fivetran_active": False,
        },
        {
            "id": "c",
            "counter": 40,
            "_fivetran_start": d2,
            "_fivetran_end": TMAX,
            "_fivetran_active": True,
        },
    ]
    key = lambda r: (r["id"], r["_fivetran_start"])  # noqa: E731
    assert sorted(rows, key=key) == sorted(expected, key=key)
