"""Which landing files each hourly partition was last materialized from.

One row per file read, replaced partition by partition on every materialization:
``<warehouse_root>/_cdc/<table>/applied_files``. The landing sensor reads it when its cursor is
empty (first start, or a reset from the UI) so that it starts from what is already applied
instead of requesting every folder again.

Why not the change log's ``_cdc_source_file``: a file whose events were all duplicates of events
logged before (a re-delivery), or that holds no rows, is read but never appears there, and a
file name says nothing about a file rewritten in place. This ledger holds every file read with
the size and mtime the sensor fingerprints, so "applied" means exactly "this content was read".

Each run adds a small file (8,760 a year for an hourly table): ``table_maintenance`` compacts
them into files sorted by partition (``compact``) and VACUUMs the replaced ones, and a read of
some partitions (the sensor's reconcile) opens only the files whose statistics may hold them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa

from cdc_platform.lib.landing.where.layout import LandingFile
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import Landing
from cdc_platform.lib.ledgers.ledger import Compacted, Ledger
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.warehouse import TablePaths

SCHEMA = pa.schema(
    [
        pa.field("partition", pa.string()),
        pa.field("file", pa.string()),  # relative to the landing root, like _cdc_source_file
        pa.field("size", pa.int64()),
        pa.field("mtime_ns", pa.int64()),
        pa.field("run_id", pa.string()),
        pa.field("applied_at", pa.timestamp("us", tz="UTC")),
        # On a bucket, the ETag of the object version read (every read is pinned to it); null
        # for a file of a local landing zone.
        pa.field("etag", pa.string()),
    ]
)

FileIdentity = tuple[str, int, int]  # (landing-relative path, size, mtime_ns)


@dataclass(frozen=True)
class AppliedFile:
    partition: str
    file: LandingFile


def ledger_path(warehouse_root: Where, table: str) -> Location:
    return of_table(TablePaths.of(warehouse_root, table))


def of_table(paths: TablePaths) -> Location:
    """The ledger beside the table's change log (``_cdc/<table>/applied_files``)."""
    return paths.changelog.parent / "applied_files"


def compact(path: Where) -> Compacted:
    """Few files sorted by partition in place of the runs' small ones (``Ledger.compact``):
    no row changes, and a read of some partitions skips the rest by statistics."""
    return Ledger(path, SCHEMA).compact(["partition", "file"])


def identity(landing_root: Landing, f: LandingFile) -> FileIdentity:
    """A file as the ledger records it: a name that is not UTF-8 with ``\\x`` escapes (a Delta
    string holds UTF-8 only), as the quarantine names it."""
    return (zone_at(landing_root).relative(f.path), f.size, f.mtime_ns)


def record(
    path: Where,
    landing_root: Landing,
    partitions: Sequence[str],
    files: Iterable[AppliedFile],
    run_id: str,
    applied_at: datetime,
) -> None:
    """Replace the rows of ``partitions`` with ``files`` in one commit."""
    rows = [
        {
            "partition": a.partition,
            "file": identity(landing_root, a.file)[0],
            "size": a.file.size,
            "mtime_ns": a.file.mtime_ns,
            "run_id": run_id,
            "applied_at": applied_at,
            "etag": a.file.etag or None,
        }
        for a in files
    ]
    where = delta.in_predicate("partition", sorted(set(partitions))) if partitions else None
    Ledger(path, SCHEMA).replace(rows, where)


def applied_by_partition(path: Where, partitions: Iterable[str]) -> dict[str, set[FileIdentity]]:
    """The (file, size, mtime_ns) recorded for each of ``partitions`` (one read of the files
    whose statistics may hold them)."""
    wanted = set(partitions)
    tbl = Ledger(path, SCHEMA).read(
        columns=["partition", "file", "size", "mtime_ns"], where_in=("partition", wanted)
    )
    out: dict[str, set[FileIdentity]] = {}
    for row in tbl.to_pylist():
        if row["partition"] in wanted:
            out.setdefault(row["partition"], set()).add((row["file"], row["size"], row["mtime_ns"]))
    return out


def applied(path: Where) -> set[FileIdentity]:
    """Every (file, size, mtime_ns) recorded; empty when nothing was recorded yet."""
    tbl = Ledger(path, SCHEMA).read(columns=["file", "size", "mtime_ns"])
    return set(
        zip(
            tbl["file"].to_pylist(),
            tbl["size"].to_pylist(),
            tbl["mtime_ns"].to_pylist(),
            strict=True,
        )
    )
