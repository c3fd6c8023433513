"""Write a small, realistic CDC landing zone for the demo: ``customers`` and ``orders``.

Layout: ``<landing_root>/<table>/year=YYYY/month=MM/day=DD/hour=HH/part-NNNNN-<uuid>.snappy.parquet``.

The data carries what real CDC exports bring (docs/HISTORY_MODE.md section 1): exact
duplicates (same ``cdc_change_seq``, sometimes in two files or folders), visibly identical
events with new seqs, several changes to one key in one millisecond (including an insert and a delete),
keys whose first event is an UPDATE, deletes of keys never seen, DELETE rows with only the
key, late files (a folder holding events committed up to 4 hours earlier), 1-3 files per
folder, and schema drift (``customers.loyalty_points`` appears at hour 5, ``customers.fax``
disappears after hour 6). Everything is derived from ``random.Random(seed)``: the same seed
gives the same file names and contents.

Run as ``python -m cdc_platform.demo.generate <landing_root> [--seed N] [--hours N]``.
"""

from __future__ import annotations

import argparse
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_platform.lib.landing.where.layout import hour_folder

CUSTOMERS = "customers"
ORDERS = "orders"
PRIMARY_KEYS = {CUSTOMERS: "customer_id", ORDERS: "order_id"}

LOYALTY_FROM_HOUR = 5  # customers.loyalty_points exists in events committed from this hour on
FAX_UNTIL_HOUR = 6  # customers.fax exists in events committed up to this hour
MAX_DELAY_HOURS = 4  # how late a file can land after its events' commit hour
MAX_FILES_PER_FOLDER = 3
UNSEEN_KEY_BASE = 900_000  # keys only ever deleted, never inserted or updated

TS = pa.timestamp("us", tz="UTC")
CDC_FIELDS = [
    pa.field("cdc_operation_type", pa.string()),
    pa.field("cdc_change_seq", pa.int64()),
    pa.field("cdc_commit_timestamp", TS),
]
SCHEMAS = {
    CUSTOMERS: pa.schema(
        [
            pa.field("customer_id", pa.int64()),
            pa.field("name", pa.string()),
            pa.field("email", pa.string()),
            pa.field("tier", pa.string()),
            pa.field("fax", pa.string()),
            pa.field("loyalty_points", pa.int64()),
            pa.field("updated_at", TS),
            *CDC_FIELDS,
        ]
    ),
    ORDERS: pa.schema(
        [
            pa.field("order_id", pa.int64()),
            pa.field("customer_id", pa.int64()),
            pa.field("status", pa.string()),
            pa.field("amount", pa.float64()),
            pa.field("currency", pa.string()),
            *CDC_FIELDS,
        ]
    ),
}

_FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Radia", "Tim"]
_LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson"]
_TIERS = ["bronze", "silver", "gold", "platinum"]
_CURRENCIES = ["USD", "EUR", "GBP"]
_NEXT_STATUS = {
    "NEW": ["PAID", "CANCELLED"],
    "PAID": ["SHIPPED", "CANCELLED"],
    "SHIPPED": ["DELIVERED"],
}

Event = dict[str, Any]


# --------------------------------------------------------------------------- event streams


@dataclass
class _Stream:
    """The change events of one table, emitted in commit order with increasing seqs."""

    table: str
    start: datetime
    rng: random.Random
    seq: int = 1000
    events: list[Event] = field(default_factory=list)
    images: dict[int, Event] = field(default_factory=dict)  # live keys -> current image
    ever_seen: set[int] = field(default_factory=set)

    @property
    def pk(self) -> str:
        return PRIMARY_KEYS[self.table]

    def hour_index(self, ts: datetime) -> int:
        return int((ts - self.start) // timedelta(hours=1))

    def columns_at(self, ts: datetime) -> list[str]:
        """The data columns the source exports at commit time ``ts`` (schema drift)."""
        names = [f.name for f in SCHEMAS[self.table] if not f.name.startswith("cdc_")]
        h = self.hour_index(ts)
        dropped = set()
        if h < LOYALTY_FROM_HOUR:
            dropped.add("loyalty_points")
        if h > FAX_UNTIL_HOUR:
            dropped.add("fax")
        return [n for n in names if n not in dropped]

    def emit(self, op: str, key: int, ts: datetime, image: Event | None = None) -> Event:
        """Append one event; a DELETE carries only the key (every other column null)."""
        self.seq += self.rng.randint(1, 3)
        event: Event = {c: None for c in self.columns_at(ts)}
        if op != "DELETE" and image is not None:
            event.update({c: image.get(c) for c in event})
        event[self.pk] = key
        event.update(cdc_operation_type=op, cdc_change_seq=self.seq, cdc_commit_timestamp=ts)
        self.events.append(event)
        self.ever_seen.add(key)
        if op == "DELETE":
            self.images.pop(key, None)
        else:
            self.images[key] = dict(image or {})
        return event

    def live_keys(self) -> list[int]:
        return sorted(self.images)


SLOT_GAP_MS = 60_000  # slots are at least a minute apart: a planned case never overlaps the next


def _slot_times(rng: random.Random, hour_start: datetime, n: int) -> list[datetime]:
    """``n`` sorted commit times in one hour, >= 1 minute apart, between minute 0:10 and 58:10.

    Microseconds stay below 500 within the millisecond, so adding < 400 us keeps an event in
    the same millisecond.
    """
    window_ms = 58 * 60_000
    offsets = sorted(rng.sample(range(window_ms - n * SLOT_GAP_MS), n))
    return [
        hour_start
        + timedelta(seconds=10, milliseconds=m + i * SLOT_GAP_MS, microseconds=rng.randrange(500))
        for i, m in enumerate(offsets)
    ]


def _customer_events(rng: random.Random, start: datetime, hours: int) -> list[Event]:
    s = _Stream(CUSTOMERS, start, rng)
    next_id = [1]

    def new_customer(ts: datetime) -> tuple[int, Event]:
        cid = next_id[0]
        next_id[0] += 1
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        image = {
            "name": f"{first} {last}",
            "email": f"{first}.{last}{cid}@example.com".lower(),
            "tier": rng.choice(_TIERS[:2]),
            "fax": f"+1-555-{rng.randrange(10_000):04d}" if rng.random() < 0.4 else None,
            "loyalty_points": 0,
            "updated_at": ts,
        }
        return cid, image

    def changed(cid: int, ts: datetime) -> Event:
        image = dict(s.images[cid])
        what = rng.choice(["tier", "email", "name", "points", "points"])
        if what == "tier":
            image["tier"] = rng.choice(_TIERS)
        elif what == "email":
            image["email"] = f"{image['name'].split()[0].lower()}.{rng.randrange(1000)}@example.org"
        elif what == "name":
            image["name"] = f"{rng.choice(_FIRST)} {image['name'].split()[-1]}"
        else:
            image["loyalty_points"] = (image.get("loyalty_points") or 0) + rng.randrange(5, 500)
        image["updated_at"] = ts
        return image

    # Edge cases, each planned at one hour (clamped into the window).
    def update_first(ts: datetime) -> None:
        cid, image = new_customer(ts)
        s.emit("UPDATE", cid, ts, image)  # the INSERT was never exported

    def several_in_one_ms(ts: datetime) -> None:
        cid, image = new_customer(ts)
        s.emit("INSERT", cid, ts, image)
        s.emit("UPDATE", cid, ts, {**image, "tier": "gold"})  # same transaction

    def insert_delete_one_ms(ts: datetime) -> None:
        cid, image = new_customer(ts)
        s.emit("INSERT", cid, ts, image)
        s.emit("DELETE", cid, ts + timedelta(microseconds=rng.randrange(1, 400)))

    def delete_unseen(ts: datetime) -> None:
        s.emit("DELETE", UNSEEN_KEY_BASE + rng.randrange(1000), ts)

    def double_delete(ts: datetime) -> None:
        live = s.live_keys()
        if live:
            cid = rng.choice(live)
            s.emit("DELETE", cid, ts)
            s.emit("DELETE", cid, ts + timedelta(seconds=rng.randint(1, 30)))

    def come_back(ts: datetime) -> None:
        gone = sorted(k for k in s.ever_seen - set(s.images) if k < UNSEEN_KEY_BASE)
        if gone:
            cid = rng.choice(gone)
            first, last = rng.choice(_FIRST), rng.choice(_LAST)
            image = {"name": f"{first} {last}", "email": f"{first}.{cid}@example.net".lower()}
            s.emit(
                "INSERT",
                cid,
                ts,
                {**image, "tier": "bronze", "loyalty_points": 0, "updated_at": ts},
            )

    specials = [
        (1, update_first),
        (2, several_in_one_ms),
        (3, insert_delete_one_ms),
        (4, delete_unseen),
        (5, double_delete),
        (8, come_back),
        (9, delete_unseen),
    ]

    def normal(ts: datetime) -> None:
        live = s.live_keys()
        roll = rng.random()
        if len(live) < 4 or roll < 0.3:
            cid, image = new_customer(ts)
            s.emit("INSERT", cid, ts, image)
        elif roll < 0.8:
            cid = rng.choice(live)
            s.emit("UPDATE", cid, ts, changed(cid, ts))
        elif roll < 0.9:
            cid = rng.choice(live)  # an internal column changed: visibly identical event
            s.emit("UPDATE", cid, ts, s.images[cid])
        else:
            s.emit("DELETE", rng.choice(live), ts)

    _simulate(rng, start, hours, specials, normal, per_hour=(10, 18))
    return s.events


def _order_events(
    rng: random.Random, start: datetime, hours: int, customers: list[Event]
) -> list[Event]:
    s = _Stream(ORDERS, start, rng, seq=5000)
    next_id = [10_001]
    customer_log = sorted(customers, key=lambda e: e["cdc_change_seq"])
    cursor = [0]
    live_customers: set[int] = set()

    def customer_at(ts: datetime) -> int:
        """A customer that is live at ``ts`` (orders reference existing customers)."""
        while (
            cursor[0] < len(customer_log) and customer_log[cursor[0]]["cdc_commit_timestamp"] <= ts
        ):
            e = customer_log[cursor[0]]
            if e["cdc_operation_type"] == "DELETE":
                live_customers.discard(e["customer_id"])
            else:
                live_customers.add(e["customer_id"])
            cursor[0] += 1
        return rng.choice(sorted(live_customers)) if live_customers else 1

    def new_order(ts: datetime) -> tuple[int, Event]:
        oid = next_id[0]
        next_id[0] += 1
        image = {
            "customer_id": customer_at(ts),
            "status": "NEW",
            "amount": round(rng.uniform(5, 500), 2),
            "currency": rng.choice(_CURRENCIES),
        }
        return oid, image

    def open_orders() -> list[int]:
        return [k for k in s.live_keys() if s.images[k]["status"] in _NEXT_STATUS]

    def two_updates_one_ms(ts: datetime) -> None:
        oid, image = new_order(ts)
        s.emit("INSERT", oid, ts, image)
        # PAID then SHIPPED in one millisecond; the later seq has the smaller microsecond,
        # so only (millisecond, seq) ordering gets SHIPPED as the final image.
        later = ts + timedelta(seconds=20)
        ms = later.replace(microsecond=later.microsecond // 1000 * 1000)
        s.emit("UPDATE", oid, ms + timedelta(microseconds=700), {**image, "status": "PAID"})
        s.emit("UPDATE", oid, ms + timedelta(microseconds=300), {**image, "status": "SHIPPED"})

    def insert_delete_one_ms(ts: datetime) -> None:
        oid, image = new_order(ts)
        s.emit("INSERT", oid, ts, image)
        s.emit("DELETE", oid, ts)  # created and voided in one transaction

    def update_first(ts: datetime) -> None:
        oid, image = new_order(ts)
        s.emit("UPDATE", oid, ts, {**image, "status": "PAID"})

    def delete_unseen(ts: datetime) -> None:
        s.emit("DELETE", UNSEEN_KEY_BASE + rng.randrange(1000), ts)

    specials = [
        (1, two_updates_one_ms),
        (2, insert_delete_one_ms),
        (3, update_first),
        (4, delete_unseen),
        (7, update_first),
    ]

    def normal(ts: datetime) -> None:
        pending = open_orders()
        roll = rng.random()
        if len(pending) < 3 or roll < 0.4:
            oid, image = new_order(ts)
            s.emit("INSERT", oid, ts, image)
        elif roll < 0.85:
            oid = rng.choice(pending)
            image = dict(s.images[oid])
            image["status"] = rng.choice(_NEXT_STATUS[image["status"]])
            if rng.random() < 0.1:
                image["amount"] = round(image["amount"] * 0.9, 2)  # a discount
            s.emit("UPDATE", oid, ts, image)
        elif roll < 0.93:
            oid = rng.choice(pending)
            s.emit("UPDATE", oid, ts, s.images[oid])  # visibly identical event
        else:
            done = [k for k in s.live_keys() if k not in pending] or s.live_keys()
            s.emit("DELETE", rng.choice(done), ts)

    _simulate(rng, start, hours, specials, normal, per_hour=(12, 22))
    return s.events


def _simulate(
    rng: random.Random,
    start: datetime,
    hours: int,
    specials: list[tuple[int, Callable[[datetime], None]]],
    normal: Callable[[datetime], None],
    per_hour: tuple[int, int],
) -> None:
    """Run ``normal`` at random times in each hour; planned edge cases take the first slots."""
    planned: dict[int, list[Callable[[datetime], None]]] = {}
    for hour, fn in specials:
        planned.setdefault(min(hour, hours - 1), []).append(fn)
    for h in range(hours):
        hour_start = start + timedelta(hours=h)
        todo = planned.get(h, [])
        times = _slot_times(rng, hour_start, max(rng.randint(*per_hour), len(todo)))
        for i, ts in enumerate(times):
            (todo[i] if i < len(todo) else normal)(ts)


# --------------------------------------------------------------------------- files


@dataclass
class _File:
    folder_hour: int  # hour index of the folder the file lands in
    events: list[Event]
    pinned: bool = False  # the one file guaranteed to be wholly late: left as it is


def _place(rng: random.Random, events: list[Event], start: datetime, hours: int) -> list[_File]:
    """Cut each commit hour into 1-3 files, make some late, move stragglers, add duplicates."""

    def commit_hour(e: Event) -> int:
        return int((e["cdc_commit_timestamp"] - start) // timedelta(hours=1))

    files: list[_File] = []
    pinned_hour = (hours - 1) // 3  # this hour's last file surely lands late (if hours >= 2)
    for h in range(hours):
        batch = [e for e in events if commit_hour(e) == h]
        if not batch:
            continue
        max_delay = min(MAX_DELAY_HOURS, hours - 1 - h)
        pin = h == pinned_hour and max_delay > 0 and len(batch) >= 2
        n = min(rng.randint(2 if pin else 1, 3), len(batch))
        chunks: list[list[Event]] = [[] for _ in range(n)]
        for i, e in enumerate(batch):
            chunks[i if i < n else rng.randrange(n)].append(e)
        for i, chunk in enumerate(chunks):
            if pin and i == n - 1:
                files.append(_File(h + min(2, max_delay), chunk, pinned=True))
                continue
            late = i > 0 and max_delay > 0 and rng.random() < 0.35  # chunk 0 is on time
            files.append(_File(h + (rng.randint(1, max_delay) if late else 0), chunk))

    # At most MAX_FILES_PER_FOLDER files per folder: fold extra late files into others.
    for h in range(hours):
        in_folder = [f for f in files if f.folder_hour == h and not f.pinned]
        while len(in_folder) + sum(f.folder_hour == h and f.pinned for f in files) > (
            MAX_FILES_PER_FOLDER
        ):
            extra = in_folder.pop(rng.randrange(len(in_folder)))
            files = [f for f in files if f is not extra]
            rng.choice(in_folder).events.extend(extra.events)

    # A few stragglers: single events committed hours earlier, inside a later folder's file.
    moved = 0
    for _ in range(50):
        if moved == 3:
            break
        src = rng.choice(files)
        if src.pinned:
            continue
        i = rng.randrange(len(src.events))
        h = commit_hour(src.events[i])
        if len(src.events) < 2 or h + 2 > hours - 1:
            continue
        target_hour = rng.randint(h + 2, min(h + MAX_DELAY_HOURS, hours - 1))
        targets = [f for f in files if f.folder_hour == target_hour and not f.pinned]
        if targets:
            rng.choice(targets).events.append(src.events.pop(i))
            moved += 1

    # Exact duplicates: the same event delivered again, mostly in another file or folder.
    def holds(f: _File, e: Event) -> bool:
        return any(x is e for x in f.events)

    crossed = False
    n_dupes = max(3, len(events) // 25)
    for e in rng.sample(events, min(n_dupes, len(events))):
        h = commit_hour(e)
        window = [f for f in files if h <= f.folder_hour <= h + MAX_DELAY_HOURS and not f.pinned]
        elsewhere = [f for f in window if not holds(f, e)]
        if elsewhere and (not crossed or rng.random() < 0.7):
            window = elsewhere
            crossed = True
        rng.choice(window).events.append(dict(e))
    return files


def _write_table(
    rng: random.Random, landing_root: Path, table: str, start: datetime, files: list[_File]
) -> int:
    """Write the files of one table; returns the number of rows written."""
    schema = SCHEMAS[table]
    rows_written = 0
    for h in sorted({f.folder_hour for f in files}):
        in_folder = sorted(
            (f for f in files if f.folder_hour == h and f.events),
            key=lambda f: min(e["cdc_change_seq"] for e in f.events),
        )
        folder = hour_folder(landing_root, table, start + timedelta(hours=h))
        folder.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(in_folder):
            rows = sorted(f.events, key=lambda e: e["cdc_change_seq"])
            if rng.random() < 0.25:
                rng.shuffle(rows)  # row order inside a file means nothing
            present = set().union(*(e.keys() for e in rows))
            file_schema = pa.schema([fld for fld in schema if fld.name in present])
            name = f"part-{i:05d}-{uuid.UUID(int=rng.getrandbits(128), version=4)}.snappy.parquet"
            pq.write_table(
                pa.Table.from_pylist(rows, schema=file_schema), folder / name, compression="snappy"
            )
            rows_written += len(rows)
    return rows_written


def generate_landing_zone(
    landing_root: Path,
    seed: int = 7,
    hours: int = 12,
    start: datetime = datetime(2024, 1, 1, tzinfo=UTC),
) -> dict[str, int]:
    """Write demo CDC files for ``customers`` and ``orders`` under ``landing_root``.

    Events are committed in ``[start, start + hours)``; files land in folders of the same
    window (late ones up to ``MAX_DELAY_HOURS`` after their events). Returns the number of
    rows written per table, re-delivered duplicates included.
    """
    if hours < 1:
        raise ValueError("hours must be at least 1")
    start = _utc(start)
    if start != start.replace(minute=0, second=0, microsecond=0):
        raise ValueError(f"start {start.isoformat()} must be on the hour")
    landing_root = Path(landing_root)
    rng = random.Random(seed)
    customers = _customer_events(rng, start, hours)
    orders = _order_events(rng, start, hours, customers)
    written: dict[str, int] = {}
    for table, events in ((CUSTOMERS, customers), (ORDERS, orders)):
        files = _place(rng, events, start, hours)
        written[table] = _write_table(rng, landing_root, table, start, files)
    return written


def _utc(ts: datetime) -> datetime:
    """A naive datetime is taken as UTC; an aware one is converted to UTC."""
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("landing_root", type=Path)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--hours", type=int, default=12)
    parser.add_argument(
        "--start",
        type=lambda s: _utc(datetime.fromisoformat(s)),
        default=datetime(2024, 1, 1, tzinfo=UTC),
        help="first hour, e.g. 2024-01-01T00:00 (UTC)",
    )
    args = parser.parse_args(argv)
    written = generate_landing_zone(args.landing_root, args.seed, args.hours, args.start)
    for table, n in written.items():
        print(f"{table}: {n} events written under {args.landing_root / table}")


if __name__ == "__main__":
    main()
