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
from deltalake import write_deltalake

from cdc_platform.lib import delta
from cdc_platform.lib.storage import Location, Where

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
    data = pa.Table.from_pylist([e.__dict__ for e in entries], schema=SCHEMA)
    loc = Location.of(path)
    if not delta.exists(loc):
        if not entries:
            return
        if loc.is_local:
            loc.path.mkdir(parents=True, exist_ok=True)
        write_deltalake(loc.uri, data, mode="append", storage_options=loc.storage_options)
        return
    files = sorted(set(files_read) | {e.file for e in entries})
    clauses = [
        delta.in_predicate(column, values)
        for column, values in (("file", files), ("partition", sorted(set(partitions))))
        if values
    ]
    predicate = " OR ".join(clauses)
    write_deltalake(
        loc.uri,
        data,
        mode="overwrite",
        predicate=predicate,
        storage_options=loc.storage_options,
    )


def current(path: Where) -> list[QuarantinedFile]:
    if not delta.exists(path):
        return []
    rows = delta.read_arrow(path).to_pylist()
    return sorted((QuarantinedFile(**r) for r in rows), key=lambda q: q.file)
