"""The merge's cost model, asserted on what a run reads and rewrites (never on time).

An in-order hour is folded from the keys' current rows: it rewrites only files holding the
touched keys' current rows, appends closed rows, and reads no change-log file but the ones it
just logged. A late event takes the slow path for its key alone. A table written before the
state columns existed is recomputed once by the next run, then takes the fast path.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from cdc_platform.defs.jobs.registry import MAINTENANCE_JOB, operator_job
from cdc_platform.lib.columns import CHANGED, CURRENT, LAST_EVENT_AT
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history.merge import APP_ID, is_closed_file, unchanged_before
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
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
TABLE = TableConfig(name="deep", primary_key=("id",), start=H0)
KEYS = 12
COLUMNS = ["id", "v", "_fivetran_start", "_fivetran_end", "_fivetran_active"]


def _deep_history(spark: Any, lake: dict[str, Path], hours: int) -> list[dict[str, Any]]:
    """Every key updated in every hour, one run per hour: many closed files, one live part."""
    events: list[dict[str, Any]] = []
    seq = 0
    for h in range(hours):
        hour = H0 + timedelta(hours=h)
        batch = []
        for k in range(KEYS):
            seq += 1
            op = "INSERT" if h == 0 else "UPDATE"
            batch.append(ev(op, seq, hour + timedelta(minutes=k + 1), k, v=seq))
        write_parquet_events(lake["landing"], TABLE.name, hour, batch)
        materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])
        events += batch
    return events


def _commit_actions(table: Location, version: int) -> tuple[list[str], list[str]]:
    lines = (table.path / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    actions = [json.loads(line) for line in lines]
    adds = [a["add"]["path"] for a in actions if "add" in a]
    removes = [a["remove"]["path"] for a in actions if "remove" in a]
    return adds, removes


def test_in_order_hour_touches_only_current_rows_of_its_keys(spark, lake):
    events = _deep_history(spark, lake, hours=5)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    before = {f.path: f for f in delta.snapshot_files(delta.open_table(paths.history))}
    closed_before = {p for p, f in before.items() if is_closed_file(f)}
    assert len(closed_before) >= 4  # one closed file appended per hourly run
    log_before = {f.path for f in delta.snapshot_files(delta.open_table(paths.changelog))}

    hour = H0 + timedelta(hours=5)
    new = [ev("UPDATE", 1000 + k, hour + timedelta(minutes=1), k, v=-k) for k in (3, 7)]
    write_parquet_events(lake["landing"], TABLE.name, hour, new)
    result = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])

    m = result.merge
    assert (m.keys_affected, m.fast_keys, m.slow_keys) == (2, 2, 0)
    assert m.history_version is not None
    adds, removes = _commit_actions(paths.history, m.history_version)
    # Only the file holding the keys' current rows is rewritten; no closed file is touched.
    assert removes and not set(removes) & closed_before
    holding = set()
    for path in removes:
        ids = set(pq.read_table(paths.history.path / path, columns=["id"])["id"].to_pylist())
        holding.add(bool(ids & {3, 7}))
    assert holding == {True}
    # The change log: only the file this run logged was read.
    log_now = delta.snapshot_files(delta.open_table(paths.changelog))
    pending = [f for f in log_now if f.path not in log_before]
    assert m.changelog_bytes_read == sum(f.size for f in pending)
    # Closed files were not even read.
    assert m.history_bytes_read < sum(f.size for f in before.values())

    expected = reference_history([*events, *new], ["id"])
    assert normalize(history_rows(paths.history), COLUMNS) == normalize(expected, COLUMNS)
    assert len(adds) == 2  # the rewritten live part and the two newly closed versions


def test_late_event_takes_the_slow_path_for_its_key_only(spark, lake):
    events = _deep_history(spark, lake, hours=3)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    hour = H0 + timedelta(hours=3)
    late = ev("UPDATE", 2000, H0 + timedelta(minutes=30), 5, v=555)  # inside key 5's history
    same_ms = ev("UPDATE", 2001, events[-1]["cdc_commit_timestamp"], KEYS - 1, v=777)
    in_order = ev("UPDATE", 2002, hour + timedelta(minutes=1), 0, v=0)
    write_parquet_events(lake["landing"], TABLE.name, hour, [late, same_ms, in_order])
    result = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])

    # A new event in an already-applied millisecond is refolded with that millisecond too.
    assert (result.merge.fast_keys, result.merge.slow_keys) == (1, 2)
    expected = reference_history([*events, late, same_ms, in_order], ["id"])
    assert normalize(history_rows(paths.history), COLUMNS) == normalize(expected, COLUMNS)


def test_late_events_leave_closed_files_that_ended_before_them_alone(spark, lake):
    """Versions ending before a late event cannot change: closed files that ended earlier are
    neither read nor rewritten, whatever keys they hold; and a late key is refolded from its
    version holding the late event, so change-log files logged before that are not read."""
    events = _deep_history(spark, lake, hours=6)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    before = {f.path: f for f in delta.snapshot_files(delta.open_table(paths.history))}
    log_before = delta.snapshot_files(delta.open_table(paths.changelog))
    closed_before = {p: f for p, f in before.items() if is_closed_file(f)}
    late_at = H0 + timedelta(hours=3, minutes=30)
    ended_before = {p for p, f in closed_before.items() if f.max_values["_fivetran_end"] < late_at}
    assert len(ended_before) >= 2  # the closed files of the first hours

    hour = H0 + timedelta(hours=6)
    late = [
        ev("UPDATE", 3000, late_at, 5, v=-5),
        ev("UPDATE", 3001, late_at + timedelta(minutes=10), 9, v=-9),
    ]
    write_parquet_events(lake["landing"], TABLE.name, hour, late)
    result = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])

    m = result.merge
    assert (m.fast_keys, m.slow_keys) == (0, 2)
    assert m.history_version is not None
    _, removes = _commit_actions(paths.history, m.history_version)
    assert set(removes) & set(closed_before)  # the closed file holding the split versions
    assert not set(removes) & ended_before
    # Bytes read: the current files and the closed files that may hold a changing version,
    # plus the rewritten files once more (their unchanged rows are carried over).
    unread = sum(closed_before[p].size for p in ended_before)
    rewritten = sum(before[p].size for p in removes)
    assert m.history_bytes_read - rewritten <= sum(f.size for f in before.values()) - unread
    # Key 5 is refolded from its version started at 03:06, key 9 from 03:10: the change-log
    # files of hours 0-2 hold only earlier events and are skipped.
    early = [
        f for f in log_before if f.max_values["cdc_commit_timestamp"] < H0 + timedelta(hours=3)
    ]
    assert len(early) >= 3
    log_now = delta.snapshot_files(delta.open_table(paths.changelog))
    pending = sum(f.size for f in log_now if f.path not in {g.path for g in log_before})
    log_total = sum(f.size for f in log_now)
    assert m.changelog_bytes_read - pending <= log_total - sum(f.size for f in early)
    expected = reference_history([*events, *late], ["id"])
    assert normalize(history_rows(paths.history), COLUMNS) == normalize(expected, COLUMNS)


def test_a_big_change_log_append_is_split_by_time(spark, lake, monkeypatch):
    """A backfill's events go to change-log files of consecutive time ranges (so a late key's
    refold skips the older ones by their statistics), each holding every event once."""
    from cdc_platform.lib.history import changelog

    monkeypatch.setattr(changelog, "LOG_ROWS_PER_FILE", KEYS)
    hours = [H0 + timedelta(hours=h) for h in range(4)]
    events = []
    for h, hour in enumerate(hours):
        batch = [
            ev("INSERT" if h == 0 else "UPDATE", 100 * h + k, hour + timedelta(minutes=k), k, v=h)
            for k in range(KEYS)
        ]
        write_parquet_events(lake["landing"], TABLE.name, hour, batch)
        events += batch
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], hours)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    files = delta.snapshot_files(delta.open_table(paths.changelog))
    assert len(files) >= 3
    ranges = sorted(
        (f.min_values["cdc_commit_timestamp"], f.max_values["cdc_commit_timestamp"]) for f in files
    )
    assert all(a[1] <= b[0] for a, b in pairwise(ranges))
    assert sum(f.num_records or 0 for f in files) == len(events)
    expected = reference_history(events, ["id"])
    assert normalize(history_rows(paths.history), COLUMNS) == normalize(expected, COLUMNS)


def test_the_cut_is_one_millisecond_before_the_earliest_late_event():
    """Computed from microseconds since the epoch (a collected timestamp would be in the Python
    process's zone); a late event at the dawn of time (an adopted soft delete) gives no cut."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)

    def micros(t: datetime) -> int:
        return (t - epoch) // timedelta(microseconds=1)

    late = datetime(2024, 1, 1, 0, 0, 0, 5000, tzinfo=UTC)
    assert unchanged_before(micros(late)) == late - timedelta(milliseconds=1)
    assert unchanged_before(micros(datetime(1, 1, 1, tzinfo=UTC))) is None
    assert unchanged_before(None) is None


def test_delete_only_keys_are_remembered(spark, lake):
    """A key whose only events are deletes has no row, yet an older insert landing later must
    be closed by them; the side table is what tells it from a brand-new key."""
    write_parquet_events(
        lake["landing"], TABLE.name, H0, [ev("DELETE", 5, H0 + timedelta(minutes=10), 1)]
    )
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    assert delta.read_arrow(paths.delete_only_keys)["id"].to_pylist() == [1]

    hour = H0 + timedelta(hours=1)
    older_insert = ev("INSERT", 4, H0 + timedelta(minutes=5), 1, v=1)
    write_parquet_events(lake["landing"], TABLE.name, hour, [older_insert])
    result = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])
    assert result.merge.slow_keys == 1
    rows = history_rows(paths.history)
    assert [(r["_fivetran_start"], r["_fivetran_end"], r["_fivetran_active"]) for r in rows] == [
        (H0 + timedelta(minutes=5), H0 + timedelta(minutes=10), False)
    ]
    assert delta.read_arrow(paths.delete_only_keys).num_rows == 0


def test_a_table_without_state_columns_is_recomputed_once(spark, lake):
    events = _deep_history(spark, lake, hours=2)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    # The layout before the state columns: same rows, no `_cdc_current`/`_cdc_last_event_at`
    # (nor `_cdc_changed_columns`, which came later still).
    dt = DeltaTable(str(paths.history))
    applied = dt.transaction_version(APP_ID)
    assert applied is not None
    old = delta.read_arrow(paths.history).drop_columns([CURRENT, LAST_EVENT_AT, CHANGED])
    write_deltalake(
        str(paths.history),
        old,
        mode="overwrite",
        schema_mode="overwrite",
        commit_properties=CommitProperties(app_transactions=[Transaction(APP_ID, applied)]),
    )
    assert CURRENT not in delta.table_arrow_schema(DeltaTable(str(paths.history))).names

    hour = H0 + timedelta(hours=2)
    new = [ev("UPDATE", 3000, hour + timedelta(minutes=1), 2, v=3000)]
    write_parquet_events(lake["landing"], TABLE.name, hour, new)
    first = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])
    assert first.merge.slow_keys == KEYS  # every key recomputed, state columns filled in
    expected = reference_history([*events, *new], ["id"])
    assert normalize(history_rows(paths.history), COLUMNS) == normalize(expected, COLUMNS)
    current = [r for r in history_rows(paths.history, drop=()) if r[CURRENT]]
    assert len(current) == KEYS and all(r[LAST_EVENT_AT] is not None for r in current)

    later = H0 + timedelta(hours=3)
    write_parquet_events(lake["landing"], TABLE.name, later, [ev("UPDATE", 3001, later, 4, v=3001)])
    second = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [later])
    assert (second.merge.fast_keys, second.merge.slow_keys) == (1, 0)


def test_maintenance_job_compacts_without_changing_a_row(spark, lake):
    """The maintenance job bin-packs the hourly files of both tables, changes no row
    (not even `_fivetran_synced`), and the next in-order run still takes the fast path and
    reads only its own change-log file (compacted files are not mistaken for new events)."""
    events = _deep_history(spark, lake, hours=4)
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    platform = PlatformConfig(lake["landing"], lake["warehouse"], (TABLE,))
    before_rows = history_rows(paths.history, drop=())
    history_files = len(delta.snapshot_files(delta.open_table(paths.history)))
    log_files = len(delta.snapshot_files(delta.open_table(paths.changelog)))

    job = operator_job(platform, MAINTENANCE_JOB)
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(
            instance=instance,
            resources={"spark": dagster_resources()["spark"]},
            run_config={
                "ops": {"compact_and_vacuum": {"config": {"table": TABLE.name, "vacuum": False}}}
            },
        )
        assert result.success
        observation = instance.fetch_observations(dg.AssetKey(TABLE.name), limit=1).records[0]
        assert observation.asset_observation is not None
        meta = observation.asset_observation.metadata
    assert meta["history_files_before"].value == history_files
    assert meta["changelog_files_before"].value == log_files
    after_history = len(delta.snapshot_files(delta.open_table(paths.history)))
    after_log = len(delta.snapshot_files(delta.open_table(paths.changelog)))
    assert meta["history_files_after"].value == after_history < history_files
    assert meta["changelog_files_after"].value == after_log == 1
    assert history_rows(paths.history, drop=()) == before_rows

    hour = H0 + timedelta(hours=4)
    new = [ev("UPDATE", 5000, hour + timedelta(minutes=1), 1, v=5000)]
    write_parquet_events(lake["landing"], TABLE.name, hour, new)
    log_before = {f.path for f in delta.snapshot_files(delta.open_table(paths.changelog))}
    again = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])
    assert (again.merge.fast_keys, again.merge.slow_keys) == (1, 0)
    pending = [
        f
        for f in delta.snapshot_files(delta.open_table(paths.changelog))
        if f.path not in log_before
    ]
    assert again.merge.changelog_bytes_read == sum(f.size for f in pending)
    expected = reference_history([*events, *new], ["id"])
    assert normalize(history_rows(paths.history), COLUMNS) == normalize(expected, COLUMNS)


def test_key_statistics_rule_files_out_only_when_they_can():
    """Slow keys read only files whose key range may hold them; without usable bounds
    (none, or of another type than the key) a file is always read."""
    from cdc_platform.lib.history.merge.gather import _files_maybe_holding

    def f(name: str, lo: Any, hi: Any) -> delta.DataFile:
        bounds = ({"id": lo}, {"id": hi}) if lo is not None else ({}, {})
        return delta.DataFile(name, 1, 1, *bounds)

    files = [f("a", 0, 9), f("b", 10, 19), f("c", 20, 29), f("d", None, None), f("e", "0", "9")]
    kept = _files_maybe_holding(files, ["id"], [12, 13])
    assert [x.path for x in kept] == ["b", "d", "e"]
    assert [x.path for x in _files_maybe_holding(files, ["id"], [9, 20])] == ["a", "c", "d", "e"]
    assert _files_maybe_holding(files, ["id"], None) == files


def test_a_stale_delete_only_side_table_is_recomputed(spark, lake):
    """A crash between the history commit and the side table's leaves its watermark behind:
    the next run must not trust its rows (here: emptied) and recompute them from the log."""
    write_parquet_events(
        lake["landing"],
        TABLE.name,
        H0,
        [ev("DELETE", 5, H0 + timedelta(minutes=10), 1), ev("INSERT", 6, H0, 2, v=2)],
    )
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H0])
    paths = TablePaths.of(lake["warehouse"], TABLE.name)
    side = delta.read_arrow(paths.delete_only_keys)
    assert side["id"].to_pylist() == [1]
    assert DeltaTable(str(paths.history)).transaction_version(APP_ID) not in (None, 0)
    write_deltalake(  # what a crash leaves: the rows of before, an older watermark
        str(paths.delete_only_keys),
        side.slice(0, 0),
        mode="overwrite",
        commit_properties=CommitProperties(app_transactions=[Transaction(APP_ID, 0)]),
    )
    hour = H0 + timedelta(hours=1)
    older_insert = ev("INSERT", 4, H0 + timedelta(minutes=5), 1, v=1)
    write_parquet_events(lake["landing"], TABLE.name, hour, [older_insert])
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [hour])
    key1 = [r for r in history_rows(paths.history) if r["id"] == 1]
    assert [(r["_fivetran_start"], r["_fivetran_end"], r["_fivetran_active"]) for r in key1] == [
        (H0 + timedelta(minutes=5), H0 + timedelta(minutes=10), False)
    ]
