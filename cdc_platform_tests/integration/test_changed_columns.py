"""`_cdc_changed_columns`: what changed in each version, right on the fast and the slow path."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import invariants
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events
from cdc_platform_tests.reference import changed_columns

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
TABLE = TableConfig(name="c", primary_key=("id",), start=H0)


def changed(path) -> dict[tuple[int, datetime], list[str] | None]:
    return {
        (r["id"], r["_fivetran_start"]): r["_cdc_changed_columns"]
        for r in history_rows(path, drop=())
    }


def test_changed_columns_follow_fast_path_and_late_events(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, "c")
    t = [H0 + timedelta(minutes=m) for m in range(10)]
    write_parquet_events(
        landing,
        "c",
        H0,
        [
            ev("INSERT", 1, t[1], 1, status="new", amount=10.0, note=None),
            ev("UPDATE", 2, t[3], 1, status="paid", amount=10.0, note=None),
        ],
    )
    materialize(spark, TABLE, landing, warehouse, [H0])
    assert changed(paths.history) == {(1, t[1]): None, (1, t[3]): ["status"]}

    # In order (the fast path): a null set, two columns at once, a delete, a re-insert with the
    # deleted image (a new version; nothing differs from the version before it).
    u = [H1 + timedelta(minutes=m) for m in range(10)]
    write_parquet_events(
        landing,
        "c",
        H1,
        [
            ev("UPDATE", 10, u[1], 1, status="paid", amount=10.0, note="x"),
            ev("UPDATE", 11, u[2], 1, status="done", amount=None, note="x"),
            ev("DELETE", 12, u[3], 1),
            ev("INSERT", 13, u[4], 1, status="done", amount=None, note="x"),
        ],
    )
    run = materialize(spark, TABLE, landing, warehouse, [H1])
    assert run.merge.fast_keys == 1 and run.merge.slow_keys == 0
    assert changed(paths.history) == {
        (1, t[1]): None,
        (1, t[3]): ["status"],
        (1, u[1]): ["note"],
        (1, u[2]): ["status", "amount"],
        (1, u[4]): [],
    }

    # A late event between the first two versions: its successor's changed columns change too.
    write_parquet_events(
        landing, "c", H0, [ev("UPDATE", 5, t[2], 1, status="new", amount=99.0, note=None)]
    )
    late = materialize(spark, TABLE, landing, warehouse, [H0])
    assert late.merge.slow_keys == 1
    rows = changed(paths.history)
    assert rows[(1, t[2])] == ["amount"]
    assert rows[(1, t[3])] == ["status", "amount"]  # was ["status"]: now after amount=99
    assert rows == changed_columns(history_rows(paths.history, drop=()), ["id"])
    outcomes = {o.name: o for o in invariants.run_checks(spark, paths, ["id"])}
    assert outcomes[invariants.MATCHES_CHANGELOG].passed

    # The README's query: when did `status` change?
    files = delta.absolute_paths(
        paths.history, delta.snapshot_files(delta.open_table(paths.history))
    )
    spark.read.parquet(*files).createOrReplaceTempView("c_history")
    when = spark.sql(
        "SELECT _fivetran_start FROM c_history "
        "WHERE array_contains(_cdc_changed_columns, 'status') ORDER BY 1"
    ).collect()
    assert [r[0].replace(tzinfo=UTC) for r in when] == [t[3], u[2]]
    spark.catalog.dropTempView("c_history")


def test_a_new_column_counts_as_changed_where_it_gets_a_value(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = TablePaths.of(warehouse, "c")
    write_parquet_events(landing, "c", H0, [ev("INSERT", 1, H0, 7, status="a")])
    materialize(spark, TABLE, landing, warehouse, [H0])
    write_parquet_events(landing, "c", H2, [ev("UPDATE", 2, H2, 7, status="a", tier="gold")])
    materialize(spark, TABLE, landing, warehouse, [H2])
    assert changed(paths.history) == {(7, H0): None, (7, H2): ["tier"]}
