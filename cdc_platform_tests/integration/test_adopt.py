"""Adopting an existing table into history mode: a soft-delete-mode Delta table and a live-mode
Parquet folder, CDC events (late ones included) applied on top, a replay, bad sources, and the
``adopt_table`` job, on real Delta tables against the reference fold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import write_deltalake

from cdc_platform.definitions import build_definitions
from cdc_platform.lib.columns import TMAX, TMIN
from cdc_platform.lib.config import TableConfig, load_config
from cdc_platform.lib.history import invariants, table_key
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.adopt import (
    AdoptionError,
    AdoptRequest,
    SourceFormat,
    adopt,
    adoption_seqs,
    source_name,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import reference_history

H0 = datetime(2024, 1, 1, tzinfo=UTC)
TABLE = TableConfig(name="orders", primary_key=("id",), start=H0)
COLUMNS = ["id", "status", "amount", "_fivetran_start", "_fivetran_end", "_fivetran_active"]
# The source's largest _fivetran_synced, and the adoption time it gives (to the millisecond).
SYNCED_MAX = datetime(2024, 1, 1, 11, 30, 0, 123456, tzinfo=UTC)
A = datetime(2024, 1, 1, 11, 30, 0, 123000, tzinfo=UTC)
NOW = datetime(2024, 1, 2, tzinfo=UTC)


def adopting(spark: Any, lake: dict[str, Path], table: TableConfig = TABLE) -> HistoryTable:
    """The table as an adoption opens it: its landing zone known, so it stays refused."""
    return HistoryTable(spark, table, lake["warehouse"], lake["landing"])


def asked(
    lake: dict[str, Path], source: Path, source_format: SourceFormat = "auto", now: datetime = NOW
) -> AdoptRequest:
    """Adoption allowed from the test's folder (the warehouse and landing zone stay refused)."""
    return AdoptRequest(source, (lake["root"],), source_format, now=now)


def soft_delete_mode_source() -> pa.Table:
    ts = pa.timestamp("us", tz="UTC")
    return pa.table(
        {
            "id": pa.array([1, 2, 3], pa.int32()),
            "status": ["new", "paid", "gone"],
            "amount": pa.array([1.5, None, 3.0], pa.float32()),
            "_fivetran_synced": pa.array(
                [datetime(2024, 1, 1, 10, tzinfo=UTC), SYNCED_MAX, H0], ts
            ),
            "_fivetran_deleted": [False, None, True],
        }
    )


def adoption_events(adopted_at: datetime = A) -> list[dict]:
    """What the adoption logs, written out from the module's rules (for the reference fold)."""
    ins, dele = adoption_seqs(adopted_at)
    return [
        ev("INSERT", ins, adopted_at, 1, status="new", amount=1.5),
        ev("INSERT", ins, adopted_at, 2, status="paid", amount=None),
        ev("INSERT", ins, TMIN, 3, status="gone", amount=3.0),
        ev("DELETE", dele, TMIN, 3),
    ]


def rows_of(paths: TablePaths) -> list[tuple]:
    return normalize(history_rows(paths.history), COLUMNS)


def checks_pass(spark, paths: TablePaths) -> None:
    outcomes = invariants.run_checks(spark, paths, TABLE.key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]


def test_a_soft_delete_mode_delta_table_is_adopted_as_the_seeds_say(spark, lake):
    source = lake["root"] / "source"
    write_deltalake(str(source), soft_delete_mode_source())
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    r = adopt(adopting(spark, lake), asked(lake, source))

    assert (r.format, r.adopted_at, r.live_rows, r.deleted_rows) == ("delta", A, 2, 1)
    assert r.dropped_columns == ("_fivetran_synced", "_fivetran_deleted")
    # Live rows start at the largest _fivetran_synced; soft-deleted ones start and end at
    # 0001-01-01, inactive; _fivetran_deleted is not kept.
    assert rows_of(paths) == [
        (1, "new", 1.5, A, TMAX, True),
        (2, "paid", None, A, TMAX, True),
        (3, "gone", 3.0, TMIN, TMIN, False),
    ]
    names = delta.table_arrow_schema(delta.open_table(paths.history)).names
    assert "_fivetran_deleted" not in names and names[:3] == ["id", "status", "amount"]
    assert table_key.recorded_key(Table.open(paths.history)) == list(TABLE.key)
    log = delta.read_arrow(paths.changelog).to_pylist()
    assert {e["_cdc_source_file"] for e in log} == {source_name(Location.of(source))}
    checks_pass(spark, paths)

    # The same adoption again: nothing new, no commit.
    seen = (delta.version_or_none(paths.history), delta.version_or_none(paths.changelog))
    again = adopt(adopting(spark, lake), asked(lake, source, now=NOW + timedelta(hours=1)))
    assert again.events_new == 0
    assert (delta.version_or_none(paths.history), delta.version_or_none(paths.changelog)) == seen


def test_a_partitioned_delta_table_keeps_its_partition_columns(spark, lake):
    """A partitioned source's files hold no partition column: the values come from its log,
    typed (a text value with a space and a slash, a null partition included)."""
    source = lake["root"] / "source"
    rows = soft_delete_mode_source().append_column(
        "region", pa.array(["north east", "a/b", None], pa.string())
    )
    write_deltalake(str(source), rows, partition_by=["region", "status"])
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    adopt(adopting(spark, lake), asked(lake, source))
    got = normalize(history_rows(paths.history), [*COLUMNS, "region"])
    assert got == [
        (1, "new", 1.5, A, TMAX, True, "north east"),
        (2, "paid", None, A, TMAX, True, "a/b"),
        (3, "gone", 3.0, TMIN, TMIN, False, None),
    ]
    checks_pass(spark, paths)


def test_cdc_events_apply_on_top_of_an_adopted_table(spark, lake):
    source = lake["root"] / "source"
    write_deltalake(str(source), soft_delete_mode_source())
    landing, warehouse = lake["landing"], lake["warehouse"]
    adopt(adopting(spark, lake), asked(lake, source))
    h12 = H0 + timedelta(hours=12)
    cdc = [
        ev("UPDATE", 1, h12 + timedelta(minutes=5), 1, status="shipped", amount=1.5),
        ev("DELETE", 2, h12 + timedelta(minutes=6), 2),
        ev("INSERT", 3, h12 + timedelta(minutes=7), 3, status="back", amount=4.0),
        # Late: older than the adoption, so it lands before the adopted version of key 1.
        ev("UPDATE", 4, H0 + timedelta(hours=10, minutes=30), 1, status="early", amount=1.0),
        # In the adoption's millisecond: it sorts after the adopted row and wins.
        ev("UPDATE", 5, A, 2, status="paid-at-A", amount=2.0),
    ]
    write_parquet_events(landing, TABLE.name, h12, cdc, name="cdc.parquet")
    materialize(spark, TABLE, landing, warehouse, [h12], synced_at=NOW + timedelta(hours=1))
    paths = TablePaths.of(warehouse, TABLE.name)

    assert rows_of(paths) == normalize(
        reference_history([*adoption_events(), *cdc], ["id"]), COLUMNS
    )
    assert (
        1,
        "early",
        1.0,
        cdc[3]["cdc_commit_timestamp"],
        A - timedelta(milliseconds=1),
        False,
    ) in rows_of(paths)
    assert (2, "paid-at-A", 2.0, A, h12 + timedelta(minutes=6), False) in rows_of(paths)
    assert (3, "back", 4.0, h12 + timedelta(minutes=7), TMAX, True) in rows_of(paths)
    checks_pass(spark, paths)


def test_a_live_mode_parquet_folder_is_adopted_at_the_time_of_the_run(spark, lake):
    source = lake["root"] / "export"
    source.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "status": ["a", "b"]}), source / "part-0.parquet")
    pq.write_table(pa.table({"id": [5], "status": ["c"]}), source / "part-1.parquet")
    r = adopt(adopting(spark, lake), asked(lake, source))
    assert (r.format, r.adopted_at, r.live_rows, r.deleted_rows) == ("parquet", NOW, 3, 0)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    assert normalize(history_rows(paths.history), ["id", "status", *COLUMNS[3:]]) == [
        (1, "a", NOW, TMAX, True),
        (2, "b", NOW, TMAX, True),
        (5, "c", NOW, TMAX, True),
    ]
    checks_pass(spark, paths)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"key": [1], "status": ["a"]}, r"primary-key column\(s\) \['id'\] missing"),
        (
            {"id": [1, None], "status": ["a", "b"]},
            r"null primary key \(id\): .*part-0.parquet row 2$",
        ),
        (
            {"id": [1, 1, 2], "status": ["a", "b", "c"]},
            r"on one row only; one key is on .*part-0.parquet row 1 and .*part-0.parquet row 2$",
        ),
        ({"id": [9], "status": [b"x"]}, r"column .status. has type binary but string.*neither"),
    ],
)
def test_a_source_that_cannot_be_adopted_is_refused_with_its_reason(spark, lake, rows, message):
    warehouse = lake["warehouse"]
    export = lake["root"] / "export"
    export.mkdir()
    pq.write_table(pa.table({"id": [1], "status": ["x"]}), export / "part-0.parquet")
    adopt(adopting(spark, lake), asked(lake, export))  # the table's status column is a string
    paths = TablePaths.of(warehouse, TABLE.name)
    seen = (delta.version_or_none(paths.history), delta.version_or_none(paths.changelog))

    bad = lake["root"] / "bad"
    bad.mkdir()
    pq.write_table(pa.table(rows), bad / "part-0.parquet")
    with pytest.raises(AdoptionError, match=message):
        adopt(adopting(spark, lake), asked(lake, bad))
    assert (delta.version_or_none(paths.history), delta.version_or_none(paths.changelog)) == seen
    with pytest.raises(AdoptionError, match="no such file or folder"):
        adopt(adopting(spark, lake), asked(lake, lake["root"] / "missing"))
    with pytest.raises(AdoptionError, match="no Delta table there"):
        adopt(adopting(spark, lake), asked(lake, bad, "delta"))


@pytest.mark.parametrize("key", [("n",), ("at",), ("at", "n")])
def test_key_columns_named_like_the_checks_working_names_adopt(spark, lake, key):
    """The repeated-key check counts and lists rows under working names: a key column called
    ``n`` or ``at`` neither clashes with them (an ambiguous reference) nor is read as them (a
    message naming key values instead of rows)."""
    table = TableConfig(name="orders", primary_key=key, start=H0)
    ids = {k: [1, 2] for k in key}
    source = lake["root"] / "export"
    source.mkdir()
    pq.write_table(pa.table({**ids, "status": ["a", "b"]}), source / "part-0.parquet")
    r = adopt(adopting(spark, lake, table), asked(lake, source))
    assert (r.live_rows, r.deleted_rows) == (2, 0)
    paths = TablePaths.of(lake["warehouse"], table.name)
    assert normalize(history_rows(paths.history), [*key, "status", *COLUMNS[3:]]) == [
        (*[1] * len(key), "a", NOW, TMAX, True),
        (*[2] * len(key), "b", NOW, TMAX, True),
    ]
    outcomes = invariants.run_checks(spark, paths, key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]

    bad = lake["root"] / "bad"
    bad.mkdir()
    pq.write_table(
        pa.table({**{k: [7] * 4 for k in key}, "status": list("wxyz")}), bad / "p.parquet"
    )
    with pytest.raises(
        AdoptionError,
        match=r"one key is on .*p.parquet row 1 and .*p.parquet row 2 and "
        r".*p.parquet row 3 \(4 rows\)$",
    ):
        adopt(adopting(spark, lake, table), asked(lake, bad))


def test_the_dagster_job_adopt_table(spark, tmp_path: Path):
    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\nadoption_roots: [exports]\ntables:\n"
        '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    source = tmp_path / "exports" / "source"
    write_deltalake(str(source), soft_delete_mode_source())
    defs = build_definitions(platform)
    instance = dg.DagsterInstance.ephemeral()

    def run(config: dict) -> dg.ExecuteInProcessResult:
        return defs.resolve_job_def("adopt_table").execute_in_process(
            run_config={"ops": {"adopt": {"config": config}}},
            resources=dagster_resources(),
            instance=instance,
            raise_on_error=False,
        )

    result = run({"table": "orders", "source": str(source)})
    assert result.success
    (mat,) = result.asset_materializations_for_node("adopt")
    assert mat.partition == "2024-01-01-11:00"
    assert (mat.metadata["live_rows"].value, mat.metadata["deleted_rows"].value) == (2, 1)
    passed = mat.metadata["checks_passed"].value
    assert isinstance(passed, list) and len(passed) == len(invariants.CHECK_NAMES)
    paths = TablePaths.of(platform.warehouse_root, "orders")
    assert (3, "gone", 3.0, TMIN, TMIN, False) in rows_of(paths)

    failed = run(
        {"table": "orders", "source": str(tmp_path / "exports" / "nope"), "format": "parquet"}
    )
    assert not failed.success
    (step_failure,) = [e for e in failed.all_events if e.is_step_failure]
    assert "nope: no such file or folder" in str(step_failure.event_specific_data.error)  # type: ignore[union-attr]
