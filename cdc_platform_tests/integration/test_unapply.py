"""Un-applying a delivery and re-admitting it: through the pure core, the Dagster jobs, a crash
in between, and a property test against a fresh build without the files."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_platform.definitions import build_definitions
from cdc_platform.lib.columns import CHANGED, STATE_COLUMNS
from cdc_platform.lib.config import TableConfig, load_config
from cdc_platform.lib.history import changelog, invariants
from cdc_platform.lib.history.table import Change, HistoryTable
from cdc_platform.lib.ledgers import revoked_files
from cdc_platform.lib.operations.unapply import (
    NoMatchingFileError,
    ReadmitRequest,
    UnapplyRequest,
    _remove_revoked,
    hour_of,
    readmit,
    unapply,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    dagster_resources,
    history_rows,
    normalize,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.reference import UNMODIFIED, reference_history
from cdc_platform_tests.strategies import assign_to_files, cdc_event_batches

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
TABLE = TableConfig(name="orders", primary_key=("id",), start=H0)
COLUMNS = ["id", "status", "_fivetran_start", "_fivetran_end", "_fivetran_active"]
BAD = "orders/year=2024/month=01/day=01/hour=01/bad.parquet"


def at(hour: datetime, minute: int) -> datetime:
    return hour + timedelta(minutes=minute)


def deliveries() -> dict[tuple[datetime, str], list[dict]]:
    """Three files; the bad one (hour 1) holds: an update of key 1 before a later good update,
    the only events of key 2 (which must vanish), the only event of key 3 (a delete: a
    delete-only key), an update of key 4 that is its newest event, and the first version of key
    6 (whose second version, in a later file, becomes its first: no changed columns)."""
    return {
        (H0, "good.parquet"): [
            ev("INSERT", 1, at(H0, 1), 1, status="new"),
            ev("INSERT", 2, at(H0, 2), 4, status="new"),
        ],
        (H1, "bad.parquet"): [
            ev("UPDATE", 10, at(H1, 1), 1, status="WRONG"),
            ev("INSERT", 11, at(H1, 2), 2, status="ghost"),
            ev("UPDATE", 12, at(H1, 3), 2, status="ghost2"),
            ev("DELETE", 13, at(H1, 4), 3),
            ev("UPDATE", 14, at(H1, 5), 4, status="WRONG"),
            ev("INSERT", 15, at(H1, 6), 6, status="first"),
        ],
        (H2, "later.parquet"): [
            ev("UPDATE", 20, at(H2, 1), 1, status="paid"),
            ev("INSERT", 21, at(H2, 2), 5, status="new"),
            ev("UPDATE", 22, at(H2, 3), 6, status="second"),
        ],
    }


def land(
    landing: Path, files: dict[tuple[datetime, str], list[dict]], skip: frozenset[str] = frozenset()
) -> None:
    for (hour, name), rows in files.items():
        if name not in skip:
            write_parquet_events(landing, TABLE.name, hour, rows, name=name)


def rows_of(warehouse: Where) -> list[tuple]:
    return normalize(history_rows(TablePaths.of(warehouse, TABLE.name).history), COLUMNS)


def test_unapply_equals_a_build_without_the_file_and_readmit_restores(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    land(landing, deliveries())
    materialize(spark, TABLE, landing, warehouse, [H0, H1, H2])
    paths = TablePaths.of(warehouse, TABLE.name)
    before = rows_of(warehouse)
    assert delta.exists(paths.delete_only_keys)

    # The reference: the same files but the bad one, built from scratch.
    other = lake["root"] / "fresh"
    land(other / "landing", deliveries(), skip=frozenset({"bad.parquet"}))
    materialize(spark, TABLE, other / "landing", other / "warehouse", [H0, H1, H2])
    want = rows_of(other / "warehouse")

    r = unapply(
        HistoryTable(spark, TABLE, warehouse, landing),
        UnapplyRequest(("year=2024/*/*/hour=01/bad*",), "bad export", "r1"),
    )
    assert r.files == (BAD,) and r.newly_revoked == (BAD,)
    assert (r.events_removed, r.keys_retracted) == (6, 5)
    assert r.hours == (H1,)
    assert rows_of(warehouse) == want
    assert [k[0] for k in normalize(history_rows(paths.history), ["id"])].count(2) == 0
    (six,) = [r for r in history_rows(paths.history, drop=()) if r["id"] == 6]
    assert (six["status"], six["_cdc_changed_columns"]) == ("second", None)
    side = delta.read_arrow(paths.delete_only_keys).to_pylist()
    assert all(row["id"] != 3 for row in side)  # key 3's only event is gone
    assert [f.file for f in revoked_files.revoked(paths.revoked_files)] == [BAD]
    checks = {o.name: o.passed for o in invariants.run_checks(spark, paths, TABLE.key)}
    assert all(checks.values()), checks

    # A replay changes nothing: no commit anywhere.
    versions = (delta.version_or_none(paths.history), delta.version_or_none(paths.changelog))
    again = unapply(
        HistoryTable(spark, TABLE, warehouse, landing), UnapplyRequest((BAD,), "bad export", "r2")
    )
    assert (again.newly_revoked, again.events_removed) == ((), 0)
    assert (
        delta.version_or_none(paths.history),
        delta.version_or_none(paths.changelog),
    ) == versions
    assert revoked_files.revoked(paths.revoked_files)[0].run_id == "r1"  # the first record stays

    # Later runs of its hour never read it again.
    out = materialize(spark, TABLE, landing, warehouse, [H1])
    assert out.revoked == (BAD,) and out.events_new == 0 and out.files_read == 0
    assert rows_of(warehouse) == want

    back = readmit(HistoryTable(spark, TABLE, warehouse, landing), ReadmitRequest((BAD,)))
    assert back.files == (BAD,) and back.hours == (H1,)
    assert back.outcome is not None and back.outcome.events_new == 6
    assert rows_of(warehouse) == before
    assert revoked_files.revoked(paths.revoked_files) == []


def test_the_check_fails_when_a_revoked_files_events_remain(spark, lake):
    landing, warehouse = lake["landing"], lake["warehouse"]
    land(landing, deliveries())
    materialize(spark, TABLE, landing, warehouse, [H0, H1, H2])
    paths = TablePaths.of(warehouse, TABLE.name)
    # Recorded as revoked, but the events were never removed (as if the job died right after).
    revoked_files.add(paths.revoked_files, [BAD], "test", "r0", H2)
    (o,) = [
        o for o in invariants.run_checks(spark, paths, TABLE.key) if o.name == invariants.NO_REVOKED
    ]
    assert not o.passed and o.sample == [{"file": BAD, "events": 6}]


def test_a_crash_after_the_change_log_rewrite_is_finished_by_the_next_run(spark, lake):
    """The change log lost the events but the history table was not recomputed: the next
    materialization of any hour recomputes the retracted keys (key 2 has no event left)."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    land(landing, deliveries())
    materialize(spark, TABLE, landing, warehouse, [H0, H1, H2])
    paths = TablePaths.of(warehouse, TABLE.name)
    revoked_files.add(paths.revoked_files, [BAD], "test", "r0", H2)
    t = HistoryTable(spark, TABLE, warehouse)
    removal = _remove_revoked(Change(t, t.changelog, H2), {BAD}, fence=False)
    removed, keys, rewritten = removal.events, removal.keys, removal.files_rewritten
    assert (removed, keys, rewritten) == (6, 5, 1)
    assert any(r[0] == 2 for r in normalize(history_rows(paths.history), ["id"]))  # stale

    materialize(spark, TABLE, landing, warehouse, [H0])  # nothing new in it
    other = lake["root"] / "fresh"
    land(other / "landing", deliveries(), skip=frozenset({"bad.parquet"}))
    materialize(spark, TABLE, other / "landing", other / "warehouse", [H0, H1, H2])
    assert rows_of(warehouse) == rows_of(other / "warehouse")
    # Caught up: the next run has nothing to recompute.
    assert materialize(spark, TABLE, landing, warehouse, [H0]).merge.keys_affected == 0


def test_an_append_racing_an_unapply_never_logs_a_revoked_files_events(spark, lake):
    """The append asks for the revoked files on each attempt; they go before duplicates are
    resolved (so a kept file's copy of a shared event is logged) and before the dedupe against
    the change log (which holds an overlapping seq range here)."""
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    schema = (
        "id long, status string, cdc_operation_type string, cdc_change_seq long, "
        "cdc_commit_timestamp timestamp, _cdc_source_file string, _cdc_source_row long"
    )
    first = spark.createDataFrame([(9, "z", "INSERT", 2, at(H0, 0), "early", 1)], schema)
    changelog.append(spark, paths.changelog, changelog.Batch(first, ["id"], (2, 2), 1, at(H0, 0)))
    events = spark.createDataFrame(
        [
            (1, "a", "INSERT", 1, at(H0, 1), BAD, 1),
            (2, "b", "INSERT", 2, at(H0, 2), BAD, 2),  # also delivered by "zz_ok" (sorts after)
            (2, "b", "INSERT", 2, at(H0, 2), "zz_ok", 1),
        ],
        schema,
    )
    changelog.append(
        spark,
        paths.changelog,
        changelog.Batch(events, ["id"], (1, 2), 3, at(H0, 3)),
        changelog.Guards(revoked=lambda: {BAD}),
    )
    logged = delta.read_arrow(paths.changelog, columns=["id", "_cdc_source_file"]).to_pylist()
    assert sorted((r["id"], r["_cdc_source_file"]) for r in logged) == [(2, "zz_ok"), (9, "early")]


def test_revoking_a_file_not_applied_yet_fences_off_racing_appends(spark, lake):
    """Nothing of the file is logged: the change log still gets one empty commit, so an append
    that read the revoked list before loses its strict commit and reads it again. A replay
    adds none."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    land(landing, deliveries(), skip=frozenset({"bad.parquet"}))
    materialize(spark, TABLE, landing, warehouse, [H0, H2])
    land(landing, {k: v for k, v in deliveries().items() if k[1] == "bad.parquet"})
    paths = TablePaths.of(warehouse, TABLE.name)
    log_before = delta.version_or_none(paths.changelog)
    assert log_before is not None
    r = unapply(
        HistoryTable(spark, TABLE, warehouse, landing), UnapplyRequest((BAD,), "never apply", "r1")
    )
    assert (r.events_removed, delta.version_or_none(paths.changelog)) == (0, log_before + 1)
    unapply(
        HistoryTable(spark, TABLE, warehouse, landing), UnapplyRequest((BAD,), "never apply", "r2")
    )
    assert delta.version_or_none(paths.changelog) == log_before + 1
    out = materialize(spark, TABLE, landing, warehouse, [H1])
    assert (out.revoked, out.events_new) == ((BAD,), 0)


@pytest.mark.parametrize(
    ("name", "hour"),
    [
        (BAD, H1),
        ("orders/year=2024/month=1/day=1/hour=1/x.parquet", H1),  # unpadded
        ("orders/year=10000000000/month=01/day=01/hour=01/x.parquet", None),  # OverflowError
        ("orders/year=2024/month=01/day=01/hour=99999999999999999999/x.parquet", None),
        ("orders/year=2024/month=13/day=01/hour=01/x.parquet", None),
        ("orders/year=0000/month=01/day=01/hour=01/x.parquet", None),
        ("orders/year=\u0662\u0660\u0662\u0664/month=01/day=01/hour=01/x.parquet", None),
        ("orders/year=2" + "0" * 5000 + "/month=01/day=01/hour=01/x.parquet", None),
        ("orders/x.parquet", None),
    ],
)
def test_hour_of_is_total(name, hour):
    """Any file name gives an hour or None, never an error: un-apply and re-admit ask for it
    after their commits (a number ``datetime`` overflows on raised OverflowError there)."""
    assert hour_of(name) == hour


def test_a_file_under_a_huge_year_folder_is_unapplied_and_readmitted(spark, lake):
    """The folder's year overflows ``datetime``: the un-apply commits and still returns (its
    run reports success), with no hour to report; re-admitting it materializes no hour."""
    landing, warehouse = lake["landing"], lake["warehouse"]
    land(landing, {k: v for k, v in deliveries().items() if k[1] == "good.parquet"})
    materialize(spark, TABLE, landing, warehouse, [H0])
    huge = "orders/year=10000000000/month=01/day=01/hour=00/huge.parquet"
    (landing / huge).parent.mkdir(parents=True)
    (landing / huge).write_bytes(b"not read")
    paths = TablePaths.of(warehouse, TABLE.name)
    r = unapply(
        HistoryTable(spark, TABLE, warehouse, landing), UnapplyRequest((huge,), "odd folder", "r1")
    )
    assert (r.files, r.newly_revoked, r.hours) == ((huge,), (huge,), ())
    assert [f.file for f in revoked_files.revoked(paths.revoked_files)] == [huge]
    back = readmit(HistoryTable(spark, TABLE, warehouse, landing), ReadmitRequest((huge,)))
    assert (back.files, back.hours, back.outcome) == ((huge,), (), None)
    assert revoked_files.revoked(paths.revoked_files) == []


def test_names_that_match_nothing_are_refused(spark, lake):
    land(lake["landing"], deliveries())
    with pytest.raises(NoMatchingFileError, match=r"nope\.parquet.*matches no landing file"):
        unapply(
            HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
            UnapplyRequest(("nope.parquet",), "x", "r"),
        )
    with pytest.raises(ValueError, match="needs a reason"):
        unapply(
            HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
            UnapplyRequest((BAD,), "  ", "r"),
        )
    assert not TablePaths.of(lake["warehouse"], TABLE.name).revoked_files.path.exists()


def test_the_dagster_jobs_unapply_and_readmit(spark, tmp_path):
    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    land(platform.landing_path, deliveries())
    materialize(spark, TABLE, platform.landing_path, platform.warehouse_root, [H0, H1, H2])
    before = rows_of(platform.warehouse_root)
    defs = build_definitions(platform)
    instance = dg.DagsterInstance.ephemeral()

    def run(job: str, config: dict) -> dg.ExecuteInProcessResult:
        return defs.resolve_job_def(job).execute_in_process(
            run_config={"ops": {job.split("_")[0]: {"config": config}}},
            resources=dagster_resources(),
            instance=instance,
            raise_on_error=False,
        )

    result = run("unapply_files", {"table": "orders", "files": [BAD], "reason": "bad export"})
    assert result.success
    (mat,) = result.asset_materializations_for_node("unapply")
    assert mat.partition == "2024-01-01-01:00"
    assert mat.metadata["events_removed"].value == 6
    assert invariants.NO_REVOKED in mat.metadata["checks_passed"].value  # type: ignore[operator]
    assert rows_of(platform.warehouse_root) != before

    result = run("readmit_files", {"table": "orders", "files": ["*/bad.parquet"]})
    assert result.success
    (mat,) = result.asset_materializations_for_node("readmit")
    assert mat.metadata["events_new"].value == 6
    assert rows_of(platform.warehouse_root) == before

    failed = run("unapply_files", {"table": "nope", "files": [BAD], "reason": "x"})
    assert not failed.success
    (step_failure,) = [e for e in failed.all_events if e.is_step_failure]
    assert "no table 'nope' in the config (tables: orders)" in str(
        step_failure.event_specific_data.error  # type: ignore[union-attr]
    )


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_unapply_equals_a_fresh_build_without_the_files(spark, tmp_path_factory, data):
    """Random deliveries, a random set of files un-applied: the table equals, in every column
    but ``_fivetran_synced``, a fresh build from the other files (state and changed columns
    included), and the reference fold over their events. Where a revoked file shared an event
    (key and seq) with a kept file, the kept copy is logged again by materializing its hour
    (documented), so that case is compared after a replay of every hour. Re-admitting
    everything gives back the table as it was."""
    root = tmp_path_factory.mktemp("unapply")
    events = data.draw(cdc_event_batches(max_keys=3, max_events=20), label="events")
    # Parquet has no "unmodified" marker: partial updates become full updates (null cells).
    events = [{k: (None if v is UNMODIFIED else v) for k, v in e.items()} for e in events]
    files = assign_to_files(data.draw, events, start_hour=H0)
    if not files:
        return
    table = TableConfig(name="prop", primary_key=("id",), start=H0)
    keys = sorted(files)
    revoke = data.draw(st.sets(st.sampled_from(keys), min_size=1), label="revoke")
    hours = sorted({h for h, _ in files})

    def build(name: str, only: list[tuple[datetime, str]]) -> tuple[Path, Path]:
        landing, warehouse = root / name / "landing", root / name / "warehouse"
        landing.mkdir(parents=True)
        for hour, file in only:
            write_parquet_events(landing, table.name, hour, files[(hour, file)], name=file)
        materialize(spark, table, landing, warehouse, hours)
        return landing, warehouse

    every = ["id", "name", "amount", "extra", *COLUMNS[2:], *STATE_COLUMNS]

    def rows(warehouse: Path, columns: list[str] = every) -> list:
        """A column only revoked files carried stays, all null (Delta never drops a column);
        a fresh build never had it: both read as null here. The changed columns follow each
        table's own column order (rule of section 2), and a fresh build may have met the columns
        in another order: they are compared as sets here, and ``matches_change_log`` (below)
        checks each table's order."""
        path = TablePaths.of(warehouse, table.name).history
        if not path.path.exists():
            return []
        found = history_rows(path, drop=("_fivetran_synced",))
        for r in found:
            if r.get(CHANGED) is not None:
                r[CHANGED] = sorted(r[CHANGED])
        return normalize(found, columns)

    landing, warehouse = build("applied", keys)
    _, fresh = build("fresh", [k for k in keys if k not in revoke])
    before = rows(warehouse)

    names = [f"{table.name}/year={h:%Y}/month={h:%m}/day={h:%d}/hour={h:%H}/{n}" for h, n in revoke]
    kept = [e for k in keys if k not in revoke for e in files[k]]
    gone = {(e["id"], e["cdc_change_seq"]) for k in revoke for e in files[k]}
    shared = any((e["id"], e["cdc_change_seq"]) in gone for e in kept)
    visible = ["id", "name", "amount", "extra", *COLUMNS[2:]]

    unapply(
        HistoryTable(spark, table, warehouse, landing),
        UnapplyRequest(tuple(names), "property", "r"),
    )
    if not shared:
        assert rows(warehouse) == rows(fresh)
    materialize(spark, table, landing, warehouse, hours)
    assert rows(warehouse) == rows(fresh)
    assert rows(warehouse, visible) == normalize(reference_history(kept, ["id"]), visible)
    paths = TablePaths.of(warehouse, table.name)
    outcomes = invariants.run_checks(spark, paths, table.key)
    assert [o for o in outcomes if not o.passed] == []

    readmit(HistoryTable(spark, table, warehouse, landing), ReadmitRequest(tuple(names)))
    assert rows(warehouse) == before
