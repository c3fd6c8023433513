"""The quarantine: landing files set aside, each with the reason, the first bad row and a count.

The file itself stays untouched in the landing zone. The table holds the *current* verdict per
file: reading a file again (fixed, or re-delivered) replaces its entry, and a file that now
reads cleanly leaves the quarantine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa

from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where

SCHEMA = pa.schema(
    [
        pa.field("file", pa.string()),
        pa.field("partition", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("row", pa.int64()),
        pa.field("bad_rows", pa.int64()),
        pa.field("detected_at", pa.timestamp("us", tz="UTC")),
    ]
)


@dataclass(frozen=True)
class QuarantinedFile:
    file: str
    partition: str
    reason: str
    row: int | None
    bad_rows: int
    detected_at: datetime


def record(
    path: Where,
    files_read: Sequence[str],
    entries: Sequence[QuarantinedFile],
    partitions: Sequence[str] = (),
) -> None:
    """Replace the verdict of every file read in this run in one commit (small: one row a file).

    A run reads every file of its ``partitions``, so their entries are replaced too: a set-aside
    file that was removed (say re-delivered under another name) leaves the quarantine.
    """
    if not files_read and not entries and not partitions:
        return
    files = sorted(set(files_read) | {e.file for e in entries})
    clauses = [
        delta.in_predicate(column, values)
        for column, values in (("file", files), ("partition", sorted(set(partitions))))
        if values
    ]
    Ledger(path, SCHEMA).replace([e.__dict__ for e in entries], " OR ".join(clauses))


def current(path: Where) -> list[QuarantinedFile]:
    rows = Ledger(path, SCHEMA).rows()
    return sorted((QuarantinedFile(**r) for r in rows), key=lambda q: q.file)
