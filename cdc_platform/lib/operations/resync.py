"""Re-syncing a table from a snapshot: the full current image of every key at a time R.

As Fivetran's "Re-syncs in history mode" (the seeds' worked tables):

* a key whose snapshot image equals its live version keeps that version;
* a key whose image differs gets a new version, starting at the snapshot row's own
  ``cdc_commit_timestamp`` when it carries one, else at R; the version before it ends 1 ms
  earlier (rule 3);
* a live key absent from the snapshot is closed at R (it no longer exists);
* the exception: a snapshot row whose time is earlier than every version of its key replaces
  the key's history (its previous versions, and their events, are removed).

A snapshot is a folder of files in the table's landing format (any codec it uses), with the
key and data columns; ``cdc_operation_type`` may be absent or ``INSERT``, ``cdc_change_seq`` is
not needed, ``cdc_commit_timestamp`` is optional. Each row becomes an ``INSERT`` event in the
change log (its source: the snapshot file and row), each absent key a ``DELETE`` at R (source
``resync:at=<R>``), so the table stays the fold of its change log and CDC events that come
later, late ones included, are placed around the snapshot as usual. The re-sync's seqs derive
from R and sort below any real seq: in a millisecond, a real CDC event comes after the
snapshot's (the adoption's sort lower still, a truncate's higher). The same re-sync run again
logs nothing new. A snapshot with a bad file, a row without its key, a key on two rows or an
operation other than ``INSERT`` is refused whole, naming the file and row: a snapshot
applied in part would close every key of the missing part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import (
    ACTIVE,
    CDC_COLUMNS,
    CURRENT,
    OP,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    START,
    TS,
    TS_TYPE,
    UNMODIFIED,
    col,
    cols,
    internal,
    timestamp_lit,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import MergeResult
from cdc_platform.lib.history.protected_columns import changelog_properties, record_hashing
from cdc_platform.lib.history.table import Change, HistoryTable
from cdc_platform.lib.landing.batch import LandingBatch
from cdc_platform.lib.landing.decoding.codecs import LandingFileError
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.reading.file_reader import LandingReader
from cdc_platform.lib.landing.reading.passes import event_schema
from cdc_platform.lib.landing.rows.timestamps import CLOCK_SKEW, ahead_of
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.safe_open import FileId
from cdc_platform.lib.landing.where.zone import IncompleteSnapshotError, LandingZone, LocalZone
from cdc_platform.lib.ledgers import erased_keys, revoked_files
from cdc_platform.lib.operations.operation import Request, hour_start, to_ms
from cdc_platform.lib.storage.roots import SourceRootError, snapshot_folder
from cdc_platform.lib.storage.schema import spark_schema
from cdc_platform.lib.storage.stores import Location, Where

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

SOURCE_PREFIX = "resync:at="
# Re-sync seqs: 2 * R in epoch ms (+1 for the deletes of absent keys) above this base: above an
# adoption's (from -2**62), below a truncate's (-T in ms, at least -2.6e14) and any real seq.
SEQ_BASE = -(2**61)
_SAMPLE = 5
# The repeated-key check's aggregates: working names, so a key column called ``n`` or ``at``
# cannot clash with them.
_ROWS = internal("resync_rows")
_PLACES = internal("resync_places")
RESYNC = "resync_table"


class ResyncError(Refusal):
    """The snapshot cannot be applied as it is; nothing was written."""


@dataclass(frozen=True)
class ResyncRequest(Request):
    """The snapshot folder (as typed: checked against ``snapshot_roots``, the config's, never
    resolved by the caller) and the re-sync's time R (None: ``now``)."""

    snapshot: Path | str
    snapshot_roots: tuple[Where, ...]
    at: datetime | None = None


@dataclass(frozen=True)
class ResyncResult:
    at: datetime
    snapshot: str
    files: int
    rows: int  # snapshot rows (one per key)
    keys_closed: int  # live keys absent from the snapshot, closed at R
    keys_replaced: int  # keys whose history the snapshot replaced (the exception)
    events_new: int  # 0 when the same re-sync ran before
    merge: MergeResult
    changed: bool = True

    def summary(self) -> str:
        return (
            f"re-synced {self.rows} row(s) from {self.files} file(s) at {self.at.isoformat()}: "
            f"{self.keys_closed} key(s) closed, {self.keys_replaced} replaced, history version "
            f"{self.merge.history_version}"
        )

    def metadata(self) -> dict[str, Any]:
        return {
            "operation": RESYNC,
            "at": self.at.isoformat(),
            "snapshot": self.snapshot,
            "files": self.files,
            "rows": self.rows,
            "keys_closed": self.keys_closed,
            "keys_replaced": self.keys_replaced,
            "events_new": self.events_new,
            **self.merge.metadata(),
        }

    @property
    def hours(self) -> tuple[datetime, ...]:
        return (hour_start(self.at),)


@dataclass(frozen=True)
class _Snapshot:
    """The snapshot as read and checked: its events (None: no row), how many rows and files,
    and what the change log records of its files."""

    events: DataFrame | None
    rows: int
    files: int
    shape: StructType
    own_sources: list[str]
    properties: dict[str, str]
    schemas: list[pa.Schema | None]
    salt: bytes | None


def resync_seqs(at: datetime) -> tuple[int, int]:
    """The seqs of a re-sync at ``at``: its snapshot rows', and its deletes'."""
    base = SEQ_BASE + 2 * int(to_ms(at).timestamp() * 1000)
    return base, base + 1


def source_name(at: datetime) -> str:
    """What ``_cdc_source_file`` says of the deletes a re-sync logs for absent keys."""
    return SOURCE_PREFIX + to_ms(at).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SnapshotReader(LandingReader):
    """Reads snapshot files as events: every row an ``INSERT`` with the re-sync's seq, at its
    own ``cdc_commit_timestamp`` or, without one, at R. Decoding and validation are the
    landing reader's (so a snapshot may be CSV, compressed or encrypted like the table).

    A snapshot folder is named by a run, so a file in it may be anything but the table's: its
    files are opened only below ``folder`` (no symlink, the listed file), no reason ever quotes
    a cell, and a column whose name is not one of ``known`` (the table's) is named by its
    position, never by what the file says (a header line can be a secret)."""

    def __init__(
        self,
        table: TableConfig,
        landing_root: Where,
        keyring: Keyring | None,
        at: datetime,
        seq: int,
        source: LandingZone | Path | None = None,
        known: Sequence[str] = (),
    ) -> None:
        super().__init__(table, landing_root, keyring)
        self.at = at
        self.seq = seq
        self.hide_values = True
        if source is not None:  # the snapshot's folder (or prefix): files open only below it
            self.source = source if isinstance(source, LandingZone) else LocalZone(source)
        self.known = frozenset([*table.key, *table.columns, *CDC_COLUMNS, UNMODIFIED, *known])

    def label(self, name: str, position: int) -> str:
        return f"'{name}'" if name in self.known else f"#{position + 1}"

    def reads_footer_first(self) -> bool:
        return False  # the change columns are made up by ``load``, not in the footer

    def load(self, path: str, columns: Sequence[str] | None = None) -> pa.Table:
        tbl = super().load(path)
        n = tbl.num_rows
        if OP in tbl.column_names:
            ops = tbl[OP].combine_chunks()
            wrong = pc.and_(pc.is_valid(ops), pc.not_equal(ops, "INSERT"))  # pyright: ignore[reportAttributeAccessIssue]
            bad = pc.index(wrong, True).as_py()  # pyright: ignore[reportAttributeAccessIssue]
            if bad >= 0:
                raise LandingFileError(
                    f"row {bad + 1}: cdc_operation_type is not INSERT: a snapshot holds row"
                    " images, every row an INSERT",
                    bad + 1,
                )
        ts = (
            pc.fill_null(tbl[TS], pa.scalar(self.at, TS_TYPE))  # pyright: ignore[reportAttributeAccessIssue]
            if TS in tbl.column_names
            else pa.array([self.at] * n, TS_TYPE)
        )
        tbl = tbl.drop_columns([c for c in (OP, SEQ, TS) if c in tbl.column_names])
        tbl = tbl.append_column(OP, pa.array(["INSERT"] * n, pa.string()))
        tbl = tbl.append_column(SEQ, pa.array([self.seq] * n, pa.int64()))
        return tbl.append_column(TS, ts)


def snapshot_source(folder: Path | Location, landing_root: Where) -> LandingZone:
    """Where a snapshot's files are opened: its folder, or its S3 prefix, reached with the
    landing zone's storage options when the landing zone is on S3 too (else the AWS chain)."""
    if isinstance(folder, Path):
        return LocalZone(folder)
    landing = Location.of(landing_root)
    options = landing.options if landing.scheme == "s3" else {}
    return zone_at(Location(folder.uri, options))


def resync(t: HistoryTable, request: ResyncRequest) -> ResyncResult:
    """Apply the snapshot as a re-sync at R (see the module docstring).

    The snapshot must be under one of ``snapshot_roots`` (the config's), apart from the landing
    and warehouse roots (``lib.storage.roots``): a run's config never makes the service read
    another folder."""
    now = request.now
    at = to_ms(request.at or now)
    _check_time(at, now)
    erased_keys.load(t.paths.erased_keys, t.keyring)  # without the salt: refused, nothing written
    snap = _read_snapshot(t, request, at)
    # A re-run after its events were un-applied logs them again (the user asks for it).
    revoked_files.remove(t.paths.revoked_files, snap.own_sources)
    # A hashed column's source types, so an erasure hashes a cleartext as these rows were.
    record_hashing(t.fresh(t.paths.changelog), t.config, snap.salt, snap.schemas)
    replaced: list[int] = []  # keys whose history a committed removal took (any attempt)
    (keys_closed, new_events), merge = t.change(
        now, lambda c: _apply_snapshot(c, snap, at, replaced), "re-sync"
    )
    return ResyncResult(
        at,
        str(request.snapshot),
        snap.files,
        snap.rows,
        keys_closed,
        sum(replaced),
        new_events,
        merge,
    )


def _check_time(at: datetime, now: datetime) -> None:
    if at.year < 1971:
        raise ResyncError(f"re-sync at {at.isoformat()}: a time after 1970 is expected")
    if ahead_of(at, now):
        raise ResyncError(
            f"re-sync at {at.isoformat()}: that is in the future (now is {now.isoformat()}, "
            f"{CLOCK_SKEW.total_seconds():.0f} s of clock skew allowed): its versions would "
            "come after every CDC event logged until then; give a time that has passed, or "
            "none for now"
        )


def _listed(
    t: HistoryTable, request: ResyncRequest
) -> tuple[LandingZone, list[str], dict[str, FileId], Path | Location]:
    """The snapshot's source and every file in it, listed whole (or refused)."""
    landing = t.landing_place
    try:
        folder = snapshot_folder(
            request.snapshot, request.snapshot_roots, (landing, t.warehouse_root)
        )
    except SourceRootError as exc:
        raise ResyncError(str(exc)) from None
    source = snapshot_source(folder, landing)
    if not source.exists():
        raise ResyncError(
            f"{folder}: no such folder, or it cannot be listed (the snapshot is a folder of"
            " files; an s3:// prefix is read with the landing zone's storage options)"
        )
    try:
        listed = source.all_files()
    except IncompleteSnapshotError as exc:
        raise ResyncError(f"the snapshot was not applied: {exc}") from None
    if not listed:
        raise ResyncError(
            f"{folder}: no snapshot file (a snapshot of an empty table is one file with no rows)"
        )
    return source, list(listed), listed, folder


def _read_snapshot(t: HistoryTable, request: ResyncRequest, at: datetime) -> _Snapshot:
    """Every snapshot file inspected and read as events at R; any bad file refuses the
    whole snapshot (nothing written)."""
    source, files, listed, folder = _listed(t, request)
    erased_keys.load(t.paths.erased_keys, t.keyring)  # without the salt: refused, nothing written
    table, pk = t.config, t.key
    logged_fields = changelog.key_and_data_fields(t.changelog)
    known = logged_fields.names if logged_fields is not None else ()
    seq = resync_seqs(at)[0]
    reader = SnapshotReader(table, t.landing_place, t.keyring, at, seq, source, known)
    batch = LandingBatch.of_files(t.spark, reader, listed)
    inspected = batch.inspect(logged_fields, native=False)
    reports, fields = inspected.reports, inspected.fields
    bad = [f"{r.path}: {r.error}" for r in reports if not r.ok]
    if bad:
        raise ResyncError("the snapshot was not applied: " + "; ".join(bad))
    if inspected.clashes:
        raise ResyncError(
            "the snapshot was not applied: "
            + "; ".join(f"{p}: {why}" for p, why in sorted(inspected.clashes.items()))
        )
    with_rows = [r.path for r in reports if r.num_rows]
    schema = event_schema(fields)
    events = batch.events(with_rows, fields) if with_rows else None
    if events is not None and table.keyless:  # identical rows are one row (section 3)
        events = _first_of_each_key(events, pk)
    elif events is not None:
        _check_one_row_per_key(events, pk, folder)
    schemas = [r.schema for r in reports]
    return _Snapshot(
        events,
        sum(r.num_rows for r in reports),
        len(files),
        spark_schema(schema),
        [source_name(at), *(reader.relative(p) for p in with_rows)],
        changelog_properties(table, reader.salt, schemas),
        schemas,
        reader.salt,
    )


def _apply_snapshot(
    c: Change, snap: _Snapshot, at: datetime, replaced: list[int]
) -> tuple[int, int]:
    """Decide which keys close and which are replaced on the change-log version the table
    has caught up with, then remove and append strictly on it: an event logged meanwhile
    makes a commit fail and the attempt decide again, so it is never removed (nor
    forgotten) unseen, and no key it brought is left open. Returns (keys closed, events new)."""
    closing, replacing = _closing_and_replacing(c.table, snap.events)
    if c.log is not None and replacing is not None:
        replaced.append(c.remove_keys(replacing, "cdc_platform.resync_replaced").keys)
    insert_seq, delete_seq = resync_seqs(at)
    deletes = _deletes(closing, c.table.key, snap.shape, at, delete_seq)
    keys_closed = deletes.count() if deletes is not None else 0
    logged = snap.events
    if deletes is not None and keys_closed:
        logged = deletes if logged is None else logged.unionByName(deletes)
    if logged is None or not snap.rows + keys_closed:
        return keys_closed, 0
    rows = snap.rows + keys_closed
    return keys_closed, c.append(logged, (insert_seq, delete_seq), rows, snap.properties)


def _closing_and_replacing(
    t: HistoryTable, events: DataFrame | None
) -> tuple[DataFrame | None, DataFrame | None]:
    """The live keys the snapshot lacks (closed at R), and the keys whose snapshot row is
    older than their first version (their history is replaced); None before any history."""
    from pyspark.sql import functions as F

    history = t.history.read(t.spark) if t.history.files else None
    if history is None:
        return None, None
    pk = t.key
    snapshot_keys = events.select(*cols(pk), col(TS)) if events is not None else None
    live = history.filter(col(CURRENT) & col(ACTIVE)).select(*cols(pk))
    if snapshot_keys is None:
        return live, None
    first = history.groupBy(*cols(pk)).agg(F.min(col(START)).alias(START))
    replacing = snapshot_keys.join(first, pk).filter(col(TS) < col(START)).select(*cols(pk))
    return live.join(snapshot_keys, pk, "left_anti"), replacing


def _first_of_each_key(events: DataFrame, pk: Sequence[str]) -> DataFrame:
    """One row per key, the same on every run: the earliest (by time, file, row)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    first = Window.partitionBy(*cols(list(pk))).orderBy(col(TS), col(SOURCE_FILE), col(SOURCE_ROW))
    n = internal("row")
    return events.withColumn(n, F.row_number().over(first)).filter(col(n) == 1).drop(n)


def _check_one_row_per_key(events: DataFrame, pk: Sequence[str], folder: Path | Location) -> None:
    """A key on two rows refuses the snapshot, naming the rows (file and row number), never
    the key's value: it may be an encrypted table's, and the message reaches the UI."""
    from pyspark.sql import functions as F

    twice = (
        events.groupBy(*cols(list(pk)))
        .agg(
            F.count(F.lit(1)).alias(_ROWS),
            F.sort_array(F.collect_list(F.struct(col(SOURCE_FILE), col(SOURCE_ROW)))).alias(
                _PLACES
            ),
        )
        .filter(col(_ROWS) > 1)
        .select(_ROWS, _PLACES)
        .limit(_SAMPLE)
        .collect()
    )
    if twice:
        sample = "; ".join(
            " and ".join(f"{a[0]} row {a[1]}" for a in r[_PLACES][:3])
            + (f" ({r[_ROWS]} rows)" if r[_ROWS] > 3 else "")
            for r in twice
        )
        raise ResyncError(f"{folder}: a snapshot holds one row per key; one key is on {sample}")


def _deletes(
    keys: DataFrame | None, pk: Sequence[str], shape: StructType, at: datetime, seq: int
) -> DataFrame | None:
    """A delete at ``at`` for each of ``keys``, shaped as the snapshot's events."""
    from pyspark.sql import functions as F

    if keys is None:
        return None
    given = {
        OP: F.lit("DELETE"),
        SEQ: F.lit(seq),
        TS: timestamp_lit(at),
        SOURCE_FILE: F.lit(source_name(at)),
    }
    return keys.select(
        *[
            (col(f.name) if f.name in pk else given.get(f.name, F.lit(None)))
            .cast(f.dataType)
            .alias(f.name)
            for f in shape.fields
        ]
    )
