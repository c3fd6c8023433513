"""The landing sensor's cursor logic, against real folders and files in tmp_path."""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet.sensor_cursor import (
    MAX_BACKOFF_SECONDS,
    MAX_RANGE_HOURS,
    REASON_INITIAL,
    REASON_LATE_FILES,
    REASON_NEW_FILES,
    REASON_NEW_FOLDER,
    REASON_RETRY,
    CursorState,
    PartitionRequest,
    backlog,
    backoff_seconds,
    due_for_check,
    evaluate,
    reconcile,
)
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.landing.where.layout import partition_key_to_hour as hour_of

H = timedelta(hours=1)
START = datetime(2024, 1, 1, tzinfo=UTC)
# Simulated times map onto real mtimes in the past (the sweep caps its mark at the wall clock).
SIM0 = datetime(2024, 1, 1, tzinfo=UTC)
REAL0_NS = time.time_ns() - 2_000 * 3600 * 1_000_000_000


def sim_mtime_ns(at: datetime) -> int:
    """The real mtime a file delivered at simulated time `at` gets."""
    return REAL0_NS + int((at - SIM0).total_seconds()) * 1_000_000_000


def table_cfg(**kw: object) -> TableConfig:
    defaults: dict[str, object] = {"name": "orders", "primary_key": ("id",), "start": START}
    defaults.update(kw)
    return TableConfig(**defaults)  # type: ignore[arg-type]


def put(
    root: Path,
    hour: datetime,
    name: str = "part-0.parquet",
    *,
    at: datetime | None = None,
    table: str = "orders",
) -> Path:
    """Write one small landing file; `at` is its simulated delivery time (default: the hour)."""
    folder = hour_folder(root, table, hour)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"PAR1" + name.encode())
    mtime = sim_mtime_ns(at or hour + timedelta(minutes=5))
    os.utime(path, ns=(mtime, mtime))
    return path


def keys(requests: list[PartitionRequest]) -> list[str]:
    return [k for r in requests for k in r.partition_keys]


def k(hour: datetime) -> str:
    return hour_to_partition_key(hour)


def settle(table: TableConfig, root: Path, now: datetime) -> CursorState:
    """A cursor after the initial evaluation (which requests whatever already exists)."""
    _, state = evaluate(table, root, now, CursorState())
    return state


def test_new_folder_is_requested_once(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    assert state.folders == {}

    put(tmp_path, datetime(2024, 1, 3, 9, tzinfo=UTC))
    requests, state = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert [(r.partition_keys, r.reason) for r in requests] == [
        (("2024-01-03-09:00",), REASON_NEW_FOLDER)
    ]
    assert requests[0].run_key.startswith("orders:2024-01-03-09:00..2024-01-03-09:00:")

    # Same files on later ticks, including a sweep tick and ticks as the folder ages out.
    for minutes in (2, 3, 70, 200, 400, 600, 1000, 3000):
        again, state = evaluate(table, tmp_path, now + timedelta(minutes=minutes), state)
        assert again == [], minutes


def test_new_file_in_requested_folder_is_requested_again_with_new_run_key(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    hour = datetime(2024, 1, 3, 7, tzinfo=UTC)
    put(tmp_path, hour, "part-0.parquet")
    first, state = evaluate(table, tmp_path, now, CursorState())
    assert keys(first) == [k(hour)]

    put(tmp_path, hour, "part-1.parquet", at=now)
    second, state = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert [(r.partition_keys, r.reason) for r in second] == [((k(hour),), REASON_NEW_FILES)]
    assert second[0].run_key != first[0].run_key

    third, _ = evaluate(table, tmp_path, now + timedelta(minutes=2), state)
    assert third == []


def test_rewritten_file_changes_fingerprint(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    hour = datetime(2024, 1, 3, 8, tzinfo=UTC)
    path = put(tmp_path, hour)
    _, state = evaluate(table, tmp_path, now, CursorState())
    path.write_bytes(b"PAR1 replaced with more bytes")
    requests, _ = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert keys(requests) == [k(hour)]


def test_late_file_in_old_folder_is_found_by_the_next_sweep_only(tmp_path: Path) -> None:
    table = table_cfg(lookback_hours=6, full_sweep_minutes=60)
    now = datetime(2024, 1, 3, 12, 0, tzinfo=UTC)
    for hour in (datetime(2024, 1, 2, h, tzinfo=UTC) for h in range(24)):
        put(tmp_path, hour)
    initial, state = evaluate(table, tmp_path, now, CursorState())
    assert sorted(keys(initial)) == sorted(
        k(datetime(2024, 1, 2, h, tzinfo=UTC)) for h in range(24)
    )
    assert {r.reason for r in initial} == {REASON_INITIAL}
    assert state.last_sweep_started == now.isoformat()

    # 30 hours after its folder's hour, a file lands in 2024-01-02 06:00.
    old = datetime(2024, 1, 2, 6, tzinfo=UTC)
    tick = now + timedelta(minutes=1)
    put(tmp_path, old, "part-late.parquet", at=tick)
    # Normal ticks (no sweep due yet) only look at the lookback window.
    for minutes in (1, 2, 30, 59):
        requests, state = evaluate(table, tmp_path, now + timedelta(minutes=minutes), state)
        assert requests == [], minutes
    assert state.last_sweep_started == now.isoformat()

    requests, state = evaluate(table, tmp_path, now + timedelta(minutes=60), state)
    assert [(r.partition_keys, r.reason) for r in requests] == [((k(old),), REASON_LATE_FILES)]
    assert state.last_sweep_started == (now + timedelta(minutes=60)).isoformat()

    # The next sweeps do not request it again.
    for minutes in (120, 180, 240):
        again, state = evaluate(table, tmp_path, now + timedelta(minutes=minutes), state)
        assert again == [], minutes


def test_folder_that_aged_out_between_sweeps_is_not_requested_twice(tmp_path: Path) -> None:
    """A folder requested by the window and aging out before a sweep is not re-requested."""
    table = table_cfg(lookback_hours=2, full_sweep_minutes=180)
    now = datetime(2024, 1, 3, 10, 10, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    hour = datetime(2024, 1, 3, 9, tzinfo=UTC)
    put(tmp_path, hour, at=now)
    requests, state = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert keys(requests) == [k(hour)]
    # Three hours later the folder is outside the 2h window and a sweep is due.
    requests, state = evaluate(table, tmp_path, now + timedelta(hours=3), state)
    assert requests == []
    assert state.last_sweep_started == (now + timedelta(hours=3)).isoformat()


def test_consecutive_new_folders_become_one_range(tmp_path: Path) -> None:
    table = table_cfg(lookback_hours=6)
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    hours = [datetime(2024, 1, 3, h, tzinfo=UTC) for h in (5, 6, 7, 9)]
    for hour in hours:
        put(tmp_path, hour)
    requests, state = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert [r.partition_keys for r in requests] == [
        ("2024-01-03-05:00", "2024-01-03-06:00", "2024-01-03-07:00"),
        ("2024-01-03-09:00",),
    ]
    assert requests[0].run_key.startswith("orders:2024-01-03-05:00..2024-01-03-07:00:")
    assert {r.reason for r in requests} == {REASON_NEW_FOLDER}


def test_initial_backfill_is_split_into_capped_ranges(tmp_path: Path) -> None:
    table = table_cfg(lookback_hours=6)
    now = datetime(2024, 1, 6, 0, 30, tzinfo=UTC)
    hours = [START + i * H for i in range(120)]  # up to 2024-01-05 23:00
    for hour in hours:
        put(tmp_path, hour)
    requests, state = evaluate(table, tmp_path, now, CursorState())
    assert sorted(keys(requests)) == sorted(k(h) for h in hours)
    assert len(keys(requests)) == len(set(keys(requests)))
    assert all(1 <= len(r.partition_keys) <= MAX_RANGE_HOURS for r in requests)
    # 114 old hours -> 48 + 48 + 18 as "initial backfill", 6 window hours as "new folder".
    assert [(len(r.partition_keys), r.reason) for r in requests] == [
        (48, REASON_INITIAL),
        (48, REASON_INITIAL),
        (18, REASON_INITIAL),
        (6, REASON_NEW_FOLDER),
    ]
    for r in requests:  # each range is consecutive hours
        hs = [datetime.strptime(x, "%Y-%m-%d-%H:%M") for x in r.partition_keys]
        assert all(b - a == H for a, b in itertools.pairwise(hs))
    again, _ = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert again == []


def test_same_file_sets_give_the_same_run_keys(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 2, 3, 30, tzinfo=UTC)
    for i in range(20):
        put(tmp_path, START + i * H)
    a, _ = evaluate(table, tmp_path, now, CursorState())
    b, _ = evaluate(table, tmp_path, now, CursorState())
    assert a == b
    assert len({r.run_key for r in a}) == len(a)
    other, _ = evaluate(table_cfg(name="payments"), tmp_path, now, CursorState())
    assert other == []  # another table's folders are not ours


def test_empty_folders_and_marker_files_are_not_requested(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    empty = hour_folder(tmp_path, "orders", datetime(2024, 1, 3, 8, tzinfo=UTC))
    empty.mkdir(parents=True)
    markers = hour_folder(tmp_path, "orders", datetime(2024, 1, 3, 9, tzinfo=UTC))
    markers.mkdir(parents=True)
    (markers / "_SUCCESS").write_bytes(b"")
    (markers / ".part-0.parquet.crc").write_bytes(b"x")
    old_empty = hour_folder(tmp_path, "orders", datetime(2024, 1, 1, 3, tzinfo=UTC))
    old_empty.mkdir(parents=True)
    requests, state = evaluate(table, tmp_path, now, CursorState())
    assert requests == []
    assert state.folders == {}
    requests, _ = evaluate(table, tmp_path, now + timedelta(hours=2), state)
    assert requests == []


def test_folders_before_table_start_are_ignored(tmp_path: Path) -> None:
    table = table_cfg(start=datetime(2024, 1, 3, 8, tzinfo=UTC), lookback_hours=6)
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    before_in_window = datetime(2024, 1, 3, 6, tzinfo=UTC)
    long_before = datetime(2024, 1, 1, 6, tzinfo=UTC)
    at_start = datetime(2024, 1, 3, 8, tzinfo=UTC)
    for hour in (before_in_window, long_before, at_start):
        put(tmp_path, hour)
    requests, state = evaluate(table, tmp_path, now, CursorState())
    assert keys(requests) == [k(at_start)]
    put(tmp_path, long_before, "late.parquet", at=now + timedelta(minutes=5))
    requests, state = evaluate(table, tmp_path, now + timedelta(hours=2), state)
    assert requests == []
    assert set(state.folders) <= {k(at_start)}


def test_open_hour_waits_until_its_partition_exists(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    open_hour = datetime(2024, 1, 3, 10, tzinfo=UTC)
    put(tmp_path, open_hour, at=now)
    requests, state = evaluate(table, tmp_path, now + timedelta(minutes=1), state)
    assert requests == []  # the 10:00 partition only exists once the hour has closed
    requests, state = evaluate(table, tmp_path, datetime(2024, 1, 3, 11, 0, 5, tzinfo=UTC), state)
    assert keys(requests) == [k(open_hour)]
    # With end_offset=1 (partitions of the open hour exist) it is requested at once.
    other = tmp_path / "other"
    put(other, open_hour, at=now)
    requests, _ = evaluate(table, other, now, CursorState(), end_offset=1)
    assert keys(requests) == [k(open_hour)]


def test_unpadded_folder_spelling_counts_once(tmp_path: Path) -> None:
    table = table_cfg()
    now = datetime(2024, 1, 9, 12, 30, tzinfo=UTC)
    hour = datetime(2024, 1, 2, 5, tzinfo=UTC)
    put(tmp_path, hour)
    unpadded = tmp_path / "orders" / "year=2024" / "month=1" / "day=2" / "hour=5"
    unpadded.mkdir(parents=True)
    (unpadded / "part-9.parquet").write_bytes(b"PAR1")
    old_ns = sim_mtime_ns(hour + timedelta(minutes=7))
    os.utime(unpadded / "part-9.parquet", ns=(old_ns, old_ns))
    newer = datetime(2024, 1, 8, 5, tzinfo=UTC)  # raises the sweep mark above both spellings
    put(tmp_path, newer)
    requests, state = evaluate(table, tmp_path, now, CursorState())
    assert keys(requests) == [k(hour), k(newer)]
    # A late file in the padded spelling is found even though the unpadded one is older.
    put(tmp_path, hour, "late.parquet", at=now + timedelta(minutes=3))
    requests, _ = evaluate(table, tmp_path, now + timedelta(hours=1), state)
    assert [(r.partition_keys, r.reason) for r in requests] == [((k(hour),), REASON_LATE_FILES)]


def test_cursor_json_round_trips() -> None:
    state = CursorState(
        folders={"2024-01-01-00:00": "abc", "2024-01-01-01:00": "def"},
        last_sweep_started="2024-01-01T02:00:00+00:00",
        swept_mtime_ns=123,
    )
    raw = state.to_json()
    assert json.loads(raw)["folders"] == state.folders
    assert CursorState.from_json(raw) == state
    assert CursorState.from_json(None) == CursorState()
    assert CursorState.from_json("") == CursorState()
    with pytest.raises(ValueError, match="unsupported"):
        CursorState.from_json('{"folders": {}}')


def test_500_hourly_ticks_keep_the_cursor_bounded_and_request_each_change_once(
    tmp_path: Path,
) -> None:
    """Hourly deliveries, a few late files in old folders: every change is requested exactly once."""
    table = table_cfg(lookback_hours=6, full_sweep_minutes=180)
    rng = random.Random(7)
    state = CursorState()
    requested: dict[str, int] = {}
    late_expected: set[str] = set()
    late_seen: set[str] = set()
    max_folders = 0
    max_json = 0
    for i in range(1, 501):
        now = START + i * H + timedelta(minutes=5)
        put(tmp_path, now.replace(minute=0) - H, at=now - timedelta(minutes=1))
        if i > 40 and i % 37 == 0:
            old = now.replace(minute=0) - timedelta(hours=rng.randint(24, 36))
            put(tmp_path, old, f"late-{i}.parquet", at=now - timedelta(minutes=2))
            late_expected.add(k(old))
        requests, state = evaluate(table, tmp_path, now, state)
        for r in requests:
            for key in r.partition_keys:
                requested[key] = requested.get(key, 0) + 1
            if r.reason == REASON_LATE_FILES:
                late_seen.update(r.partition_keys)
        # Every run applies its hour: the hours due are found in the ledger, none requested again.
        due = due_for_check(table, state, now)
        applied = {key: v for d in due for key, v in ledger_rows(tmp_path, hour_of(d)).items()}
        again, state = reconcile(table, tmp_path, now, state, applied, set())
        assert again == []
        raw = state.to_json()
        assert CursorState.from_json(raw) == state
        max_folders = max(max_folders, len(state.folders))
        max_json = max(max_json, len(raw))

    assert late_seen == late_expected
    delivered = {k(START + i * H) for i in range(500)}
    assert set(requested) == delivered
    assert all(requested[key] == (2 if key in late_expected else 1) for key in requested)
    # The window, folders that aged out since the last sweep, and a just-found late folder.
    assert max_folders <= table.lookback_hours + table.full_sweep_minutes // 60 + 1
    assert max_json < 1_000


# -- no hour left behind: pending hours are checked against the ledger and requested again -----


def ledger_rows(root: Path, hour: datetime) -> dict[str, set[tuple[str, int, int]]]:
    """What the applied-files ledger records once a run read the hour's files."""
    from cdc_platform.lib.landing.where.layout import files_in_hour
    from cdc_platform.lib.ledgers import applied_files

    files = files_in_hour(root, "orders", hour)
    return {k(hour): {applied_files.identity(root, f) for f in files}}


def test_an_hour_whose_run_failed_is_requested_again_with_backoff_until_applied(
    tmp_path: Path,
) -> None:
    table = table_cfg(retry_backoff_seconds=60)
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    hour = datetime(2024, 1, 3, 9, tzinfo=UTC)
    put(tmp_path, hour)
    first, state = evaluate(table, tmp_path, now, state)
    assert keys(first) == [k(hour)] and list(state.pending) == [k(hour)]
    assert due_for_check(table, state, now + timedelta(seconds=59)) == []

    # 60 s later: not in the ledger, no run in flight -> requested again, with a new run key.
    t1 = now + timedelta(seconds=60)
    assert due_for_check(table, state, t1) == [k(hour)]
    again, state = reconcile(table, tmp_path, t1, state, {}, set())
    assert keys(again) == [k(hour)] and again[0].reason == REASON_RETRY
    assert again[0].run_key != first[0].run_key
    assert state.pending[k(hour)].retries == 1
    # The backoff doubles: nothing due 119 s later, due at 120 s.
    assert due_for_check(table, state, t1 + timedelta(seconds=119)) == []
    t2 = t1 + timedelta(seconds=120)
    # A run for it is queued or running: it waits, with no new request.
    waiting, state = reconcile(table, tmp_path, t2, state, {}, {k(hour)})
    assert waiting == [] and state.pending[k(hour)].retries == 1
    # Applied at last (the ledger records its files): it leaves the backlog.
    t3 = t2 + timedelta(seconds=120)
    done, state = reconcile(table, tmp_path, t3, state, ledger_rows(tmp_path, hour), set())
    assert done == [] and state.pending == {}
    assert backlog(state, t3) == (0, None, 0.0)
    # And is never asked for again on later ticks.
    for minutes in (5, 60, 600):
        later, state = evaluate(table, tmp_path, t3 + timedelta(minutes=minutes), state)
        assert later == [] and state.pending == {}


def test_a_file_the_ledger_has_not_seen_keeps_its_hour_pending(tmp_path: Path) -> None:
    """The ledger must cover every file now in the folder, at its size and mtime."""
    table = table_cfg(retry_backoff_seconds=60)
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    hour = datetime(2024, 1, 3, 9, tzinfo=UTC)
    put(tmp_path, hour, "a.parquet")
    _, state = evaluate(table, tmp_path, now, state)
    recorded = ledger_rows(tmp_path, hour)
    put(tmp_path, hour, "b.parquet")  # landed after the run listed the folder
    later = now + timedelta(seconds=60)
    requests, state = evaluate(table, tmp_path, later, state)  # the new file: a new request
    assert keys(requests) == [k(hour)] and state.pending[k(hour)].retries == 0
    again, state = reconcile(table, tmp_path, later + timedelta(seconds=60), state, recorded, set())
    assert keys(again) == [k(hour)]


def test_the_backlog_reports_count_oldest_and_age_and_the_cursor_round_trips(
    tmp_path: Path,
) -> None:
    table = table_cfg(retry_backoff_seconds=300)
    now = datetime(2024, 1, 3, 10, 30, tzinfo=UTC)
    state = settle(table, tmp_path, now)
    for h in (7, 8, 9):
        put(tmp_path, datetime(2024, 1, 3, h, tzinfo=UTC))
    _, state = evaluate(table, tmp_path, now, state)
    count, oldest, age = backlog(state, now + timedelta(minutes=30))
    assert (count, oldest, age) == (3, "2024-01-03-07:00", 30.0)
    assert CursorState.from_json(state.to_json()) == state
    # The backoff is capped at an hour, however many retries.
    assert backoff_seconds(table, 50) == MAX_BACKOFF_SECONDS
