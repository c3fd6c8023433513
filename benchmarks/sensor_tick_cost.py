"""How much a landing sensor tick costs with a long history.

On a folder (the default): 10,000 hourly folders; a normal tick must cost O(lookback) folder
listings, not O(history); only the periodic full sweep walks the whole tree.
Run: ``.venv/bin/python -m benchmarks.sensor_tick_cost [--folders N] [--reps R]``.

On a bucket (``--bucket``): 200 tables x 720 hours in one S3 bucket (moto's in-process S3),
every tick of every table counted in requests, the exact figure S3 bills and throttles by. The
reference is what listing each lookback hour folder would cost (one request per hour folder and
spelling). Run: ``.venv/bin/python -m benchmarks.sensor_tick_cost --bucket [--tables N --hours N]``.
The seconds are moto's (it scans the whole bucket for every listing), not S3's.

A reset cursor on a bucket (``--reset``): one table of ``--hours`` hours (``--files`` objects
each), every file already in the applied-files ledger; each tick's requests until the seeding
sweep is done (``LIST_REQUESTS_PER_TICK`` a tick at most; the sensor also stops listing after
``LIST_SECONDS_PER_TICK``, left out here: moto's seconds are not S3's). Before: two listings an
hour.
Junk keys (``--junk``): an unlisted table folder of one zero-byte key per hour of a year, each
in a sub-folder (no landing file); the requests of each ``cdc_new_tables`` tick and of a
code-location load with ``discover:``. Before: two listings an hour, every tick and load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet.sensor_cursor import CursorState, PartitionRequest, evaluate
from cdc_platform.lib.landing.where.layout import folder_spellings, hour_folder

START = datetime(2024, 1, 1, tzinfo=UTC)


def build_tree(root: Path, n_folders: int) -> None:
    """One small file per hour; mtimes are the (past) delivery times, as in a real landing zone."""
    real_end_ns = time.time_ns() - 3600 * 1_000_000_000
    for i in range(n_folders):
        hour = START + timedelta(hours=i)
        folder = hour_folder(root, "orders", hour)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "part-00000.parquet"
        path.write_bytes(b"PAR1 small file")
        mtime = real_end_ns - (n_folders - i) * 3600 * 1_000_000_000
        os.utime(path, ns=(mtime, mtime))


def timed(
    fn: Callable[[], tuple[list[PartitionRequest], CursorState]], reps: int
) -> tuple[float, tuple[list[PartitionRequest], CursorState]]:
    samples = []
    result = fn()  # warm-up (and the result to report)
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folders", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--bucket", action="store_true", help="a landing zone in an S3 bucket")
    parser.add_argument("--tables", type=int, default=200)
    parser.add_argument("--hours", type=int, default=720)
    parser.add_argument("--files", type=int, default=1, help="objects per hour (--reset)")
    parser.add_argument("--reset", action="store_true", help="a reset cursor on a bucket")
    parser.add_argument("--junk", action="store_true", help="junk keys on a bucket")
    args = parser.parse_args()
    if args.reset:
        reset_ticks(args.hours, args.files)
        return
    if args.junk:
        junk_ticks(8784 if args.hours == 720 else args.hours)
        return
    if args.bucket:
        bucket_ticks(args.tables, args.hours)
        return

    table = TableConfig(name="orders", primary_key=("id",), start=START, lookback_hours=6)
    with tempfile.TemporaryDirectory(prefix="sensor_tick_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        build_tree(root, args.folders)
        print(f"built {args.folders:,} hour folders in {time.perf_counter() - t0:.1f} s")

        last_hour = START + timedelta(hours=args.folders - 1)
        now = last_hour + timedelta(hours=1, minutes=5)

        t0 = time.perf_counter()
        initial, warm = evaluate(table, root, now, CursorState())
        initial_ms = (time.perf_counter() - t0) * 1000
        n_keys = sum(len(r.partition_keys) for r in initial)
        print(
            f"initial tick (empty cursor, full sweep + backfill): {initial_ms:8.1f} ms, "
            f"{len(initial)} range requests covering {n_keys:,} partitions"
        )
        warm_json = warm.to_json()

        later = now + timedelta(minutes=1)
        normal_ms, (normal_requests, _) = timed(
            lambda: evaluate(table, root, later, warm), args.reps
        )
        assert normal_requests == [], normal_requests
        print(
            f"(a) normal tick, warm cursor, lookback 6h:        {normal_ms:8.2f} ms  (0 requests)"
        )

        late = hour_folder(root, "orders", last_hour - timedelta(hours=3)) / "part-late.parquet"
        late.write_bytes(b"PAR1 late file")
        late_ms, (late_requests, _) = timed(lambda: evaluate(table, root, later, warm), args.reps)
        assert [r.partition_keys for r in late_requests] == [
            ((last_hour - timedelta(hours=3)).strftime("%Y-%m-%d-%H:%M"),)
        ], late_requests
        print(
            f"(b) tick with one new file inside the lookback:  {late_ms:8.2f} ms  "
            f"({late_requests[0].reason!r})"
        )

        old = hour_folder(root, "orders", START + timedelta(hours=100)) / "part-late.parquet"
        old.write_bytes(b"PAR1 very late file")
        sweep_at = now + timedelta(minutes=table.full_sweep_minutes)
        sweep_ms, (sweep_requests, swept) = timed(
            lambda: evaluate(table, root, sweep_at, warm), args.reps
        )
        reasons = sorted({r.reason for r in sweep_requests})
        print(
            f"(c) full sweep tick over {args.folders:,} folders:    {sweep_ms:8.1f} ms  "
            f"({len(sweep_requests)} requests: {reasons})"
        )
        print(
            f"cursor JSON: {len(warm_json):,} bytes after the initial tick "
            f"({len(warm.folders)} folder entries), {len(swept.to_json()):,} bytes after the sweep "
            f"({len(swept.folders)} entries)"
        )
        print(f"(median of {args.reps} repetitions after one warm-up; page cache warm)")


def bucket_ticks(n_tables: int, n_hours: int) -> None:
    """Every table's sensor tick over one bucket, in requests: first, normal, after a new file,
    and a full-sweep tick that finds a late file in an old hour."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    from moto import mock_aws
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    from cdc_platform.lib.landing.where.object_store import S3Landing
    from cdc_platform.lib.storage.stores import Location

    with mock_aws():
        zone = S3Landing(Location.of("s3://landing-bench/cdc", {"aws_region": "us-east-1"}))
        zone.client.create_bucket(Bucket=zone.bucket)
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        names = [f"table_{i:03d}" for i in range(n_tables)]
        t0 = time.perf_counter()
        for name in names:
            for h in range(n_hours):
                hour = START + timedelta(hours=h)
                key = _hour_key(name, hour) + "/part-00000.parquet"
                stored = backend.put_object(zone.bucket, zone.key_of(key), b"PAR1 small file")
                # Delivered when its hour closed, as a real landing zone's objects were.
                stored.last_modified = (hour + timedelta(minutes=65)).replace(tzinfo=None)
        objects = n_tables * n_hours
        print(
            f"bucket: {n_tables} tables x {n_hours} hours = {objects:,} objects, "
            f"put in {time.perf_counter() - t0:.1f} s"
        )
        tables = {
            n: TableConfig(name=n, primary_key=("id",), start=START, lookback_hours=6)
            for n in names
        }
        now = START + timedelta(hours=n_hours, minutes=5)

        def tick(at: datetime, states: dict[str, CursorState]) -> tuple[int, int, float]:
            before, t0, asked = zone.requests, time.perf_counter(), 0
            for n in names:
                requests, states[n] = evaluate(tables[n], zone, at, states[n])
                asked += sum(len(r.partition_keys) for r in requests)
            return zone.requests - before, asked, time.perf_counter() - t0

        states = {n: CursorState() for n in names}
        sent, asked, seconds = tick(now, states)
        print(
            f"first tick (empty cursors: sweep + backfill): {sent:>6,} requests, "
            f"{asked:,} partitions asked for, {seconds:.1f} s"
        )
        sent, asked, seconds = tick(now + timedelta(minutes=1), states)
        window = tables[names[0]].lookback_hours
        reference = n_tables * window * 2  # each lookback hour's padded and unpadded folder
        print(
            f"normal tick:                                  {sent:>6,} requests "
            f"({asked} partitions), {seconds:.1f} s; listing each lookback hour: "
            f"{reference:,} requests"
        )
        last = START + timedelta(hours=n_hours - 1)
        backend.put_object(
            zone.bucket, zone.key_of(_hour_key(names[0], last) + "/new.parquet"), b"x"
        )
        sent, asked, seconds = tick(now + timedelta(minutes=2), states)
        print(
            f"tick with one new file in one table:          {sent:>6,} requests "
            f"({asked} partition asked for), {seconds:.1f} s"
        )
        old = _hour_key(names[1], START + timedelta(hours=10)) + "/late.parquet"
        backend.put_object(zone.bucket, zone.key_of(old), b"x")
        sent, asked, seconds = tick(now + timedelta(minutes=61), states)
        pages = n_tables * -(-n_hours // 1000)
        print(
            f"full-sweep tick, one late file in an old hour: {sent:>5,} requests "
            f"({asked} partition asked for; {pages} of them the sweep's pages), {seconds:.1f} s"
        )
        largest = max(states.values(), key=lambda s: len(s.to_json()))
        print(
            f"largest cursor: {len(largest.to_json()):,} bytes: {len(largest.folders)} hour "
            f"fingerprints, {len(largest.pending)} hours pending (asked for, not applied: no run "
            "applies them here)"
        )


def _moto_zone() -> tuple[Any, Any]:
    """An empty bucket landing zone in moto's in-process S3, and moto's backend (to put
    objects with a past last-modified time, fast)."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    from cdc_platform.lib.landing.where.object_store import S3Landing
    from cdc_platform.lib.storage.stores import Location

    zone = S3Landing(Location.of(f"s3://landing-{time.time_ns()}/cdc", {"aws_region": "us-east-1"}))
    zone.client.create_bucket(Bucket=zone.bucket)
    return zone, s3_backends[DEFAULT_ACCOUNT_ID]["aws"]


def reset_ticks(n_hours: int, per_hour: int) -> None:
    """A reset cursor's ticks, in requests, until its seeding sweep is done."""
    from moto import mock_aws

    from cdc_platform.lib.fleet.sensor_cursor import LIST_REQUESTS_PER_TICK
    from cdc_platform.lib.landing.where.layout import hour_to_partition_key
    from cdc_platform.lib.landing.where.zone import ListBudget
    from cdc_platform.lib.ledgers.applied_files import identity

    with mock_aws():
        zone, backend = _moto_zone()
        for h in range(n_hours):
            hour = START + timedelta(hours=h)
            for i in range(per_hour):
                key = zone.key_of(f"{_hour_key('orders', hour)}/part-{i:05d}.parquet")
                stored = backend.put_object(zone.bucket, key, b"PAR1 small file")
                stored.last_modified = (hour + timedelta(minutes=65)).replace(tzinfo=None)
        ledger = {  # every file applied already, as the ledger records it
            hour_to_partition_key(h): {identity(zone, f) for f in fs}
            for h, fs in zone.hour_files("orders").files.items()
        }
        table = TableConfig(name="orders", primary_key=("id",), start=START, lookback_hours=6)
        now = START + timedelta(hours=n_hours, minutes=5)
        print(f"reset cursor: 1 table x {n_hours} hours x {per_hour} object(s), all applied")
        listings = sum(len(folder_spellings("orders", h)) for h in _hours(n_hours))
        pages = -(-n_hours * per_hour // 1000)
        window = -(-min(6, n_hours) * per_hour // 1000)  # the lookback's listing, in pages
        print(
            f"before: {2 * pages + listings + window:,} requests in the first tick (the seed's "
            f"listing, {listings:,} hour folders, the window, the sweep's listing)"
        )
        state, tick = CursorState(), 0
        while True:
            before = zone.requests
            requests, state = evaluate(
                table,
                zone,
                now + timedelta(minutes=tick),
                state,
                applied=lambda keys: {k: ledger[k] for k in keys if k in ledger},
                # The cap in requests only: moto's seconds are not S3's.
                budget=ListBudget(LIST_REQUESTS_PER_TICK),
            )
            asked = sum(len(r.partition_keys) for r in requests)
            tick += 1
            print(
                f"tick {tick}: {zone.requests - before:>4} requests, {asked} partition(s) "
                f"asked for, sweep {'goes on' if state.sweep else 'done'}"
            )
            if state.sweep is None:
                break


def junk_ticks(n_keys: int) -> None:
    """An unlisted folder of junk keys: requests per new-tables tick and per load."""
    from moto import mock_aws

    from cdc_platform.lib.landing.discovery import unlisted_budget, unlisted_tables

    with mock_aws():
        zone, backend = _moto_zone()
        _put_one = backend.put_object
        _put_one(zone.bucket, zone.key_of(f"{_hour_key('orders', START)}/p.parquet"), b"PAR1")
        for h in range(n_keys):
            key = f"{_hour_key('junk', START + timedelta(hours=h))}/sub/x"
            _put_one(zone.bucket, zone.key_of(key), b"")
        print(f"junk: {n_keys:,} zero-byte keys, one per hour, in sub-folders of 'junk'")
        listings = sum(len(folder_spellings("junk", h)) for h in _hours(n_keys))
        print(
            f"before: {1 + -(-n_keys // 1000) + listings:,} requests every tick and every load "
            f"(the root, the junk folder's listing, {listings:,} hour folders)"
        )
        before = zone.requests
        found = unlisted_tables(zone, ["orders"], unlisted_budget(), {})
        print(f"code-location load (discover:): {zone.requests - before} requests, found {found}")
        progress: dict[str, str] = {}
        for tick in range(1, 4):
            before = zone.requests
            found = unlisted_tables(zone, ["orders"], unlisted_budget(), progress)
            print(
                f"cdc_new_tables tick {tick}: {zone.requests - before} requests, found {found}, "
                f"{len(progress)} folder(s) to go on with"
            )


def _hours(n: int) -> list[datetime]:
    return [START + timedelta(hours=h) for h in range(n)]


def _hour_key(table: str, hour: datetime) -> str:
    return f"{table}/year={hour:%Y}/month={hour:%m}/day={hour:%d}/hour={hour:%H}"


if __name__ == "__main__":
    main()
