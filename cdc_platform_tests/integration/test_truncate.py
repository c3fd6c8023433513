"""Truncate, soft and hard: through the pure core and the ``truncate_table`` job, on real Delta
tables, against the reference fold, replayed, un-applied, and on a table that does not exist."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest

from cdc_platform.definitions import build_definitions
from cdc_platform.lib.config import TableConfig, load_config
from cdc_platform.lib.history import changelog, invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.truncate import (
    TruncateRequest,
    source_name,
    truncate,
    truncate_seq,
)
from cdc_platform.lib.operations.unapply import UnapplyRequest, unapply
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import reference_history, restated_span

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
TABLE = TableConfig(name="orders", primary_key=("id",), start=H0)
COLUMNS = ["id", "status", "_fivetran_start", "_fivetran_end", "_fivetran_active"]
# Materialization times: hour 0 is written at S0, hour 1 at S1; truncates come before S1.
S0, S1 = datetime(2024, 1, 2, tzinfo=UTC), datetime(2024, 1, 3, tzinfo=UTC)
T = datetime(2024, 1, 2, 12, tzinfo=UTC)
MS = timedelta(milliseconds=1)
TMAX = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)


def at(hour: datetime, minute: int) -> datetime:
    return hour + timedelta(minutes=minute)


HOUR0 = [
    ev("INSERT", 1, at(H0, 1), 1, status="new"),
    ev("INSERT", 2, at(H0, 2), 2, status="new"),
    ev("UPDATE", 3, at(H0, 3), 1, status="paid"),
    ev("INSERT", 4, at(H0, 4), 3, status="new"),
    ev("DELETE", 5, at(H0, 5), 3),
    ev("DELETE", 6, at(H0, 6), 4),  # key 4: every event a delete, no row
]
HOUR1 = [ev("UPDATE", 10, at(H1, 1), 2, status="shipped")]


@pytest.fixture(scope="module")
def built(spark, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hours 0 and 1 landed and applied (at S0 and S1), once for the module."""
    root = tmp_path_factory.mktemp("truncate_built")
    landing, warehouse = root / "landing", root / "warehouse"
    write_parquet_events(landing, TABLE.name, H0, HOUR0, name="h0.parquet")
    write_parquet_events(landing, TABLE.name, H1, HOUR1, name="h1.parquet")
    materialize(spark, TABLE, landing, warehouse, [H0], synced_at=S0)
    materialize(spark, TABLE, landing, warehouse, [H1], synced_at=S1)
    return root


def build(built: Path, landing: Path, warehouse: Where) -> TablePaths:
    """A copy of the built landing zone and warehouse (Delta logs hold table-relative paths,
    so the copy is the same table), for a test to change."""
    shutil.copytree(built / "landing", landing, dirs_exist_ok=True)
    shutil.copytree(built / "warehouse", Location.of(warehouse).path, dirs_exist_ok=True)
    return TablePaths.of(warehouse, TABLE.name)


def rows_of(paths: TablePaths) -> list[tuple]:
    return normalize(history_rows(paths.history), COLUMNS)


def expected(events: list[dict]) -> list[tuple]:
    return normalize(reference_history(events, ["id"]), COLUMNS)


def truncate_delete(key: int, before: datetime = T) -> dict:
    return ev("DELETE", truncate_seq(before), before, key)


def checks_pass(spark, paths: TablePaths) -> None:
    outcomes = invariants.run_checks(spark, paths, TABLE.key)
    assert all(o.passed for o in outcomes), [(o.name, o.sample) for o in outcomes if not o.passed]


def versions(paths: TablePaths) -> tuple[int | None, int | None]:
    return delta.version_or_none(paths.history), delta.version_or_none(paths.changelog)


def test_soft_truncate_closes_the_live_versions_written_before_t(spark, built, lake):
    paths = build(built, lake["landing"], lake["warehouse"])
    r = truncate(
        HistoryTable(spark, TABLE, lake["warehouse"]), TruncateRequest(T, soft=True, now=S1 + MS)
    )

    # Key 1 (written at S0) closes at T; key 2 (rewritten at S1) stays; key 3 was deleted.
    assert (r.keys, r.events_logged, r.events_removed) == (1, 1, 0)
    assert r.merge.versions_closed == 1
    assert rows_of(paths) == [
        (1, "new", at(H0, 1), at(H0, 3) - MS, False),
        (1, "paid", at(H0, 3), T, False),
        (2, "new", at(H0, 2), at(H1, 1) - MS, False),
        (2, "shipped", at(H1, 1), TMAX, True),
        (3, "new", at(H0, 4), at(H0, 5), False),
    ]
    assert rows_of(paths) == expected([*HOUR0, *HOUR1, truncate_delete(1)])
    closed = [row for row in history_rows(paths.history, drop=()) if row["id"] == 1]
    assert {row["_fivetran_synced"] for row in closed} == {S0, S1 + MS}
    log = delta.read_arrow(paths.changelog).to_pylist()
    (synthetic,) = [e for e in log if e["_cdc_source_file"] == source_name(T)]
    assert source_name(T) == "truncate:before=2024-01-02T12:00:00.000Z"
    assert (synthetic["cdc_operation_type"], synthetic["cdc_change_seq"]) == (
        "DELETE",
        -1_704_196_800_000,
    )
    checks_pass(spark, paths)

    # The same truncate again changes nothing: no commit to either table.
    seen = versions(paths)
    again = truncate(
        HistoryTable(spark, TABLE, lake["warehouse"]),
        TruncateRequest(T, soft=True, now=S1 + 2 * MS),
    )
    assert (again.keys, again.events_logged) == (0, 0) and versions(paths) == seen


def test_events_after_a_soft_truncate_are_placed_around_it(spark, built, lake):
    """A later event re-opens the key, a late one older than T lands before the delete, and an
    event in T's own millisecond sorts after the truncate (its seq is lower than any real one)."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = build(built, landing, warehouse)
    truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=True, now=S1 + MS))
    late = [
        ev("UPDATE", 20, at(H0, 30), 1, status="late"),  # before T: closed at T
        ev("UPDATE", 21, T, 2, status="at-T"),  # key 2 is live: a new version at T
        ev("INSERT", 22, T + timedelta(hours=1), 1, status="back"),  # re-opens key 1
    ]
    write_parquet_events(landing, TABLE.name, H2, late, name="late.parquet")
    materialize(spark, TABLE, landing, warehouse, [H2], synced_at=S1 + 2 * MS)

    assert rows_of(paths) == expected([*HOUR0, *HOUR1, truncate_delete(1), *late])
    live = {row[0]: row for row in rows_of(paths) if row[4]}
    assert live[1] == (1, "back", T + timedelta(hours=1), TMAX, True)
    assert live[2] == (2, "at-T", T, TMAX, True)
    assert (1, "late", at(H0, 30), T, False) in rows_of(paths)
    checks_pass(spark, paths)


def test_a_soft_truncate_is_undone_by_unapplying_it(spark, built, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = build(built, landing, warehouse)
    before = rows_of(paths)
    truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=True, now=S1 + MS))
    assert rows_of(paths) != before

    r = unapply(
        HistoryTable(spark, TABLE, warehouse, landing),
        UnapplyRequest((source_name(T),), "wrong time", "r1"),
    )
    assert (r.events_removed, r.keys_retracted) == (1, 1)
    assert rows_of(paths) == before
    checks_pass(spark, paths)


def test_hard_truncate_removes_the_keys_written_before_t_and_their_events(spark, built, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = build(built, landing, warehouse)
    version = delta.version_or_none(paths.history)
    assert version is not None
    r = truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=False, now=S1 + MS))

    # Keys 1 and 3 (latest version written at S0) and key 4 (no version) go, with all their
    # events; key 2's latest version was written at S1, so it stays whole.
    assert (r.keys, r.events_logged, r.events_removed) == (3, 0, 5)
    assert rows_of(paths) == expected([e for e in [*HOUR0, *HOUR1] if e["id"] == 2])
    logged = {e["id"] for e in delta.read_arrow(paths.changelog).to_pylist()}
    assert logged == {2}
    side = delta.read_arrow(paths.delete_only_keys).to_pylist()
    assert side == []
    checks_pass(spark, paths)
    # Delta time travel keeps what was there.
    old = delta.open_table(paths.history, version=version).to_pyarrow_table()
    assert {row["id"] for row in old.to_pylist()} == {1, 2, 3}

    seen = versions(paths)
    again = truncate(
        HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=False, now=S1 + 2 * MS)
    )
    assert (again.keys, again.events_removed) == (0, 0) and versions(paths) == seen

    # A late file lands in the old hour, which is read again: its new event is applied, the
    # removed ones are not logged again (the forgotten-events ledger), so nothing comes back.
    late = ev("UPDATE", 7, at(H0, 30), 1, status="late")
    write_parquet_events(landing, TABLE.name, H0, [late], name="late.parquet")
    out = materialize(spark, TABLE, landing, warehouse, [H0], synced_at=S1 + 3 * MS)
    assert out.events_new == 1
    kept = [e for e in [*HOUR0, *HOUR1] if e["id"] == 2]
    assert rows_of(paths) == expected([*kept, late])
    checks_pass(spark, paths)


def test_a_hard_truncate_with_no_before_empties_the_table(spark, built, lake):
    paths = build(built, lake["landing"], lake["warehouse"])
    r = truncate(
        HistoryTable(spark, TABLE, lake["warehouse"]),
        TruncateRequest(datetime.now(UTC), soft=False),
    )
    assert r.keys == 4 and rows_of(paths) == []
    assert delta.read_arrow(paths.changelog).num_rows == 0
    checks_pass(spark, paths)


def test_truncating_a_table_that_does_not_exist_is_not_an_error(spark, lake):
    for soft in (True, False):
        r = truncate(HistoryTable(spark, TABLE, lake["warehouse"]), TruncateRequest(T, soft=soft))
        assert not r.changed and r.keys == 0
    assert not delta.exists(TablePaths.of(lake["warehouse"], TABLE.name).history)


def test_a_time_without_a_zone_is_refused(spark, lake):
    with pytest.raises(ValueError, match="give a time zone"):
        truncate(
            HistoryTable(spark, TABLE, lake["warehouse"]),
            TruncateRequest(datetime(2024, 1, 2), soft=True),
        )


def test_the_dagster_job_truncate_table(spark, built, tmp_path):
    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    paths = build(built, platform.landing_path, platform.warehouse_root)
    defs = build_definitions(platform)
    instance = dg.DagsterInstance.ephemeral()

    def run(config: dict) -> dg.ExecuteInProcessResult:
        return defs.resolve_job_def("truncate_table").execute_in_process(
            run_config={"ops": {"truncate": {"config": config}}},
            resources=dagster_resources(),
            instance=instance,
            raise_on_error=False,
        )

    result = run({"table": "orders", "before": "2024-01-02T12:00:00Z"})
    assert result.success
    (mat,) = result.asset_materializations_for_node("truncate")
    assert mat.partition == "2024-01-02-12:00"
    assert mat.metadata["keys_closed"].value == 1
    assert mat.metadata["soft"].value is True
    passed = mat.metadata["checks_passed"].value
    assert isinstance(passed, list) and len(passed) == len(invariants.CHECK_NAMES)
    assert (1, "paid", at(H0, 3), T, False) in rows_of(paths)

    for bad, message in [
        ("2024-01-02 12:00", "has no time zone"),
        ("yesterday", "is not an ISO-8601 time"),
    ]:
        failed = run({"table": "orders", "before": bad, "soft": False})
        assert not failed.success
        (step_failure,) = [e for e in failed.all_events if e.is_step_failure]
        assert message in str(step_failure.event_specific_data.error)  # type: ignore[union-attr]
    assert changelog.key_and_data_fields(Table.open(paths.changelog)) is not None  # nothing removed

    result = run({"table": "orders", "soft": False})  # before: the run's start
    assert result.success and rows_of(paths) == []


class _Crash(Exception):
    pass


def test_a_soft_truncate_with_no_before_closes_what_its_catch_up_merge_writes(
    spark, lake, monkeypatch
):
    """Hour 1 is logged but a crash comes before its merge: the truncate's catch-up merges it
    (rows written at ``now``), and a truncate with no ``before`` closes those rows too."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    write_parquet_events(landing, TABLE.name, H0, HOUR0, name="h0.parquet")
    write_parquet_events(landing, TABLE.name, H1, HOUR1, name="h1.parquet")
    materialize(spark, TABLE, landing, warehouse, [H0], synced_at=S0)

    def crash(*args, **kwargs):
        raise _Crash

    with monkeypatch.context() as m:
        m.setattr("cdc_platform.lib.history.table.apply_pending", crash)
        with pytest.raises(_Crash):
            materialize(spark, TABLE, landing, warehouse, [H1], synced_at=S1)
    paths = TablePaths.of(warehouse, TABLE.name)
    before = history_rows(paths.history)
    r = truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(soft=True, now=S1 + MS))
    assert r.before == S1 + 2 * MS and r.keys == 2  # keys 1 and 2, key 2 just merged
    # The span reported covers what the catch-up merged (hour 1) as well as the truncate's.
    first, last, _ = restated_span(before, history_rows(paths.history), ["id"]) or (None,) * 3
    span = r.merge.restated
    assert span is not None and first is not None and last is not None
    assert span.start <= first and last <= span.end, (span, first, last)
    closing = [truncate_delete(k, S1 + 2 * MS) for k in (1, 2)]
    assert rows_of(paths) == expected([*HOUR0, *HOUR1, *closing])
    assert not [r for r in rows_of(paths) if r[4]]  # no live row left
    checks_pass(spark, paths)


def test_a_before_in_the_future_is_refused(spark, built, lake):
    paths = build(built, lake["landing"], lake["warehouse"])
    seen = versions(paths)
    with pytest.raises(ValueError, match="in the future"):
        truncate(
            HistoryTable(spark, TABLE, lake["warehouse"]),
            TruncateRequest(S1 + timedelta(days=1), soft=False, now=S1),
        )
    assert versions(paths) == seen


def test_a_hard_truncate_keeps_delete_only_keys_logged_at_or_after_t(spark, built, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = build(built, landing, warehouse)
    ghost = ev("DELETE", 20, at(H1, 5), 9)  # key 9: only a delete, logged at S1 > T
    write_parquet_events(landing, TABLE.name, H1, [ghost], name="ghost.parquet")
    materialize(spark, TABLE, landing, warehouse, [H1], synced_at=S1)
    r = truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=False, now=S1 + MS))
    assert (r.keys, r.events_removed) == (3, 5)  # keys 1, 3 and 4 (logged at S0) go
    logged = sorted(e["id"] for e in delta.read_arrow(paths.changelog).to_pylist())
    assert logged == [2, 2, 9]
    assert [k["id"] for k in delta.read_arrow(paths.delete_only_keys).to_pylist()] == [9]
    checks_pass(spark, paths)


def test_a_hard_truncate_never_removes_an_event_logged_while_it_ran(
    spark, built, lake, monkeypatch
):
    """Another run logs (and merges) a new key while the truncate decides: the truncate's
    strict commit loses, it starts again, and the new key, written after T, stays."""
    from cdc_platform.lib.operations import truncate as truncation

    landing, warehouse = lake["landing"], lake["warehouse"]
    paths = build(built, landing, warehouse)
    H2 = H0 + timedelta(hours=2)
    newcomer = ev("INSERT", 30, at(H2, 1), 7, status="new")
    write_parquet_events(landing, TABLE.name, H2, [newcomer], name="h2.parquet")
    real = truncation._latest_rows
    calls = []

    def racing(t_):
        latest = real(t_)
        if not calls:  # the first attempt has decided what to keep: another run commits now
            materialize(spark, TABLE, landing, warehouse, [H2], synced_at=S1 + 2 * MS)
        calls.append(1)
        return latest

    monkeypatch.setattr(truncation, "_latest_rows", racing)
    r = truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=False, now=S1 + MS))
    assert len(calls) == 2 and r.keys == 3
    assert rows_of(paths) == expected([e for e in [*HOUR0, *HOUR1, newcomer] if e["id"] in (2, 7)])
    assert sorted(e["id"] for e in delta.read_arrow(paths.changelog).to_pylist()) == [2, 2, 7]
    checks_pass(spark, paths)
