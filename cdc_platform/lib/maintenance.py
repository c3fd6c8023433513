"""VACUUM: delete the files a table no longer needs, including those of crashed runs.

Each table has three Delta tables (``warehouse.TablePaths``): the history table, its change log
and its quarantine. ``vacuum`` cleans all three:

- ``DeltaTable.vacuum(full=True)``: every data file the log does not reference any more (replaced
  by a later commit longer than ``retention_hours`` ago) *and* every file in the table's folder
  the log never referenced (written by a run that crashed before its commit). delta-rs' default,
  ``full=False``, only looks at files the log once referenced, so crashed runs' files would stay
  for ever.
- Then the ``data/<uuid>/`` folders Spark wrote for a commit that never happened and that now
  hold no data file: delta-rs skips names starting with ``.`` or ``_``, so Spark's ``.crc``
  checksums and a ``_temporary/`` folder left by a write that died half-way are removed here.

Files younger than ``retention_hours`` are never touched, so a run writing at the same time
keeps its files; do not pass 0 while runs may be writing. A full VACUUM lists everything under
the table's folder; the config guarantees no other table or landing folder is inside it (table
names never start with ``_``, the folder of the change logs, and the roots do not overlap).

Run it for every table of the config: ``python -m cdc_platform.lib.maintenance``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from cdc_platform.lib import delta
from cdc_platform.lib.config import load_config
from cdc_platform.lib.warehouse import TablePaths

# Delta's own default for deletedFileRetentionDuration: 7 days of time travel.
DEFAULT_RETENTION_HOURS = 168


def vacuum(
    paths: TablePaths,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    *,
    dry_run: bool = False,
    enforce_retention_duration: bool = True,
) -> list[str]:
    """VACUUM the history table, change log and quarantine of one table; the paths removed
    (or, with ``dry_run``, that would be)."""
    removed: list[str] = []
    for table_path in (paths.history, paths.changelog, paths.quarantine):
        if not delta.exists(table_path):
            continue
        files = delta.open_table(table_path).vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=enforce_retention_duration,
            full=True,
        )
        removed.extend(str(Path(table_path) / f) for f in files)
        removed.extend(_stale_write_folders(table_path, retention_hours, dry_run))
    return sorted(removed)


def _stale_write_folders(table_path: Path, retention_hours: int, dry_run: bool) -> list[str]:
    """``data/<uuid>/`` folders with no data file left, untouched for ``retention_hours``."""
    data_dir = Path(table_path) / delta.DATA_DIR
    if not data_dir.is_dir():
        return []
    cutoff = time.time() - retention_hours * 3600
    stale = []
    for folder in sorted(p for p in data_dir.iterdir() if p.is_dir()):
        entries = [folder, *folder.rglob("*")]
        if any(_is_data_file(p, folder) for p in entries):
            continue
        if max(p.lstat().st_mtime for p in entries) > cutoff:
            continue
        stale.append(str(folder))
        if not dry_run:
            shutil.rmtree(folder)
    return stale


def _is_data_file(path: Path, folder: Path) -> bool:
    """A file the table's log may reference: ``part-*.parquet`` right in the write folder."""
    return path.parent == folder and path.suffix == ".parquet" and path.name[0] not in "._"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="VACUUM every table of the config.")
    parser.add_argument("--retention-hours", type=int, default=DEFAULT_RETENTION_HOURS)
    parser.add_argument("--dry-run", action="store_true", help="list, delete nothing")
    args = parser.parse_args(argv)
    platform = load_config()
    for table in platform.tables:
        removed = vacuum(
            TablePaths.of(platform.warehouse_root, table.name),
            args.retention_hours,
            dry_run=args.dry_run,
        )
        verb = "would remove" if args.dry_run else "removed"
        print(f"{table.name}: {verb} {len(removed)} file(s) or folder(s)")
        for path in removed:
            print(f"  {path}")


if __name__ == "__main__":
    main()
