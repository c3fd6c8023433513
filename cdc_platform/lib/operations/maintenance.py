"""Table maintenance: compaction (few, well-clustered files) and VACUUM (delete what is unused).

Compaction (``compact``) keeps file counts bounded after months of hourly runs:

- History table: the small files of each segment (closed, live, deleted; see ``merge``) are
  bin-packed into files of that segment, so the live part stays one file or a few (split by
  key) and the closed part clusters by the time its versions ended (their statistics then let
  a late event skip every closed file that ended before it). Rows are not changed.
- Change log: once the history table has applied everything, its small files are bin-packed
  into key-sorted ones; the history table's watermark (and the delete-only keys' stamp) is then
  moved to the compacted version, so the rewritten files are not mistaken for new events. A
  crash between those commits only makes the next run recompute the keys of the compacted
  files, which is correct and self-healing.
- Applied-files ledger: one small file per run; its small files become few, sorted by
  partition (``applied_files.compact``), so the sensor's reads stay flat over a year of runs.

Both commits mark their files ``dataChange=false``: readers and streaming consumers know that
no row changed.

VACUUM (``vacuum``):

Each table has several Delta tables (``warehouse.TablePaths``): the history table, its change
log, its quarantine, its ledgers and side tables and, if configured, its current table (every refresh
of which replaces all its files). ``vacuum`` cleans each of them that exists:

- ``DeltaTable.vacuum(full=True)``: every data file the log does not reference any more (replaced
  by a later commit longer than ``retention_hours`` ago) *and* every file in the table's folder
  the log never referenced (written by a run that crashed before its commit). delta-rs' default,
  ``full=False``, only looks at files the log once referenced, so crashed runs' files would stay
  for ever.
- Then the ``data/<uuid>/`` folders Spark wrote for a commit that never happened and that now
  hold no data file: delta-rs skips names starting with ``.`` or ``_``, so Spark's ``.crc``
  checksums and a ``_temporary/`` folder left by a write that died half-way are removed here.
  On an object store a "folder" is a key prefix: its age is that of its newest object.

Files younger than ``retention_hours`` are never touched, so a run writing at the same time
keeps its files; do not pass 0 while runs may be writing. A full VACUUM lists everything under
the table's folder; the config guarantees no other table or landing folder is inside it (table
names never start with ``_``, the folder of the change logs, and the roots do not overlap).

Run it for every table of the config: ``python -m cdc_platform.lib.operations.maintenance``.
That command takes no Dagster pool slot (``lib`` knows no Dagster), so it keeps the default
retention (a shorter one is ``table_maintenance``'s ``allow_short_retention``, in the slot) and
refuses a table whose ``rekey_table`` or ``protect_columns`` run did not finish
(``rebuild_under_way``): its commits would come between that run's and the run that finishes it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
from deltalake.transaction import AddAction

from cdc_platform.lib.columns import ACTIVE, CURRENT, cols
from cdc_platform.lib.config import load_config
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import merge
from cdc_platform.lib.history.protected_columns import protecting
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.table_key import recorded_rekey
from cdc_platform.lib.ledgers import applied_files
from cdc_platform.lib.operations.operation import Request
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.table import Commit, Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    pass

# Delta's own default for deletedFileRetentionDuration: 7 days of time travel.
DEFAULT_RETENTION_HOURS = 168


@dataclass(frozen=True)
class Compaction:
    """What compacting one Delta table did (figures before and after, whole table)."""

    table: str
    files_before: int
    files_after: int
    bytes_before: int
    bytes_after: int
    files_rewritten: int
    version: int | None


@dataclass(frozen=True)
class MaintainRequest(Request):
    """Compact, then VACUUM past ``retention_hours`` (below the default only with
    ``allow_short_retention``, and only while the table's pool slot is held: a VACUUM without
    Delta's retention check deletes a run's written, not yet committed files)."""

    retention_hours: int = DEFAULT_RETENTION_HOURS
    allow_short_retention: bool = False
    vacuum: bool = True
    slot_held: bool = False


@dataclass(frozen=True)
class MaintenanceResult:
    compactions: tuple[Compaction, ...]
    vacuumed_files: int | None  # None: compact only
    changed: bool = True
    hours: tuple[datetime, ...] = ()  # no row changed: reported as an observation

    def summary(self) -> str:
        lines = [
            f"{c.table}: {c.files_before} -> {c.files_after} files ({c.files_rewritten} "
            f"rewritten), {c.bytes_before:,} -> {c.bytes_after:,} bytes"
            for c in self.compactions
        ]
        if self.vacuumed_files is not None:
            lines.append(f"vacuumed {self.vacuumed_files} file(s)")
        return "; ".join(lines)

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"maintenance": "compact + vacuum"}
        for c in self.compactions:
            meta |= {
                f"{c.table}_files_before": c.files_before,
                f"{c.table}_files_after": c.files_after,
                f"{c.table}_bytes_before": c.bytes_before,
                f"{c.table}_bytes_after": c.bytes_after,
                f"{c.table}_files_rewritten": c.files_rewritten,
            }
        if self.vacuumed_files is not None:
            meta["vacuumed_files"] = self.vacuumed_files
        return meta


def retention_refusal(request: MaintainRequest) -> str | None:
    """Why the retention is refused before anything is read (None: it is not): a negative
    one, or one below the default not asked for explicitly."""
    hours, default = request.retention_hours, DEFAULT_RETENTION_HOURS
    if hours < 0:
        return f"retention_hours {hours} is negative. Nothing was done."
    if hours < default and request.vacuum and not request.allow_short_retention:
        return (
            f"retention_hours {hours} is below the default {default}: add"
            " allow_short_retention: true to the run config to VACUUM the files replaced"
            " since (the table's pool slot keeps its runs out meanwhile; time travel then"
            f" reaches back {hours} hours), or leave retention_hours at {default}."
            " Nothing was done."
        )
    return None


SHORT_RETENTION_NEEDS_SLOT = (
    "allow_short_retention needs the table's concurrency pool slot, and this Dagster instance"
    " gave none (no concurrency pools, or a pool without a limit: dagster.yaml sets"
    " pools.default_limit: 1): nothing was done; run it on the deployment's instance"
)


def maintain(t: HistoryTable, request: MaintainRequest) -> MaintenanceResult:
    """Compact the table, then VACUUM it (see the module docstring)."""
    refusal = retention_refusal(request)
    if refusal is None and request.allow_short_retention and not request.slot_held:
        refusal = SHORT_RETENTION_NEEDS_SLOT
    if refusal is not None:
        raise Refusal(refusal)
    compactions = compact(t)
    removed = None
    if request.vacuum:
        removed = vacuum(
            t.paths,
            request.retention_hours,
            enforce_retention_duration=not request.allow_short_retention,
            current_table=t.config.current_table,
        )
    t.refresh()
    return MaintenanceResult(tuple(compactions), len(removed) if removed is not None else None)


def compact(t: HistoryTable, *, small_rows: int = delta.ROWS_PER_FILE // 2) -> list[Compaction]:
    """Compact the history table, the change log and the applied-files ledger of one table
    (see the module docstring), each from its latest version."""
    t.refresh()
    done = [
        _compact_history(t, min(small_rows, merge.HISTORY_ROWS_PER_FILE // 2)),
        _compact_changelog(t, small_rows),
        compact_applied_files(t.paths),
    ]
    t.refresh()
    return done


def compact_applied_files(paths: TablePaths) -> Compaction:
    """The applied-files ledger's small files as few, sorted by partition (no Spark)."""
    done = applied_files.compact(applied_files.of_table(paths))
    return _summary("applied_files", done.files, done.removed, done.adds, done.version)


def _segment(f: delta.DataFile) -> str:
    if merge.is_closed_file(f):
        return "closed"
    if f.min_values.get(ACTIVE) is True:
        return "live"
    if f.min_values.get(CURRENT) is True and f.max_values.get(ACTIVE) is False:
        return "deleted"
    return "mixed"


def _small(files: Sequence[delta.DataFile], small_rows: int) -> list[delta.DataFile]:
    small = [f for f in files if (f.num_records or 0) < small_rows]
    return small if len(small) > 1 else []


def _compact_history(t: HistoryTable, small_rows: int) -> Compaction:
    history = t.history
    if not history.exists:
        return Compaction("history", 0, 0, 0, 0, 0, None)
    chosen: list[delta.DataFile] = []
    if CURRENT in history.arrow_schema.names:  # else the next run recomputes the table anyway
        by_segment: dict[str, list[delta.DataFile]] = {}
        for f in history.files:
            by_segment.setdefault(_segment(f), []).append(f)
        chosen = [
            f for seg, fs in by_segment.items() if seg != "mixed" for f in _small(fs, small_rows)
        ]
        chosen += by_segment.get("mixed", [])  # files from before the segment layout
    adds: list[AddAction] = []
    version = history.version
    if chosen:
        with history.committing() as rewrite:
            rows = history.read(t.spark, chosen)
            expected = sum(f.num_records or 0 for f in chosen)
            adds = merge.write_segments(rows, rewrite, t.key, expected, data_change=False)
            version = _commit_rewrite(rewrite, chosen)
    return _summary("history", history.files, chosen, adds, version)


def _compact_changelog(t: HistoryTable, small_rows: int) -> Compaction:
    """After the history's own compaction: its handle is read again (that one committed)."""
    log, history, pk = t.changelog, t.fresh(t.paths.history), t.key
    if not log.exists or not history.exists:
        return Compaction("changelog", 0, 0, 0, 0, 0, None)
    applied = history.watermark(merge.APP_ID)
    chosen = _small(log.files, small_rows) if applied == log.version else []
    adds: list[AddAction] = []
    version = log.version
    if chosen:
        with log.committing() as rewrite:
            rows = log.read(t.spark, chosen)
            n = delta.file_count_for(sum(f.num_records or 0 for f in chosen))
            shaped = rows.repartitionByRange(n, *cols(pk)) if n > 1 else rows.coalesce(1)
            adds = rewrite.write(shaped.sortWithinPartitions(*cols(pk)), data_change=False)
            version = _commit_rewrite(rewrite, chosen)
        # The history table reflects every event, now in the compacted files: say so.
        with history.committing() as stamp:
            stamp.commit(app_transaction=(merge.APP_ID, version), strict=True)
        merge.stamp_delete_only_keys(t.table(t.paths.delete_only_keys), version, applied)
    return _summary("changelog", log.files, chosen, adds, version)


def _commit_rewrite(rewrite: Commit, removed: Sequence[delta.DataFile]) -> int:
    """The compacted files in place of ``removed``, strictly: rows unchanged (no data change)."""
    removes = delta.removes_for(removed, data_change=False)
    return rewrite.commit(removes, metadata={"cdc_platform.operation": "compact"}, strict=True)


def _summary(
    name: str,
    files: Sequence[delta.DataFile],
    removed: Sequence[delta.DataFile],
    adds: Sequence[AddAction],
    version: int | None,
) -> Compaction:
    before = sum(f.size for f in files)
    after = before - sum(f.size for f in removed) + sum(a.size for a in adds)
    return Compaction(
        name,
        len(files),
        len(files) - len(removed) + len(adds),
        before,
        after,
        len(removed),
        version,
    )


def vacuum(
    paths: TablePaths,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    *,
    dry_run: bool = False,
    enforce_retention_duration: bool = True,
    current_table: bool = False,
) -> list[str]:
    """VACUUM the history table and every side table (change log, quarantine, delete-only,
    revoked files, retracted keys, forgotten events, erased keys, applied files) of one table, and
    its current table if it has one (``current_table``: only then, since without the config
    flag that folder name may be another table's); the paths removed (or, with ``dry_run``,
    that would be)."""
    removed: list[str] = []
    tables = [
        paths.history,
        paths.changelog,
        paths.quarantine,
        paths.delete_only_keys,
        paths.revoked_files,
        paths.retracted_keys,
        paths.forgotten_events,  # an erasure rewrites it: the old files hold the key
        paths.erased_keys,
        applied_files.of_table(paths),  # compacted: the runs' small files replaced
    ]
    if current_table:
        tables.append(paths.current)
    for table_path in tables:
        if not delta.exists(table_path):
            continue
        files = delta.open_table(table_path).vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=enforce_retention_duration,
            full=True,
        )
        removed.extend(str(table_path / f) for f in files)
        removed.extend(_stale_write_folders(table_path, retention_hours, dry_run))
    return sorted(removed)


def _stale_write_folders(table_path: Location, retention_hours: int, dry_run: bool) -> list[str]:
    """``data/<uuid>/`` folders with no data file left, untouched for ``retention_hours``."""
    fs = table_path.filesystem()
    selector = pafs.FileSelector(delta.DATA_DIR, recursive=True, allow_not_found=True)
    folders: dict[str, list[pafs.FileInfo]] = {}  # data/<uuid> -> it and everything below it
    for info in fs.get_file_info(selector):
        parts = info.path.split("/")
        if len(parts) > 2 or info.type == pafs.FileType.Directory:
            folders.setdefault("/".join(parts[:2]), []).append(info)
    cutoff = time.time() - retention_hours * 3600
    stale = []
    for folder, entries in sorted(folders.items()):
        if any(_is_data_file(e, folder) for e in entries):
            continue
        newest = max((e.mtime.timestamp() for e in entries if e.mtime is not None), default=None)
        if newest is not None and newest > cutoff:
            continue
        stale.append(str(table_path / folder))
        if not dry_run:
            fs.delete_dir(folder)
    return stale


def _is_data_file(info: pafs.FileInfo, folder: str) -> bool:
    """A file the table's log may reference: a ``part-*.parquet`` in the write folder or in one
    of its segment sub-folders (``data/<uuid>/live/``), never under a hidden or ``_`` folder."""
    parts = info.path[len(folder) + 1 :].split("/")
    return (
        info.type == pafs.FileType.File
        and info.path.endswith(".parquet")
        and all(p and p[0] not in "._" for p in parts)
    )


def rebuild_under_way(paths: TablePaths) -> str | None:
    """Why the command-line VACUUM leaves a table alone (None: it does not): a ``rekey_table``
    or ``protect_columns`` run stopped between its commits; launching it again finishes it."""
    try:
        rekey = recorded_rekey(Table.open(paths.history))
        lists = protecting(Table.open(paths.changelog))
    except ValueError as exc:  # a property not written by cdc_platform
        return f"{exc} Not vacuumed."
    job = rekey.job if rekey is not None and rekey.pending else None
    if job is None and lists is not None:
        job = "protect_columns"
    if job is None:
        return None
    return (
        f"{paths.history}: a {job} run did not finish; not vacuumed. Launch {job} for the table"
        " again (it finishes the rebuild), then run this command again."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="VACUUM every table of the config.")
    parser.add_argument("--retention-hours", type=int, default=DEFAULT_RETENTION_HOURS)
    parser.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    args = parser.parse_args(argv)
    if args.retention_hours < DEFAULT_RETENTION_HOURS:
        parser.error(
            f"--retention-hours {args.retention_hours} is below {DEFAULT_RETENTION_HOURS}: this"
            " command holds no table's pool slot, so a run writing meanwhile could lose its"
            " files. Launch table_maintenance with retention_hours and allow_short_retention:"
            " true instead (it holds the slot)."
        )
    platform = load_config()
    refused = 0
    for table in platform.tables:
        paths = TablePaths.of(platform.warehouse_root, table.name)
        why = rebuild_under_way(paths)
        if why is not None:
            print(f"{table.name}: {why}", file=sys.stderr)
            refused += 1
            continue
        removed = vacuum(
            paths, args.retention_hours, dry_run=args.dry_run, current_table=table.current_table
        )
        verb = "would remove" if args.dry_run else "removed"
        print(f"{table.name}: {verb} {len(removed)} file(s) or folder(s)")
        for path in removed:
            print(f"  {path}")
    if refused:
        sys.exit(f"{refused} table(s) not vacuumed (above)")


if __name__ == "__main__":
    main()
