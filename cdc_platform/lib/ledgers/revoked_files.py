"""The landing files a user un-applied, with the reason, when and by which run.

One row per revoked file (relative to the landing root, as ``_cdc_source_file`` names it), in
``<warehouse_root>/_cdc/<table>/revoked_files``. Materializations never read a revoked file and
the change log never takes its events again, until the user re-admits it, which deletes its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa

from cdc_platform.lib.columns import SOURCE_FILE
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where

SCHEMA = pa.schema(
    [
        pa.field("file", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("revoked_at", pa.timestamp("us", tz="UTC")),
    ]
)


@dataclass(frozen=True)
class RevokedFile:
    file: str
    reason: str
    run_id: str
    revoked_at: datetime


def revoked(path: Where) -> list[RevokedFile]:
    """Every revoked file, by name; empty when none ever was."""
    rows = Ledger(path, SCHEMA).rows()
    return sorted((RevokedFile(**r) for r in rows), key=lambda r: r.file)


def may_hold(f: delta.DataFile, names: set[str]) -> bool:
    """Whether a change-log file may hold an event of the files ``names``, by the statistics
    of its ``_cdc_source_file`` column (no statistics: it may)."""
    lo, hi = f.min_values.get(SOURCE_FILE), f.max_values.get(SOURCE_FILE)
    if not isinstance(lo, str) or not isinstance(hi, str):
        return True
    return any(lo <= n <= hi for n in names)


def revoked_names(path: Where) -> set[str]:
    return {r.file for r in revoked(path)}


def add(path: Where, files: Sequence[str], reason: str, run_id: str, at: datetime) -> list[str]:
    """Record ``files`` as revoked; those already revoked keep their first record (a replay
    changes nothing). Returns the files newly recorded."""
    new = sorted(set(files) - revoked_names(path))
    if not new:
        return []
    rows = [{"file": f, "reason": reason, "run_id": run_id, "revoked_at": at} for f in new]
    Ledger(path, SCHEMA).append(rows)
    return new


def remove(path: Where, files: Sequence[str]) -> list[str]:
    """Re-admit ``files``: their rows go, in one commit. Returns those that were revoked."""
    gone = sorted(set(files) & revoked_names(path))
    if not gone:
        return []
    Ledger(path, SCHEMA).delete(delta.in_predicate("file", gone))
    return gone
