"""Operator jobs against the runs beside them, and against their own inputs: each race is
driven deterministically (a real event logged between an operator's decision and its commit,
through a seam of the real code path), on real Spark and Delta.

The contract's "Nothing lost" (docs/HISTORY_MODE.md, section 5) is what each test holds: only
a user removes events, and only the events the user's decision named.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_platform import read
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.rows.timestamps import CLOCK_SKEW
from cdc_platform.lib.operations.adopt import AdoptionError, AdoptRequest, adopt
from cdc_platform.lib.operations.resync import ResyncError, ResyncRequest, resync
from cdc_platform.lib.operations.truncate import TruncateRequest, truncate
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

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

    r = truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=False, now=S1 + MS))
    assert (r.keys, r.events_removed) == (1, 1)  # key 1 and its one event
    assert logged(paths) == [(9, 2), (9, 3)]
    assert [k["id"] for k in delta.read_arrow(paths.delete_only_keys).to_pylist()] == [9]


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
    adopt(
        HistoryTable(spark, TABLE, lake["warehouse"], lake["landing"]),
        AdoptRequest(source, (lake["root"],), now=S0),
    )
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
                HistoryTable(spark, TABLE, warehouse, lake["landing"]),
                ResyncRequest(folder, (lake["root"],), at, now=now or datetime.now(UTC)),
            )
    source = lake["root"] / "export"
    source.mkdir()
    synced = pa.array([datetime(9999, 1, 1, tzinfo=UTC)], pa.timestamp("us", tz="UTC"))
    pq.write_table(
        pa.table({"id": [1], "status": ["a"], "_fivetran_synced": synced}),
        source / "part-0.parquet",
    )
    with pytest.raises(AdoptionError, match=r"_fivetran_synced is 9999-01-01.*in the future"):
        adopt(
            HistoryTable(spark, TABLE, warehouse, lake["landing"]),
            AdoptRequest(source, (lake["root"],), now=S0),
        )
    assert not delta.exists(paths.changelog)  # nothing was written


# -- item 7: operator jobs fence on the change-log version they decided on -----------------------

D1, D2, D3 = (datetime(2020, 1, d, tzinfo=UTC) for d in (1, 2, 3))
RESYNCED = TableConfig(name="t", primary_key=("id",), start=D2)


def test_a_resync_never_removes_an_event_logged_after_it_decided(spark, lake, monkeypatch):
    """The snapshot's row for key a is older than every version of a, so the re-sync decides
    to replace a's history. Right after that decision another run logs a late event of a,
    older than the snapshot row: a's history is then no longer replaced. The re-sync's removal
    must fail on the moved change log and decide again; removing every event of a from the
    latest log (as the retry did) lost the late event for good (forgotten)."""
    from cdc_platform.lib.operations import resync as resync_module

    landing, warehouse = lake["landing"], lake["warehouse"]
    cdc = [ev("INSERT", 1, D2, "a", counter=10), ev("UPDATE", 2, D3, "a", counter=30)]
    write_parquet_events(landing, RESYNCED.name, D2, cdc, name="jan2.parquet")
    materialize(spark, RESYNCED, landing, warehouse, [D2])
    late = ev("INSERT", 3, D1 - timedelta(hours=1), "a", counter=1)
    folder = lake["root"] / "snapshot"
    folder.mkdir()
    stamp = pa.array([D1], pa.timestamp("us", tz="UTC"))
    pq.write_table(
        pa.table({"id": ["a"], "counter": [5], "cdc_commit_timestamp": stamp}),
        folder / "part-0.parquet",
    )
    real = resync_module._closing_and_replacing
    calls: list[int] = []

    def racing(t_, events_):
        decided = real(t_, events_)
        if not calls:  # decided on this read: another run logs a late event of key a now
            write_parquet_events(landing, RESYNCED.name, D2, [late], name="late.parquet")
            materialize(spark, RESYNCED, landing, warehouse, [D2])
        calls.append(1)
        return decided

    monkeypatch.setattr(resync_module, "_closing_and_replacing", racing)
    r = resync(
        HistoryTable(spark, RESYNCED, warehouse, landing),
        ResyncRequest(folder, (lake["root"],), D3 + timedelta(hours=6)),
    )
    paths = TablePaths.of(warehouse, RESYNCED.name)
    assert r.keys_replaced == 0  # decided again: a has a version older than the snapshot row
    assert ("a", 3) in logged(paths)
    assert {("a", 1), ("a", 2)} <= set(logged(paths))


# -- item 9: events a lost attempt forgot are not forgotten when the retry keeps them ------------


def test_events_a_lost_hard_truncate_attempt_forgot_come_back_when_re_admitted(
    spark, lake, monkeypatch
):
    """The first attempt decides key 1 goes and forgets its events; before its commit another
    run updates key 1 (written after T now), so the commit fails and the retry keeps key 1.
    Its events must not stay forgotten: un-applying their file and re-admitting it gives the
    same change log back (they were filtered out as forgotten, lost)."""
    from cdc_platform.lib.history import changelog
    from cdc_platform.lib.operations.unapply import (
        ReadmitRequest,
        UnapplyRequest,
        readmit,
        unapply,
    )

    landing, warehouse = lake["landing"], lake["warehouse"]
    hour0 = [ev("INSERT", 1, H0 + MS, 1, status="new"), ev("INSERT", 2, H0 + 2 * MS, 2)]
    write_parquet_events(landing, TABLE.name, H0, hour0, name="h0.parquet")
    materialize(spark, TABLE, landing, warehouse, [H0], synced_at=S0)
    paths = TablePaths.of(warehouse, TABLE.name)
    real = changelog.forget
    calls: list[int] = []

    def racing(*args, **kwargs):
        real(*args, **kwargs)
        if not calls:  # forgotten, not committed yet: another run updates key 1 now
            update = ev("UPDATE", 5, H1, 1, status="paid")
            write_parquet_events(landing, TABLE.name, H1, [update], name="h1.parquet")
            materialize(spark, TABLE, landing, warehouse, [H1], synced_at=S1)
        calls.append(1)

    monkeypatch.setattr(changelog, "forget", racing)
    r = truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(T, soft=False, now=S1 + MS))
    monkeypatch.undo()
    assert len(calls) == 2 and r.keys == 1  # key 2 only: key 1 was written after T
    before = logged(paths)
    assert before == [(1, 1), (1, 5)]

    h0 = f"{TABLE.name}/year=2024/month=01/day=01/hour=00/h0.parquet"
    unapply(
        HistoryTable(spark, TABLE, warehouse, landing),
        UnapplyRequest((h0,), "bad delivery", "run-1", now=S1 + 2 * MS),
    )
    assert logged(paths) == [(1, 5)]
    readmit(HistoryTable(spark, TABLE, warehouse, landing), ReadmitRequest((h0,), now=S1 + 3 * MS))
    assert logged(paths) == before


# -- item 7: operator jobs hold the table's pool slot ---------------------------------------------


def test_an_operator_job_waits_for_the_tables_pool_slot_then_gives_up(spark, tmp_path):
    """A materialization holds ``cdc_table_orders`` (limit 1, as in dagster.yaml): the
    ``truncate_table`` run waits for it, then fails naming the run that holds it, without
    touching the table; once the slot is free the job runs, holding the slot meanwhile, and
    frees it at the end."""
    import dagster as dg

    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.jobs import skeleton as operations
    from cdc_platform.lib.config import load_config
    from cdc_platform_tests.helpers import dagster_resources

    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    defs = build_definitions(load_config(tmp_path / "cdc_platform.yaml"))
    job = defs.resolve_job_def("truncate_table")
    pool = "cdc_table_orders"
    overrides = {"concurrency": {"pools": {"default_limit": 1, "granularity": "op"}}}
    with dg.instance_for_test(overrides=overrides) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default(pool)
        assert storage.claim_concurrency_slot(pool, "sensor-run", "orders", 0).is_claimed

        def run() -> dg.ExecuteInProcessResult:
            return job.execute_in_process(
                run_config={"ops": {"truncate": {"config": {"table": "orders"}}}},
                resources=dagster_resources(),
                instance=instance,
                raise_on_error=False,
            )

        with pytest.MonkeyPatch.context() as m:
            m.setattr(operations, "POOL_WAIT_SECONDS", 1.0)
            m.setattr(operations, "_POLL_SECONDS", 0.2)
            failed = run()
        assert not failed.success
        (step_failure,) = [e for e in failed.all_events if e.is_step_failure]
        message = str(step_failure.event_specific_data.error)  # type: ignore[union-attr]
        assert "still being written by run(s) sensor-run" in message
        assert [s.run_id for s in storage.get_concurrency_info(pool).claimed_slots] == [
            "sensor-run"
        ]

        storage.free_concurrency_slot_for_step("sensor-run", "orders")
        held: list[list[str]] = []
        real = operations.pool_slot

        @contextmanager
        def watching(*args, **kwargs):
            with real(*args, **kwargs):
                held.append([s.run_id for s in storage.get_concurrency_info(pool).claimed_slots])
                yield

        with pytest.MonkeyPatch.context() as m:
            m.setattr(operations, "pool_slot", watching)
            ok = run()
        assert ok.success and held == [[ok.run_id]]
        assert storage.get_concurrency_info(pool).claimed_slots == []


# -- item 10: an operation's own events are taken back only by name, and never re-admitted ------


def test_globs_never_match_an_operations_events_and_re_admitting_them_is_refused(spark, lake):
    """``files: ["*"]`` took back the adoption's, re-sync's and truncate's events too, which no
    re-admit logs again. Now only an exact name matches them; re-admitting one is refused with
    what to run instead, and running that operation again logs its events again."""
    from cdc_platform.lib.ledgers import revoked_files
    from cdc_platform.lib.operations import adopt as adoption
    from cdc_platform.lib.operations import resync as resync_module
    from cdc_platform.lib.operations import truncate as truncation
    from cdc_platform.lib.operations.unapply import (
        ADOPT_PREFIX,
        RESYNC_PREFIX,
        TRUNCATE_PREFIX,
        NotReadmittableError,
        ReadmitRequest,
        UnapplyRequest,
        match,
        readmit,
        unapply,
    )

    assert (ADOPT_PREFIX, RESYNC_PREFIX, TRUNCATE_PREFIX) == (
        adoption.SOURCE_PREFIX,
        resync_module.SOURCE_PREFIX,
        truncation.SOURCE_PREFIX,
    )
    landing, warehouse = lake["landing"], lake["warehouse"]
    h0 = f"{TABLE.name}/year=2024/month=01/day=01/hour=00/h0.parquet"
    synthetic = {
        truncation.source_name(T),
        "adopt:file:///exports/orders",
        "resync:at=2024-01-02T00:00:00.000Z",
        "../snapshots/part-0.parquet",
    }
    assert match(["*"], {h0, *synthetic}, TABLE.name, landing) == [h0]
    for name in synthetic:
        assert match([name], {h0, *synthetic}, TABLE.name, landing) == [name]
    with pytest.raises(LookupError, match="named exactly"):
        match(["truncate:*"], synthetic, TABLE.name, landing)

    source = lake["root"] / "export"
    source.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "status": ["a", "b"]}), source / "part-0.parquet")

    def adopt_it(now: datetime) -> int:
        r = adopt(
            HistoryTable(spark, TABLE, warehouse, landing),
            AdoptRequest(source, (lake["root"],), now=now),
        )
        return r.events_new

    assert adopt_it(S0) == 2
    paths = TablePaths.of(warehouse, TABLE.name)
    adopted = logged(paths)
    (name,) = {r["_cdc_source_file"] for r in delta.read_arrow(paths.changelog).to_pylist()}
    with pytest.raises(LookupError, match="named exactly"):
        unapply(
            HistoryTable(spark, TABLE, warehouse, landing),
            UnapplyRequest(("*",), "everything", "r1", now=S0),
        )
    unapply(
        HistoryTable(spark, TABLE, warehouse, landing),
        UnapplyRequest((name,), "wrong source", "r1", now=S0),
    )
    assert logged(paths) == []
    with pytest.raises(NotReadmittableError, match="run adopt_table again with source"):
        readmit(HistoryTable(spark, TABLE, warehouse, landing), ReadmitRequest((name,)))
    assert revoked_files.revoked_names(paths.revoked_files) == {name}
    assert adopt_it(S0) == 2  # was 0, silently: the revocation filtered every event out
    assert logged(paths) == adopted
    assert revoked_files.revoked_names(paths.revoked_files) == set()


# -- item 14: a name the platform writes never overwrites a table it reads or discovered ---------


def test_a_current_table_never_overwrites_a_discovered_table_of_its_name(spark, lake, caplog):
    """``orders_current`` was a discovered table (its history in the warehouse) when ``orders``
    gets ``current_table: true``: the config is refused naming both, and the current table's
    refresh refuses to overwrite that folder. With nothing written yet, discovery skips the
    folder and says why."""
    from dataclasses import replace

    from cdc_platform.lib.config import ConfigError, DiscoverTemplate, PlatformConfig
    from cdc_platform.lib.history import current_table
    from cdc_platform.lib.landing.discovery import with_discovered_tables
    from cdc_platform.lib.storage.stores import Location

    landing, warehouse = lake["landing"], lake["warehouse"]
    for name in ("orders", "orders_current"):
        write_parquet_events(landing, name, H0, [ev("INSERT", 1, H0, 1)], name="h0.parquet")
    plain = PlatformConfig(
        landing_root=landing,
        warehouse_root=Location.of(warehouse),
        tables=(TABLE,),
        discover=DiscoverTemplate(primary_key=("id",), start=H0),
    )
    with_current = replace(plain, tables=(replace(TABLE, current_table=True),))
    assert [t.name for t in with_discovered_tables(with_current).tables] == ["orders"]
    assert "'orders_current' is not discovered: table 'orders' has current_table" in caplog.text

    discovered = with_discovered_tables(plain).tables
    assert [t.name for t in discovered] == ["orders", "orders_current"]
    for table in discovered:
        materialize(spark, table, landing, warehouse, [H0])
    with pytest.raises(ConfigError, match="'orders_current' is the discovered table"):
        with_discovered_tables(with_current)
    paths = TablePaths.of(warehouse, "orders")
    seen = delta.version_or_none(paths.current)
    with pytest.raises(current_table.CurrentTableClashError, match="not overwritten"):
        current_table.refresh(HistoryTable(spark, discovered[0], warehouse))
    assert delta.version_or_none(paths.current) == seen


# -- item 11: widening is the operator's decision -------------------------------------------------


def test_widen_types_defaults_to_data_columns_only(tmp_path):
    from cdc_platform.lib.config import ConfigError, load_config

    def table(extra: str) -> str:
        (tmp_path / "c.yaml").write_text(
            "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
            '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n' + extra
        )
        return str(tmp_path / "c.yaml")

    orders = load_config(table("")).table("orders")
    assert orders.widen_types == "data"
    assert (orders.may_widen("amount"), orders.may_widen("id")) == (True, False)
    everything = load_config(table("    widen_types: all\n")).table("orders")
    assert everything.may_widen("id")
    nothing = load_config(table("    widen_types: never\n")).table("orders")
    assert not nothing.may_widen("amount")
    with pytest.raises(ConfigError, match="widen_types"):
        load_config(table("    widen_types: auto\n"))


def test_forgotten_rows_count_only_once_their_removal_committed(tmp_path):
    """The ledger's rows of a removal count only if the change-log commit after the version it
    decided on carries its token: a crash between writing them and a commit that lost leaves
    rows that never count (and rows written before this rule count, as they did)."""
    from deltalake import CommitProperties, DeltaTable, write_deltalake

    from cdc_platform.lib.history import changelog

    log = tmp_path / "changelog"
    write_deltalake(str(log), pa.table({"id": [1]}))  # version 0
    DeltaTable(str(log)).create_write_transaction(
        [],
        mode="append",
        schema=pa.schema([("id", pa.int64())]),
        commit_properties=CommitProperties(custom_metadata={changelog.REMOVAL_KEY: "won"}),
    )  # version 1: the removal that decided on version 0

    def ledger_file(token: str | None, after: int) -> delta.DataFile:
        stats = (
            {} if token is None else {changelog.REMOVAL: token, changelog.AFTER_LOG_VERSION: after}
        )
        return delta.DataFile("data/x.parquet", 1, 1, stats, stats)

    assert changelog.removal_committed(log, ledger_file("won", 0))
    assert not changelog.removal_committed(log, ledger_file("lost", 0))  # v1 is another's
    assert not changelog.removal_committed(log, ledger_file("pending", 1))  # no v2 yet
    assert changelog.removal_committed(log, ledger_file(None, 0))  # an older ledger's row
