"""What ``erase_key`` costs (issue 34, step 5), and what its filter adds to every later load.

An erasure reads and hashes every event of the change log to find the keys' (docs/limitations.md),
rewrites the change-log files holding them and recomputes the keys; its reference is the one
range ``materialize()`` that built the same table from its landing files, measured here in the
same sitting, after a warm-up load. A table with erased keys hashes each new event's key in a Python task before it is
logged: the same first load into a warehouse whose erased-keys ledger already holds ``--erase``
keys is measured beside the plain one, and both must give the same table but the erased keys.

Run it alone (2 shared cores: seconds are indicative, bytes and counts exact)::

    .venv/bin/python -m benchmarks.erase_cost --events 20000 --keys 5000
"""

from __future__ import annotations

import argparse
import base64
import shutil
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from benchmarks.harness.generate import add_table_options, cached_hours
from benchmarks.harness.measure import commit_bytes, local_session, table_bytes
from benchmarks.harness.report import fmt_mb, log
from benchmarks.harness.table import TABLE, hour_at
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.ledgers import erased_keys
from cdc_platform.lib.operations.erase import EraseRequest, erase
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths

KEYRING = Keyring.from_mapping({"hash_salt": base64.b64encode(b"benchmark-salt-0123456").decode()})


def keys_of(path: Path) -> set[int]:
    from deltalake import DeltaTable

    return set(DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).column(0).to_pylist())


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    add_table_options(p, "/tmp/cdc_erase_bench")
    p.add_argument("--erase", type=int, default=10, help="keys erased")
    args = p.parse_args(argv)
    keys = min(args.keys, args.events)
    spark = local_session("erase_bench")
    landing = cached_hours(args.work_dir, keys, args.events, args.seed)
    n_hours = landing.hours
    hours = [hour_at(i) for i in range(n_hours)]
    run = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    plain, filtered = run / "plain", run / "filtered"
    erased = list(range(1, args.erase + 1))  # ids the generator gives (1..keys)
    salt = KEYRING.hash_salt
    assert salt is not None
    hashes = erased_keys.key_hashes({"id": pa.array(erased, pa.int64())}, len(erased), salt)
    now = datetime.now(UTC).replace(microsecond=0)

    materialize(spark, TABLE, landing.root, run / "warm-up", hours, KEYRING)  # JIT, caches
    t0 = time.perf_counter()
    loaded = materialize(spark, TABLE, landing.root, plain, hours, KEYRING)
    load_s = time.perf_counter() - t0
    paths = TablePaths.of(filtered, TABLE.name)
    key_types = pa.schema([pa.field("id", pa.int64())])
    erased_keys.add(
        paths.erased_keys, hashes.to_pylist(), key_types, "benchmark", "bench", now, salt
    )
    t0 = time.perf_counter()
    materialize(spark, TABLE, landing.root, filtered, hours, KEYRING)
    filtered_s = time.perf_counter() - t0
    print(
        f"table: {loaded.events_read:,} events over {keys:,} keys in {n_hours} hours; change log "
        f"{fmt_mb(table_bytes(TablePaths.of(plain, TABLE.name).changelog.path))} MB"
    )
    print(f"reference: the first load (one range materialize): {load_s:.1f} s")
    print(
        f"the same load with {len(erased)} erased keys in the ledger: {filtered_s:.1f} s "
        f"({filtered_s / load_s:.2f}x)"
    )

    from deltalake import DeltaTable

    plain_paths = TablePaths.of(plain, TABLE.name)
    log_path, history = plain_paths.changelog.path, plain_paths.history.path
    before = {t: DeltaTable(str(t)).version() for t in (log_path, history)}
    t0 = time.perf_counter()
    r = erase(
        HistoryTable(spark, TABLE, plain, keyring=KEYRING),
        EraseRequest(tuple({"id": str(k)} for k in erased), "benchmark", "bench", now=now),
    )
    erase_s = time.perf_counter() - t0
    written = {
        name: commit_bytes(t, range(before[t] + 1, DeltaTable(str(t)).version() + 1))
        for name, t in (("change log", log_path), ("history", history))
    }
    print(
        f"erase_key of {len(erased)} keys: {erase_s:.1f} s ({erase_s / load_s:.2f}x the first "
        f"load); {r.events_removed:,} events of {r.keys_found} keys removed; "
        + "; ".join(
            f"{name}: wrote {fmt_mb(w.added_bytes)} MB in {w.files_added} files, removed "
            f"{w.files_removed} files ({fmt_mb(w.removed_bytes)} MB)"
            for name, w in written.items()
        )
    )
    same = keys_of(history) == keys_of(TablePaths.of(filtered, TABLE.name).history.path)
    print(f"erased then, or filtered from the start, give the same keys: {same}")
    print(f"no erased key left: {not keys_of(history) & set(erased)}")
    log(f"work dir: {run}")
    shutil.rmtree(run, ignore_errors=True)
    spark.stop()


if __name__ == "__main__":
    main()
