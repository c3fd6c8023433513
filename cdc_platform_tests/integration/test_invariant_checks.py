"""The SCD2 invariant checks against real tables: a correct one passes, each corruption is caught.

A small history table is built once through the real pipeline (updates, a delete, a re-insert
after the delete). Each test corrupts a copy of it the way a buggy writer would (read it with
deltalake, change rows, overwrite the Delta table with the same schema) and asserts that exactly
the checks that corruption violates fail, with the failing count and the sample keys.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from cdc_platform.definitions import build_definitions
from cdc_platform.defs.alerts.checks import build_check_failure_alert_sensor
from cdc_platform.defs.alerts.webhook import AlertWebhookResource
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tables.checks import WHOLE_TABLE_WRITTEN
from cdc_platform.lib.config import REPO_ROOT, PlatformConfig, TableConfig
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.versions import TMAX
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.spark.session import (
    ADAPTIVE,
    BROADCAST_THRESHOLD,
    CODEGEN_FACTORY_MODE,
    SHUFFLE_PARTITIONS,
    WHOLE_STAGE_CODEGEN,
)
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import dagster_resources, history_rows, write_parquet_events
from cdc_platform_tests.webhook import Webhook

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2, H3 = (H0 + timedelta(hours=i) for i in (1, 2, 3))
T0, T1, T2, T3 = (h + timedelta(minutes=5) for h in (H0, H1, H2, H3))
MS = timedelta(milliseconds=1)
NAME = "inv"
PK = ("id",)
TABLE = TableConfig(name=NAME, primary_key=PK, start=H0)

START, END, ACTIVE = "_fivetran_start", "_fivetran_end", "_fivetran_active"
ALL = set(invariants.CHECK_NAMES)


def ev(op: str, seq: int, ts: datetime, id_: int, v: int | None = None) -> dict[str, Any]:
    """One change event; the name is row data that must never reach an alert."""
    name = None if op == "DELETE" else f"PII-name-{id_}-{v}"
    return {
        "id": id_,
        "name": name,
        "v": v,
        "cdc_operation_type": op,
        "cdc_change_seq": seq,
        "cdc_commit_timestamp": ts,
    }


def write_base_landing(landing: Path) -> None:
    """Key 1: two updates; key 2: insert, delete, re-insert; key 3: insert; key 4: one update,
    then a no-op update (same values: no new version)."""
    write_parquet_events(
        landing,
        NAME,
        H0,
        [ev("INSERT", seq, T0, seq, 10 * seq) for seq in (1, 2, 3, 4)],
    )
    write_parquet_events(
        landing,
        NAME,
        H1,
        [ev("UPDATE", 5, T1, 1, 11), ev("DELETE", 6, T1, 2), ev("UPDATE", 7, T1, 4, 41)],
    )
    write_parquet_events(
        landing,
        NAME,
        H2,
        [ev("UPDATE", 8, T2, 1, 12), ev("INSERT", 9, T2, 2, 21), ev("UPDATE", 20, T2, 4, 41)],
    )


def version(id_: int, v: int, start: datetime, end: datetime) -> dict[str, Any]:
    return {
        "id": id_,
        "name": f"PII-name-{id_}-{v}",
        "v": v,
        START: start,
        END: end,
        ACTIVE: end == TMAX,
    }


EXPECTED = [
    version(1, 10, T0, T1 - MS),
    version(1, 11, T1, T2 - MS),
    version(1, 12, T2, TMAX),
    version(2, 20, T0, T1),  # closed by the delete at T1
    version(2, 21, T2, TMAX),  # the re-insert
    version(3, 30, T0, TMAX),
    version(4, 40, T0, T1 - MS),
    version(4, 41, T1, TMAX),
]


def sort_key(r: dict[str, Any]) -> tuple:
    return (r["id"] is None, r["id"] or 0, r[START])


@pytest.fixture(scope="module")
def base(spark, tmp_path_factory) -> Path:
    """A correct table built in two materializations; tests copy it, never change it."""
    root = tmp_path_factory.mktemp("invariants_base")
    write_base_landing(root / "landing")
    materialize(spark, TABLE, root / "landing", root / "warehouse", [H0])
    materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    return root


@pytest.fixture()
def copy(base: Path, tmp_path: Path) -> Path:
    """A private copy of the base lake (landing, history, change log, quarantine)."""
    dest = tmp_path / "lake"
    shutil.copytree(base, dest)
    return dest


def paths_of(root: Path) -> TablePaths:
    return TablePaths.of(root / "warehouse", NAME)


def outcomes_by_name(spark, root: Path, scope=None) -> dict[str, invariants.CheckOutcome]:
    outcomes = invariants.run_checks(spark, paths_of(root), PK, scope)
    assert [o.name for o in outcomes] == list(invariants.CHECK_NAMES)
    return {o.name: o for o in outcomes}


def failing(outcomes: dict[str, invariants.CheckOutcome]) -> set[str]:
    return {n for n, o in outcomes.items() if not o.passed}


def corrupt(table_path: Location, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]):
    """What a buggy writer does: rewrite the whole table, same schema, different rows."""
    dt = DeltaTable(str(table_path))
    tbl = dt.to_pyarrow_table()
    rows = change(tbl.to_pylist())
    new = pa.Table.from_pylist(rows, schema=tbl.schema)
    write_deltalake(str(table_path), new, mode="overwrite")
    after = DeltaTable(str(table_path))
    assert after.schema() == dt.schema()
    assert after.to_pyarrow_table().schema.field(START).type == pa.timestamp("us", tz="UTC")


def edit(id_: int, start: datetime, **changes: Any):
    """A change that sets ``changes`` on the version (id_, start), which must exist."""

    def change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        hits = [r for r in rows if r["id"] == id_ and r[START] == start]
        assert len(hits) == 1, (id_, start, rows)
        hits[0].update(changes)
        return rows

    return change


def duplicate(id_: int, start: datetime):
    def change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        (hit,) = [r for r in rows if r["id"] == id_ and r[START] == start]
        return [*rows, dict(hit)]

    return change


def replace_versions(id_: int, *versions: dict[str, Any]):
    """A key's versions replaced by others, as a writer with a wrong fold would write them."""

    def change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        synced = next(r["_fivetran_synced"] for r in rows if r["id"] == id_)
        return [r for r in rows if r["id"] != id_] + [
            {**v, "_fivetran_synced": synced} for v in versions
        ]

    return change


def drop_key(id_: int):
    def change(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in rows if r["id"] != id_]

    return change


# --- a correct table ----------------------------------------------------------------------------


def test_correct_table_passes_every_check(spark, base: Path) -> None:
    rows = history_rows(paths_of(base).history)
    assert sorted(rows, key=sort_key) == sorted(EXPECTED, key=sort_key)
    outcomes = outcomes_by_name(spark, base)
    assert failing(outcomes) == set()
    for o in outcomes.values():
        assert (o.failing, o.sample) == (0, [])
        if o.name not in (invariants.NO_QUARANTINE, invariants.NO_REVOKED):  # about files
            assert o.checked_keys == 4


# --- each invariant, broken on purpose ----------------------------------------------------------


@dataclass(frozen=True)
class Corruption:
    check: str
    change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
    sample: list[Any]
    # Checks that the corruption breaks too, by logic (not by accident): see each case.
    also: set[str] = field(default_factory=set)


CORRUPTIONS = {
    # An old version left active. Active with an end that is not TMAX breaks active_iff too:
    # a second active version either has a closed end (that) or a TMAX end (an overlap).
    "two_active": Corruption(
        invariants.ONE_ACTIVE,
        edit(1, T0, **{ACTIVE: True}),
        [1],
        {invariants.ACTIVE_IFF_OPEN, invariants.MATCHES_CHANGELOG},
    ),
    "live_version_marked_inactive": Corruption(
        invariants.ACTIVE_IFF_OPEN,
        edit(3, T0, **{ACTIVE: False}),
        [3],
        {invariants.MATCHES_CHANGELOG},
    ),
    # The deleted version of key 2 now starts after its delete (and still before the re-insert).
    "start_after_end": Corruption(
        invariants.START_NOT_AFTER_END,
        edit(2, T0, **{START: T1 + MS}),
        [2],
        {invariants.MATCHES_CHANGELOG},
    ),
    # The re-insert of key 2 starts at the delete's millisecond: the deleted version (which
    # legitimately ends at its delete) now overlaps it; the gap rule is still explained.
    "overlap": Corruption(
        invariants.NO_OVERLAP,
        edit(2, T2, **{START: T1}),
        [2],
        {invariants.MATCHES_CHANGELOG},
    ),
    # A gap of a minute between two versions of key 4, and key 4 was never deleted.
    "gap_without_delete": Corruption(
        invariants.CONTIGUOUS,
        edit(4, T0, **{END: T1 - timedelta(minutes=1)}),
        [4],
        {invariants.MATCHES_CHANGELOG},
    ),
    # Key 3's only row loses its key: key 3 is then missing from the table as well.
    "null_key": Corruption(
        invariants.PK_NOT_NULL,
        edit(3, T0, id=None),
        [None],
        {invariants.MATCHES_CHANGELOG},
    ),
    # A version written twice (double append). Two rows with one start always overlap.
    "duplicate_version": Corruption(
        invariants.UNIQUE_KEY_START,
        duplicate(2, T0),
        [2],
        {invariants.NO_OVERLAP, invariants.MATCHES_CHANGELOG},
    ),
    "changed_value": Corruption(
        invariants.MATCHES_CHANGELOG,
        edit(4, T1, v=999),
        [4],
    ),
    # Fold bugs that leave every structural invariant intact: only matches_change_log, which
    # does not reuse the writer's fold, can see them.
    # An update lost: the version before it runs on until the next one.
    "missing_version": Corruption(
        invariants.MATCHES_CHANGELOG,
        replace_versions(1, version(1, 10, T0, T2 - MS), version(1, 12, T2, TMAX)),
        [1],
    ),
    # Key 4's no-op update at T2 made a version (same image as the live one).
    "no_op_version": Corruption(
        invariants.MATCHES_CHANGELOG,
        replace_versions(
            4, version(4, 40, T0, T1 - MS), version(4, 41, T1, T2 - MS), version(4, 41, T2, TMAX)
        ),
        [4],
    ),
    # Key 2's delete at T1 ignored: its first version hands over to the re-insert instead.
    "missed_delete": Corruption(
        invariants.MATCHES_CHANGELOG,
        replace_versions(2, version(2, 20, T0, T2 - MS), version(2, 21, T2, TMAX)),
        [2],
    ),
    # A version at a millisecond where the key has no event (key 3 has events at T0 only).
    "version_without_event": Corruption(
        invariants.MATCHES_CHANGELOG,
        replace_versions(3, version(3, 30, T0, T1 - MS), version(3, 31, T1, TMAX)),
        [3],
    ),
    # Changed columns that do not match the versions around them: key 1's update at T1
    # changed `name` and `v`; key 3's only version has no predecessor, so none.
    "wrong_changed_columns": Corruption(
        invariants.MATCHES_CHANGELOG,
        edit(1, T1, _cdc_changed_columns=["name"]),
        [1],
    ),
    "changed_columns_on_a_first_version": Corruption(
        invariants.MATCHES_CHANGELOG,
        edit(3, T0, _cdc_changed_columns=[]),
        [3],
    ),
    # A writer that loses a key entirely: only the reconciliation with the change log sees it.
    "lost_key": Corruption(
        invariants.MATCHES_CHANGELOG,
        drop_key(3),
        [3],
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_each_corruption_fails_exactly_its_checks(spark, copy: Path, case: str) -> None:
    c = CORRUPTIONS[case]
    corrupt(paths_of(copy).history, c.change)
    outcomes = outcomes_by_name(spark, copy)
    failed = outcomes[c.check]
    assert not failed.passed
    assert (failed.failing, failed.sample) == (1, c.sample), failed
    assert failing(outcomes) == {c.check, *c.also}, {n: o for n, o in outcomes.items()}
    for name in c.also:
        assert outcomes[name].failing == 1, outcomes[name]
    for name in ALL - {c.check, *c.also}:
        assert (outcomes[name].failing, outcomes[name].sample) == (0, [])


def test_a_quarantined_file_fails_only_its_check(spark, copy: Path) -> None:
    folder = hour_folder(copy / "landing", NAME, H1)
    (folder / "export-notes.txt").write_text("this is not a Parquet file\n")
    result = materialize(spark, TABLE, copy / "landing", copy / "warehouse", [H1])
    assert [q.file for q in result.quarantined] == [
        f"{NAME}/year=2024/month=01/day=01/hour=01/export-notes.txt"
    ]
    assert result.events_new == 0
    assert sorted(history_rows(paths_of(copy).history), key=sort_key) == sorted(
        EXPECTED, key=sort_key
    )

    outcomes = outcomes_by_name(spark, copy)
    assert failing(outcomes) == {invariants.NO_QUARANTINE}
    q = outcomes[invariants.NO_QUARANTINE]
    assert q.failing == 1
    assert q.sample[0]["file"].endswith("hour=01/export-notes.txt")
    assert q.sample[0]["reason"]


# --- scoping: the keys a materialization touched ------------------------------------------------


def keys_in_files_added_since(table_path: Location, since: int) -> set[int]:
    """Independently of touched_keys: diff the add actions, read the new files with pyarrow."""
    before = set(DeltaTable(str(table_path), version=since).file_uris())
    added = [u for u in DeltaTable(str(table_path)).file_uris() if u not in before]
    assert added
    return {k for u in added for k in pq.read_table(u, columns=["id"])["id"].to_pylist()}


def test_scope_is_the_keys_in_files_added_since(spark, copy: Path) -> None:
    paths = paths_of(copy)
    # A corruption outside the coming run's keys: key 3 (live) marked inactive.
    corrupt(paths.history, edit(3, T0, **{ACTIVE: False}))
    since = DeltaTable(str(paths.history)).version()

    # Only new keys land next: the run adds one file and rewrites none.
    write_parquet_events(
        copy / "landing",
        NAME,
        H3,
        [
            ev("INSERT", 10, T3, 5, 50),
            ev("INSERT", 11, T3, 6, 60),
            ev("UPDATE", 12, T3 + timedelta(seconds=1), 6, 61),
        ],
    )
    result = materialize(spark, TABLE, copy / "landing", copy / "warehouse", [H3])
    assert result.history_version_before == since
    assert (result.merge.keys_affected, result.merge.files_removed) == (2, 0)

    scope = invariants.touched_keys(spark, paths, PK, since)
    assert scope is not None
    touched = {r["id"] for r in scope.keys.collect()}
    assert touched == {5, 6} == keys_in_files_added_since(paths.history, since)

    scoped = outcomes_by_name(spark, copy, scope)
    assert failing(scoped) == set()
    assert scoped[invariants.ACTIVE_IFF_OPEN].checked_keys == 2

    full = outcomes_by_name(spark, copy)
    assert failing(full) == {invariants.ACTIVE_IFF_OPEN, invariants.MATCHES_CHANGELOG}
    assert full[invariants.ACTIVE_IFF_OPEN].sample == [3]
    assert full[invariants.ACTIVE_IFF_OPEN].checked_keys == 6

    # Every file new (no version before: a first load): the whole table, not a scope of every
    # key; nothing added since the current version: no key.
    assert invariants.touched_keys(spark, paths, PK, None) is None
    assert invariants.touched_keys(spark, paths, PK, -1) is None
    nothing = invariants.touched_keys(spark, paths, PK, DeltaTable(str(paths.history)).version())
    assert nothing is not None and nothing.keys.count() == 0


def test_a_small_runs_scope_is_the_keys_its_merge_lists(spark, copy: Path) -> None:
    """A small run rewrites the live file of every key, but changes only its keys' rows: the
    checks after it verify those keys (the commit lists them), with every invariant's power."""
    paths = paths_of(copy)
    since = DeltaTable(str(paths.history)).version()
    write_parquet_events(copy / "landing", NAME, H3, [ev("UPDATE", 10, T3, 1, 13)])
    result = materialize(spark, TABLE, copy / "landing", copy / "warehouse", [H3])
    assert result.merge.files_removed >= 1  # the file it rewrote holds other keys' rows

    scope = invariants.touched_keys(spark, paths, PK, since)
    assert scope is not None
    assert scope.listed and {r["id"] for r in scope.keys.collect()} == {1}
    assert keys_in_files_added_since(paths.history, since) > {1, 3}  # files hold more keys

    # Corruptions as the checks find them: key 1 (the run's key) gets a version ending before
    # it starts, key 3 (not the run's, in the same files) an open version marked inactive.
    corrupt(
        paths.history,
        lambda rows: edit(3, T0, **{ACTIVE: False})(edit(1, T0, **{END: T0 - MS})(rows)),
    )
    # The checks of a listed scope tune the session for a few keys' rows, and only meanwhile.
    tuned = (
        ADAPTIVE,
        BROADCAST_THRESHOLD,
        SHUFFLE_PARTITIONS,
        WHOLE_STAGE_CODEGEN,
        CODEGEN_FACTORY_MODE,
    )
    settings = {k: spark.conf.get(k, None) for k in tuned}
    scoped = outcomes_by_name(spark, copy, scope)
    assert {k: spark.conf.get(k, None) for k in tuned} == settings
    assert invariants.START_NOT_AFTER_END in failing(scoped)  # the run's key: caught hourly
    assert invariants.ACTIVE_IFF_OPEN not in failing(scoped)
    assert scoped[invariants.START_NOT_AFTER_END].sample == [1]
    full = outcomes_by_name(spark, copy)
    assert {invariants.START_NOT_AFTER_END, invariants.ACTIVE_IFF_OPEN} <= failing(full)
    assert full[invariants.ACTIVE_IFF_OPEN].sample == [3]  # elsewhere: the full check

    # That rewrite listed no keys (another writer) and replaced every file: the whole table.
    assert invariants.touched_keys(spark, paths, PK, since) is None


def test_another_writers_partial_rewrite_is_scoped_by_the_files_it_changed(
    spark, copy: Path
) -> None:
    """A commit that lists no keys (another writer) and leaves some files as they were: the
    hourly scope is the keys of the files it added and removed, and a key it lost rows of fails
    the checks."""
    paths = paths_of(copy)
    since = DeltaTable(str(paths.history)).version()
    files_before = set(DeltaTable(str(paths.history)).file_uris())
    # Key 1 loses its closed versions: delta-rs rewrites only the files holding them.
    DeltaTable(str(paths.history)).delete(f"id = 1 AND NOT {ACTIVE}")
    assert files_before & set(DeltaTable(str(paths.history)).file_uris())  # some file is left

    scope = invariants.touched_keys(spark, paths, PK, since)
    assert scope is not None and not scope.listed
    keys = {r["id"] for r in scope.keys.collect()}
    # Key 1's remaining row is in a file left as it was: the removed file names it.
    assert 1 not in keys_in_files_added_since(paths.history, since)
    assert keys == keys_in_files_added_since(paths.history, since) | {1}
    assert invariants.MATCHES_CHANGELOG in failing(outcomes_by_name(spark, copy, scope))


# --- through Dagster: the asset, its checks, the alert ------------------------------------------


MATERIALIZATION_FIELDS = {
    "files_read",
    "events_read",
    "keys_affected",
    "versions_opened",
    "versions_closed",
    "delta_version",
    "seconds",
}


def test_dagster_asset_checks_and_alert(spark, lake, webhook: Webhook) -> None:
    platform = PlatformConfig(lake["landing"], lake["warehouse"], (TABLE,))
    write_base_landing(lake["landing"])
    defs = build_table_definitions(platform, TABLE)
    hook = AlertWebhookResource(
        webhook_url=webhook.secret_url, ui_base_url="http://dagster.test:3000"
    )
    resources = dagster_resources(alert_webhook=hook)
    table_path = paths_of(lake["root"]).history
    alerts = build_check_failure_alert_sensor(list(defs.checks.check_keys))

    def alert_tick(cursor: str | None) -> str | None:
        """One tick of the check alert sensor, as the daemon would run it."""
        context = dg.build_sensor_context(
            cursor=cursor, instance=instance, resources={"alert_webhook": hook}
        )
        return alerts.evaluate_tick(context).cursor

    def materialize_hour(hour: datetime) -> dg.ExecuteInProcessResult:
        result = dg.materialize(
            [defs.asset, defs.checks],
            partition_key=hour_to_partition_key(hour),
            instance=instance,
            resources=resources,
        )
        assert result.success
        return result

    with dg.DagsterInstance.ephemeral() as instance:
        cursor = alert_tick(None)
        result = materialize_hour(H0)
        (mat,) = result.get_asset_materialization_events()
        meta: dict[str, Any] = {k: v.value for k, v in mat.materialization.metadata.items()}
        assert set(meta) >= MATERIALIZATION_FIELDS
        assert (meta["files_read"], meta["events_read"], meta["keys_affected"]) == (1, 4, 4)
        assert (meta["versions_opened"], meta["versions_closed"]) == (4, 0)
        assert meta["delta_version"] == DeltaTable(str(table_path)).version()
        assert meta["seconds"] > 0
        evaluations = result.get_asset_check_evaluations()
        assert {e.check_name for e in evaluations} == ALL
        assert all(e.passed for e in evaluations), [e for e in evaluations if not e.passed]
        # The first run wrote every file: its checks cover the whole table.
        assert [e.metadata["scope"].value for e in evaluations] == [WHOLE_TABLE_WRITTEN] * len(
            evaluations
        )
        # The next hour's checks cover the keys it touched.
        evaluations = materialize_hour(H1).get_asset_check_evaluations()
        assert all(e.passed for e in evaluations), [e for e in evaluations if not e.passed]
        assert [e.metadata["scope"].value for e in evaluations] == [
            "keys touched by this run"
        ] * len(evaluations)
        cursor = alert_tick(cursor)
        assert [c.body for c in webhook.posted] == []

        # Corrupt the table, then run the checks alone (a job selecting only the checks).
        corrupt(table_path, edit(3, T0, **{ACTIVE: False}))
        checks_job = dg.define_asset_job(
            "inv_checks_only", selection=dg.AssetSelection.checks(defs.checks)
        )
        defs_obj = dg.Definitions(
            assets=[defs.asset], asset_checks=[defs.checks], jobs=[checks_job], resources=resources
        )
        run = defs_obj.resolve_job_def("inv_checks_only").execute_in_process(
            instance=instance, raise_on_error=False
        )
        # The checks are blocking with ERROR severity: a failing one fails the step and the run.
        assert not run.success
        (step_failure,) = run.get_step_failure_events()
        error = step_failure.step_failure_data.error
        assert error is not None and "DagsterAssetCheckFailedError" in (error.cls_name or "")
        assert run.get_asset_materialization_events() == []
        by_name = {e.check_name: e for e in run.get_asset_check_evaluations()}
        assert set(by_name) == ALL
        assert {n for n, e in by_name.items() if not e.passed} == {
            invariants.ACTIVE_IFF_OPEN,
            invariants.MATCHES_CHANGELOG,
        }
        bad = by_name[invariants.ACTIVE_IFF_OPEN]
        assert bad.metadata["failing_keys"].value == 1
        assert bad.metadata["sample"].value == [3]
        assert bad.metadata["checked_keys"].value == 4
        assert bad.metadata["scope"].value == "whole table"
        assert bad.severity == dg.AssetCheckSeverity.ERROR
        assert webhook.posted == []  # checks never post: the alert sensor does
        alert_tick(cursor)

    # One alert per failing check, each a JSON POST to the loopback server.
    assert sorted(b["check"] for b in (c.body for c in webhook.posted)) == sorted(
        [invariants.ACTIVE_IFF_OPEN, invariants.MATCHES_CHANGELOG]
    )
    alert = next(
        b for b in (c.body for c in webhook.posted) if b["check"] == invariants.ACTIVE_IFF_OPEN
    )
    assert {"text", "table", "check", "counts", "run_url"} <= set(alert)
    assert alert["kind"] == "check_failed"
    assert alert["table"] == NAME
    assert alert["partition"] is None
    assert alert["counts"] == {"failing_keys": 1, "checked_keys": 4}
    assert alert["run_url"] == f"http://dagster.test:3000/runs/{run.run_id}"
    assert alert["sample_keys"] == [3]
    assert f"`{invariants.ACTIVE_IFF_OPEN}` failed on `{NAME}`" in alert["text"]
    # Nothing of the rows but the sample keys: no data value, no timestamp, no secret.
    for raw in (c.raw for c in webhook.posted):
        text = raw.decode()
        assert "PII-name" not in text
        assert "2024-01-01" not in text
        assert "9999-12-31" not in text
    assert {b["sample_keys"] == [3] for b in (c.body for c in webhook.posted)} == {True}


def test_full_table_check_job_selects_every_tables_checks(tmp_path: Path) -> None:
    other = TableConfig(name="inv_other", primary_key=("k",), start=H0)
    platform = PlatformConfig(
        tmp_path / "landing", Location.of(tmp_path / "warehouse"), (TABLE, other)
    )
    job = build_definitions(platform).resolve_job_def("cdc_full_table_checks")
    selected = job.asset_layer.asset_graph.asset_check_keys
    assert {(k.asset_key.to_user_string(), k.name) for k in selected} == {
        (t, n) for t in (NAME, "inv_other") for n in invariants.CHECK_NAMES
    }


# --- a bug in the writer's fold ----------------------------------------------------------------


def test_a_bug_in_the_writers_fold_is_caught(spark, tmp_path: Path, monkeypatch) -> None:
    """The fold itself is wrong (key 1's images off by 1000): the table is what the fold says,
    every structural invariant holds, and matches_change_log still fails, for key 1 only. (A
    check that recomputed the table with the same fold would agree with the bug.)"""
    from pyspark.sql import functions as F

    from cdc_platform.lib.history import versions as history
    from cdc_platform.lib.history.merge import fold

    real = history.build_versions

    def buggy(events, primary_key, data_columns, **kwargs):
        out = real(events, primary_key, data_columns, **kwargs)
        return out.withColumn(
            "v", F.when(F.col("id") == 1, F.col("v") + 1000).otherwise(F.col("v"))
        )

    for module in (history, fold):  # where the writer's merge looks it up
        monkeypatch.setattr(module, "build_versions", buggy)
    assert not hasattr(invariants, "build_versions")  # the checks keep their own fold
    write_base_landing(tmp_path / "landing")
    materialize(spark, TABLE, tmp_path / "landing", tmp_path / "warehouse", [H0, H1, H2])
    assert {r["v"] for r in history_rows(paths_of(tmp_path).history) if r["id"] == 1} == {
        1010,
        1011,
        1012,
    }
    outcomes = outcomes_by_name(spark, tmp_path)
    assert failing(outcomes) == {invariants.MATCHES_CHANGELOG}
    assert outcomes[invariants.MATCHES_CHANGELOG].sample == [1]


def test_versions_one_millisecond_apart_pass(spark, lake) -> None:
    """A version superseded 1 ms after it started ends in the millisecond it started (start =
    end): that is right, and matches_change_log once flagged it (found by a property test)."""
    t0 = datetime(2024, 1, 1, 0, 0, 0, 8000, tzinfo=UTC)
    ms = timedelta(milliseconds=1)
    rows = [
        {
            "id": 1,
            "v": "a",
            "cdc_operation_type": "INSERT",
            "cdc_change_seq": 1,
            "cdc_commit_timestamp": t0,
        },
        {
            "id": 1,
            "v": "b",
            "cdc_operation_type": "UPDATE",
            "cdc_change_seq": 2,
            "cdc_commit_timestamp": t0 + ms,
        },
        {
            "id": 1,
            "v": "c",
            "cdc_operation_type": "UPDATE",
            "cdc_change_seq": 3,
            "cdc_commit_timestamp": t0 + 2 * ms,
        },
    ]
    table = TableConfig(name="one_ms", primary_key=("id",), start=t0.replace(microsecond=0))
    write_parquet_events(lake["landing"], table.name, table.start, rows)
    materialize(spark, table, lake["landing"], lake["warehouse"], [table.start])
    paths = TablePaths.of(lake["warehouse"], table.name)
    got = history_rows(paths.history)
    assert [(r["v"], r["_fivetran_start"] == r["_fivetran_end"]) for r in got] == [
        ("a", True),
        ("b", True),
        ("c", False),
    ]
    outcomes = invariants.run_checks(spark, paths, table.key)
    assert [(o.name, o.sample) for o in outcomes if not o.passed] == []


def test_the_contract_lists_every_check() -> None:
    """docs/HISTORY_MODE.md section 6 is the user's list of checks: none may be missing there."""
    contract = (REPO_ROOT / "docs" / "HISTORY_MODE.md").read_text()
    section = contract.split("## 6. Invariants")[1].split("\n## ")[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert listed == set(invariants.CHECK_NAMES)
