"""What ``rekey_table`` costs (issue 34, step 3), against a first load of the same events.

A rekey rebuilds the whole history from the whole change log (docs/HISTORY_MODE.md, "Changing the
key"), so its reference is the one range ``materialize()`` that built the table from all its
landing files: the same fold of the same events, plus reading and decoding the files. A table of
``--events`` events is built once (the harness's generator and cache), copied, rekeyed from
``[id]`` to keyless (every event's ``_fivetran_id`` computed and the change log rewritten, the
heaviest rekey; the generator's deletes carry the key only, so a key column cannot be added)
and back; each rekey's seconds,
the bytes it read (the change log) and wrote (its history commit, from the Delta log itself) and
its key counts are printed, and whether the way back gave the identical table, every cell and
``_fivetran_synced`` included.

Run it alone (2 shared cores: seconds are indicative, bytes and counts exact)::

    .venv/bin/python -m benchmarks.rekey_cost                    # 100k events
    .venv/bin/python -m benchmarks.rekey_cost --events 20000 --keys 5000
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.harness.generate import (
    add_table_options,
    build_cached_table,
    cached_hours,
)
from benchmarks.harness.measure import commit_bytes, local_session, table_bytes
from benchmarks.harness.report import fmt_mb, log
from benchmarks.harness.table import TABLE
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.rekey import RekeyRequest, rekey
from cdc_platform.lib.storage.warehouse import TablePaths


def sorted_rows(path: Path) -> list[tuple]:
    from deltalake import DeltaTable

    tbl = DeltaTable(str(path)).to_pyarrow_table()
    names = sorted(tbl.column_names)
    return sorted((tuple(r[n] for n in names) for r in tbl.to_pylist()), key=str)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    add_table_options(p, "/tmp/cdc_rekey_bench")
    args = p.parse_args(argv)
    keys = min(args.keys, args.events)
    spark = local_session("rekey_bench")
    landing = cached_hours(args.work_dir, keys, args.events, args.seed)
    built, meta = build_cached_table(spark, landing)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    warehouse = run / "warehouse"
    shutil.copytree(built, warehouse)
    paths = TablePaths.of(warehouse, TABLE.name)
    history = paths.history.path
    original = sorted_rows(history)
    log_bytes = table_bytes(paths.changelog.path)
    print(
        f"table: {meta['events']:,} events, {meta['versions']:,} versions over {keys:,} keys; "
        f"change log {fmt_mb(log_bytes)} MB, history {fmt_mb(meta['bytes'])} MB"
    )
    print(
        f"reference: the first load of the same events (one range materialize): "
        f"{meta['seconds']:.1f} s{' (from the cache)' if meta['cached'] else ''}"
    )
    for keyless in (True, False):
        table = replace(TABLE, primary_key=None if keyless else ("id",), keyless=keyless)
        from deltalake import DeltaTable

        before = DeltaTable(str(history)).version()
        t0 = time.perf_counter()
        request = RekeyRequest(now=datetime.now(UTC).replace(microsecond=0))
        r = rekey(HistoryTable(spark, table, warehouse), request)
        seconds = time.perf_counter() - t0
        after = DeltaTable(str(history)).version()
        written = commit_bytes(history, range(before + 1, after + 1))
        c = r.counts
        assert c is not None
        print(
            f"rekey to {'keyless' if keyless else ['id']}: {seconds:.1f} s ({seconds / meta['seconds']:.2f}x the first "
            f"load); keys {c.keys_before:,} -> {c.keys_after:,} ({c.split:,} split, "
            f"{c.merged:,} merged); {r.versions:,} versions, {r.synced_kept:,} kept their synced "
            f"time; read the change log ({fmt_mb(log_bytes)} MB), wrote {fmt_mb(written.added_bytes)} MB"
            f" in {written.files_added} files, removed {written.files_removed} files"
        )
    log(f"work dir: {run}")
    print(f"the way back gives the identical table: {sorted_rows(history) == original}")
    spark.stop()


if __name__ == "__main__":
    main()
