"""Landing data and configs for the benchmarks: random CDC events, hourly folders, cached
landing zones and history tables (rebuilt when ``cdc_platform/lib`` changes), and the config
and Dagster instance a CLI run reads."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.harness.measure import table_bytes, table_rows
from benchmarks.harness.report import log
from benchmarks.harness.table import (
    HOUR_US,
    REPO_ROOT,
    START_US,
    TABLE,
    TABLE_NAME,
    TS_TYPE,
    US,
    history_path,
    hour_at,
)
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.pipeline import materialize

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

STATUSES = np.array(["new", "paid", "shipped", "returned", "cancelled"])
OPS = np.array(["INSERT", "UPDATE", "DELETE"])
OP_WEIGHTS = (0.04, 0.92, 0.04)
EVENTS_PER_HOUR = 10_000  # of a built table: a deeper table is more hours
GENERATOR_VERSION = 1  # bump when the generated data changes, so caches are rebuilt


class EventGenerator:
    """Random CDC events over ``keys`` keys: full row images, deletes carry only the key.

    With ``every_key_first`` the first ``keys`` in-order events give each key its first event
    (in a random order) and only then are keys drawn at random, so a table of ``keys`` events
    already has every key that a deeper one has and they differ by depth alone (random draws
    alone leave a third of the keys unseen after ``keys`` events).
    """

    def __init__(
        self, keys: int, seed: int, first_seq: int = 1, every_key_first: bool = False
    ) -> None:
        self.keys = keys
        self.rng = np.random.default_rng(seed)
        self.next_seq = first_seq
        self.seen = np.zeros(keys, dtype=bool)
        # The keys still to be given their first event, in order (none without every_key_first).
        self.first_order = self.rng.permutation(keys) if every_key_first else np.empty(0, np.int64)
        self.introduced = 0

    def events(
        self, n: int, hour_start_us: int, late: int = 0, late_window_us: tuple[int, int] = (0, 0)
    ) -> pa.Table:
        """``n - late`` events committed in the hour (in order), ``late`` committed in the window
        on keys that already have events."""
        rng = self.rng
        in_order = n - late
        ids = rng.integers(0, self.keys, in_order, dtype=np.int64)
        fresh = self.first_order[self.introduced : self.introduced + in_order]
        ids[: len(fresh)] = fresh
        self.introduced += len(fresh)
        ts = hour_start_us + np.sort(rng.integers(0, HOUR_US, in_order, dtype=np.int64))
        if late:
            existing = np.flatnonzero(self.seen)
            if not len(existing):
                raise ValueError("late events need keys that already have events")
            late_ids = rng.choice(existing, late).astype(np.int64)
            late_ts = np.sort(rng.integers(late_window_us[0], late_window_us[1], late))
            ids = np.concatenate([late_ids, ids])
            ts = np.concatenate([late_ts.astype(np.int64), ts])
        seq = np.arange(self.next_seq, self.next_seq + n, dtype=np.int64)
        self.next_seq += n
        self.seen[ids] = True

        op_idx = rng.choice(3, n, p=OP_WEIGHTS)
        deleted = op_idx == 2
        ts_arr = pa.array(ts, pa.int64()).cast(TS_TYPE)
        note_null = deleted | (rng.random(n) < 0.1)
        notes = np.char.add("note ", rng.integers(0, 1000, n).astype(str))
        return pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "status": pa.array(STATUSES[rng.integers(0, len(STATUSES), n)], mask=deleted),
                "amount": pa.array(np.round(rng.uniform(1, 1000, n), 2), mask=deleted),
                "quantity": pa.array(rng.integers(1, 100, n).astype(np.int32), mask=deleted),
                "updated_at": pa.array(ts, pa.int64(), mask=deleted).cast(TS_TYPE),
                "is_priority": pa.array(rng.random(n) < 0.1, mask=deleted),
                "note": pa.array(notes, mask=note_null),
                "cdc_operation_type": pa.array(OPS[op_idx]),
                "cdc_change_seq": pa.array(seq),
                "cdc_commit_timestamp": ts_arr,
            }
        )


def write_hour(landing: Path, index: int, table: pa.Table) -> None:
    folder = hour_folder(landing, TABLE_NAME, hour_at(index))
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / f"part-{index:05d}.parquet")


def split_evenly(total: int, parts: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(total), parts)]


def generate_landing(
    landing: Path, keys: int, events: int, hours: int, seed: int, every_key_first: bool = False
) -> EventGenerator:
    """``events`` in-order events over ``hours`` hourly folders; returns the generator's state."""
    gen = EventGenerator(keys, seed, every_key_first=every_key_first)
    for index, n in enumerate(split_evenly(events, hours)):
        if n:
            write_hour(landing, index, gen.events(n, START_US + index * HOUR_US))
    return gen


def params_key(**params: Any) -> str:
    text = json.dumps({**params, "generator": GENERATOR_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def code_hash() -> str:
    """A digest of ``cdc_platform/lib``: a table built by other code is rebuilt, not reused."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "cdc_platform" / "lib").rglob("*.py")):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class CachedLanding:
    root: Path
    next_seq: int
    seen: np.ndarray
    hours: int
    key: str  # params_key of its landing_params: also names the table built from it


def landing_params(
    keys: int, events: int, hours: int, seed: int, every_key_first: bool = False
) -> dict[str, Any]:
    """What a generated landing zone (and the table built from it) is a function of."""
    params: dict[str, Any] = {"keys": keys, "events": events, "hours": hours, "seed": seed}
    if every_key_first:  # absent otherwise, so the caches of the other sections stay valid
        params["every_key_first"] = True
    return params


def cached_landing(cache_dir: Path, params: dict[str, Any]) -> CachedLanding:
    """Landing files for ``landing_params``, generated once (the marker is written last)."""
    key = params_key(**params)
    root = cache_dir / f"landing-{key}"
    marker = root / "_complete.json"
    events, hours = params["events"], params["hours"]
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.perf_counter()
        gen = generate_landing(root, **params)
        np.save(root / "_seen.npy", gen.seen)
        marker.write_text(json.dumps({"next_seq": gen.next_seq, "hours": hours}))
        log(
            f"  generated {events:,} events in {hours} hour folders ({time.perf_counter() - t0:.1f} s)"
        )
    meta = json.loads(marker.read_text())
    return CachedLanding(root, int(meta["next_seq"]), np.load(root / "_seen.npy"), hours, key)


def cached_hours(work_dir: Path, keys: int, events: int, seed: int) -> CachedLanding:
    """``events`` in-order events over ``keys`` keys in hours of ``EVENTS_PER_HOUR``, generated
    once under ``work_dir/tables`` (the tables built from them are cached there too)."""
    cache = work_dir / "tables"
    cache.mkdir(parents=True, exist_ok=True)
    hours = max(1, -(-events // EVENTS_PER_HOUR))
    return cached_landing(cache, landing_params(keys, events, hours, seed))


def build_cached_table(spark: SparkSession, landing: CachedLanding) -> tuple[Path, dict[str, Any]]:
    """The history table built from ``landing`` by ONE range call, cached beside it per code
    version."""
    warehouse = landing.root.parent / f"warehouse-{landing.key}-code-{code_hash()}"
    marker = warehouse.parent / f"{warehouse.name}.json"
    if marker.exists() and warehouse.is_dir():
        meta = json.loads(marker.read_text())
        meta["cached"] = True
        return warehouse, meta
    shutil.rmtree(warehouse, ignore_errors=True)
    hours = [hour_at(i) for i in range(landing.hours)]
    t0 = time.perf_counter()
    result = materialize(spark, TABLE, landing.root, warehouse, hours)
    seconds = time.perf_counter() - t0
    history = history_path(warehouse)
    versions, active = table_rows(history)
    meta = {
        "seconds": round(seconds, 2),
        "events": result.events_read,
        "versions": versions,
        "active": active,
        "bytes": table_bytes(history),
    }
    marker.write_text(json.dumps(meta))
    meta["cached"] = False
    return warehouse, meta


def write_config(run_dir: Path, landing: Path, warehouse: Path) -> dict[str, str]:
    """A config file and a Dagster instance for the CLI; returns the env to run it with."""
    config = run_dir / "cdc_platform.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "landing_root": str(landing),
                "warehouse_root": str(warehouse),
                "tables": [
                    {"name": TABLE_NAME, "primary_key": ["id"], "start": TABLE.start_partition_key}
                ],
            },
            indent=2,
        )
    )
    home = run_dir / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env["CDC_PLATFORM_CONFIG"] = str(config)
    env["DAGSTER_HOME"] = str(home)
    return env


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def hour_events(gen: EventGenerator, hour: datetime, n: int) -> pa.Table:
    """``n`` events committed in the hour, with at least one row image (a delete-only hour would
    leave nothing to see in the table)."""
    while True:
        events = gen.events(n, int(hour.timestamp()) * US)
        if set(events.column("cdc_operation_type").to_pylist()) != {"DELETE"}:
            return events


# Made-up source systems and entities, so the tables look like a real landing zone's.
SYSTEMS = ("sales", "erp", "crm", "billing", "hr", "logistics", "support", "marketing")
ENTITIES = (
    "orders", "customers", "payments", "invoices", "items", "accounts", "contacts", "leads",
    "tickets", "shipments", "products", "prices", "refunds", "users", "events", "addresses",
    "contracts", "employees", "vendors", "stock", "returns", "coupons", "campaigns", "notes",
    "sessions",
)  # fmt: skip


def table_names(n: int) -> list[str]:
    names = [f"{s}_{e}" for e in ENTITIES for s in SYSTEMS]
    names += [f"extra_{i:04d}" for i in range(max(0, n - len(names)))]
    return sorted(names[:n])


def add_table_options(p: argparse.ArgumentParser, work_dir: str) -> None:
    """The options of a benchmark over one generated table: its events and keys (a key count
    over the events is cut to them), the seed, and where the cache lives."""
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--keys", type=int, default=20_000, help="(at most --events)")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--work-dir", type=Path, default=Path(work_dir))
