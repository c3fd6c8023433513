"""The landing zone as one handle: a local (or mounted) folder, or a prefix of an S3 bucket.

Everything the platform does with the landing zone goes through a ``LandingZone``: list one
hour's files, list the hours of a window or of a table's whole history, name a file relative to
the root, and open a listed file so that what is read is what was listed. ``root.zone_at``
takes a path (``LocalZone``, here: ``layout`` and ``safe_open``) or an ``s3://`` Location
(``object_store.S3Landing``), so callers never branch on where the files are.

On a bucket the counterpart of the local checks is the object's ETag: every read of a listed
object is a GET with ``If-Match`` on the ETag the listing saw, so an object overwritten between
listing and reading is refused (HTTP 412), never read in part old and in part new.
"""

from __future__ import annotations

import math
import os
import stat
import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from cdc_platform.lib.errors import PlatformError, Refusal
from cdc_platform.lib.landing.where import layout, safe_open
from cdc_platform.lib.landing.where.layout import LandingFile
from cdc_platform.lib.landing.where.safe_open import CHANGED, FileId
from cdc_platform.lib.storage.stores import Location


class LandingUnavailableError(PlatformError, RuntimeError):
    """The landing store could not be reached (an outage, a throttle, denied credentials): the
    run fails, and the landing sensor asks for the hour again. Never a reason to set a file
    aside."""


class IncompleteSnapshotError(Refusal):
    """A snapshot entry that is neither a data file nor a marker (a symlink, a folder that
    cannot be listed, a special file, a key that cannot be named safely). A re-sync closes
    every key its snapshot lacks, so a snapshot is read whole or not at all (HISTORY_MODE.md,
    re-sync): skipping the entry would close the keys it holds."""

    def __init__(self, entry: str, why: str) -> None:
        super().__init__(f"{entry}: {why}; the snapshot is read whole or not at all")


class ListBudget:
    """The listing requests a sensor tick may still make, and until when: Dagster gives a
    sensor evaluation 60 s, so a listing stops when its budget is spent and the work resumes on
    the next tick. The first request is always allowed (every tick makes progress)."""

    def __init__(self, requests: int, seconds: float = math.inf) -> None:
        self.left = requests
        self.deadline = time.monotonic() + seconds
        self.spent_any = False

    def take(self) -> bool:
        """Whether one more request may be sent (and count it)."""
        if self.spent_any and (self.left <= 0 or time.monotonic() > self.deadline):
            return False
        self.left -= 1
        self.spent_any = True
        return True

    @property
    def spent(self) -> bool:
        return self.spent_any and (self.left <= 0 or time.monotonic() > self.deadline)


@dataclass(frozen=True)
class HourListing:
    """Part of a table's one prefix listing: the hours listed whole, and where to go on."""

    files: dict[datetime, list[LandingFile]]
    # The key (relative to the root) to list after next time; None: the listing is complete.
    resume_after: str | None = None


class LandingZone(ABC):
    """Where a deployment's landing files are; ``root`` names it (a path or a URI)."""

    root: str
    # Whether Spark may read a plain Parquet file itself, by path (``landing.reading.native``).
    native_reads: bool = True
    # Files whose mtime is within this margin of the full sweep's high-water mark are looked at
    # again by the next sweep (``fleet.sensor_cursor``): files written while the sweep was
    # listing, small clock skew between writers and the sweeping host. Re-seeing them is cheap
    # (the cursor remembers their fingerprint, so nothing is requested twice).
    sweep_margin_ns: int = 10 * 60 * 1_000_000_000

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    # -- listing -----------------------------------------------------------------------------

    @abstractmethod
    def exists(self) -> bool:
        """Whether the root can be listed now (a folder that exists, a bucket that answers)."""

    @abstractmethod
    def files_in_hour(self, table: str, hour: datetime) -> list[LandingFile]:
        """The hour folder's files, sorted, those not to be read with ``set_aside`` said why."""

    def files_in_hours(
        self, table: str, first: datetime, last: datetime
    ) -> dict[datetime, list[LandingFile]]:
        """``files_in_hour`` of every hour from ``first`` to ``last`` (hours with files only)."""
        out = {}
        for hour in layout.hours_between(first, last):
            files = self.files_in_hour(table, hour)
            if files:
                out[hour] = files
        return out

    @abstractmethod
    def hours(self, table: str) -> list[datetime]:
        """Every hour that has a folder (or, on a bucket, an object) for ``table``, sorted."""

    def hour_files(
        self, table: str, after: str = "", budget: ListBudget | None = None
    ) -> HourListing:
        """Every hour folder of ``table`` with its files (as ``files_in_hour`` gives them), from
        the one prefix listing the sweep makes, from the key ``after`` on and until ``budget``
        is spent (``resume_after`` says where to go on). Here a folder walk: each hour folder
        (named by its padded spelling) is one request of the budget."""
        found: dict[datetime, list[LandingFile]] = {}
        for hour in self.hours(table):
            name = layout.folder_spellings(table, hour)[0]
            if after and name <= after:
                continue
            if budget is not None and not budget.take():
                return HourListing(found, after)
            files = self.files_in_hour(table, hour)
            if files:
                found[hour] = files
            after = name
        return HourListing(found, None)

    def files_of_hours(
        self, table: str, hours: Collection[datetime], budget: ListBudget | None = None
    ) -> tuple[dict[datetime, list[LandingFile]], set[datetime]]:
        """(files by hour, the hours listed): ``files_in_hour`` of each of ``hours`` until the
        budget is spent (the rest are looked at on a later tick)."""
        return {h: self.files_in_hour(table, h) for h in hours}, set(hours)

    def sweep(
        self, table: str, before: datetime, mark_ns: int
    ) -> tuple[dict[datetime, int], dict[datetime, list[LandingFile]]]:
        """The full sweep's listing of the hours before ``before``: each hour's newest
        modification time (ns), and the files of the hours with one newer than ``mark_ns``
        (only those are fingerprinted: the rest the sweep's mark already covers)."""
        newest, touched, _ = self.sweep_part(table, before, mark_ns)
        return newest, touched

    def sweep_part(
        self,
        table: str,
        before: datetime,
        mark_ns: int,
        after: str = "",
        budget: ListBudget | None = None,
    ) -> tuple[dict[datetime, int], dict[datetime, list[LandingFile]], str | None]:
        """``sweep`` from the key ``after`` on, until ``budget`` is spent, and the key to go on
        after (None: the sweep is complete); a folder cut by the budget waits for the next call
        (``hour_files``). Here both come from that one listing of the table's hour folders (on
        a bucket, a page per 1000 objects)."""
        part = self.hour_files(table, after, budget)
        by_hour = part.files
        newest = {h: max(f.mtime_ns for f in fs) for h, fs in by_hour.items() if h < before}
        touched = {h: by_hour[h] for h, n in newest.items() if n > mark_ns}
        return newest, touched, part.resume_after

    @abstractmethod
    def table_names(self) -> list[str]:
        """The names of the folders (prefixes) directly under the root, sorted."""

    @abstractmethod
    def all_files(self) -> dict[str, FileId]:
        """Every data file below the root, at any depth, with the file it is now (a re-sync
        snapshot's folder: markers and hidden entries left out, ``layout.is_data_file``).
        Raises IncompleteSnapshotError for any other entry that is not a data file: a link,
        a folder it cannot list, a special file, a key it cannot name."""

    @abstractmethod
    def table_files(self, table: str) -> set[str]:
        """Every file under the table's folder, by ``relative`` name (un-apply and re-admit)."""

    # -- naming and reading ------------------------------------------------------------------

    @abstractmethod
    def normalized(self, path: str) -> str:
        """``path`` as listings name it (the key the reader remembers a listed file by)."""

    @abstractmethod
    def relative(self, path: str) -> str:
        """A file's name as the change log, the quarantine and the ledgers record it."""

    @abstractmethod
    def open(self, path: str, expected: FileId | None) -> BinaryIO:
        """``path`` opened for reading, confined to the root and pinned to the listed file.
        Raises LandingFileError (outside the root, a symlink, changed since listed), OSError
        (missing, unreadable) or LandingUnavailableError (the store does not answer)."""

    @abstractmethod
    def check_unchanged(self, fh: BinaryIO, expected: FileId | None) -> None:
        """Raise LandingFileError(CHANGED) if the opened file is no longer the one listed."""

    @abstractmethod
    def changed_since_listed(self, path: str, expected: FileId | None) -> bool:
        """Whether ``path`` is no longer the file the listing saw (gone, replaced, rewritten)."""


class LocalZone(LandingZone):
    """A local or mounted folder: ``layout`` lists it, ``safe_open`` opens its files."""

    def __init__(self, root: Path | str) -> None:
        self.root = os.path.abspath(root)

    def exists(self) -> bool:
        try:
            with os.scandir(self.root):
                return True
        except OSError:  # missing, not a folder, no permission: an unmounted volume, say
            return False

    def files_in_hour(self, table: str, hour: datetime) -> list[LandingFile]:
        return layout.files_in_hour(Path(self.root), table, hour)

    def hours(self, table: str) -> list[datetime]:
        return sorted({h for h, _ in layout.all_hour_folders(Path(self.root), table)})

    def sweep_part(
        self,
        table: str,
        before: datetime,
        mark_ns: int,
        after: str = "",
        budget: ListBudget | None = None,
    ) -> tuple[dict[datetime, int], dict[datetime, list[LandingFile]], str | None]:
        """A walk of the hour folders reading only modification times (cheap: no fingerprint),
        then a listing of each folder touched since the mark (whole: no request is billed)."""
        newest: dict[datetime, int] = {}
        for hour, folder in layout.all_hour_folders(Path(self.root), table):
            found = _newest_in_folder(folder) if hour < before else 0
            if found:  # an hour spelled both padded and unpadded: the newer
                newest[hour] = max(found, newest.get(hour, 0))
        touched = {
            h: self.files_in_hour(table, h) for h, n in sorted(newest.items()) if n > mark_ns
        }
        return newest, touched, None

    def table_names(self) -> list[str]:
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:
            return []
        return [e.name for e in entries if not e.is_symlink() and e.is_dir(follow_symlinks=False)]

    def all_files(self) -> dict[str, FileId]:
        found: dict[str, FileId] = {}
        folders = [self.root]
        while folders:
            folder = folders.pop()
            try:
                with os.scandir(folder) as it:
                    entries = [e for e in it if layout.is_data_file(e.name)]
            except OSError as exc:
                raise IncompleteSnapshotError(self._shown(folder), _cannot_list(exc)) from None
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError as exc:
                    raise IncompleteSnapshotError(
                        self._shown(entry.path), _cannot_list(exc)
                    ) from None
                if stat.S_ISDIR(st.st_mode):
                    folders.append(entry.path)
                elif stat.S_ISREG(st.st_mode):
                    found[entry.path] = FileId.of(st)
                else:
                    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else layout.NOT_A_FILE
                    raise IncompleteSnapshotError(self._shown(entry.path), what)
        return dict(sorted(found.items()))

    def _shown(self, path: str) -> str:
        """An entry as an error names it: below the root, escaped where not UTF-8."""
        return layout.printable_path(os.path.relpath(path, self.root))

    def table_files(self, table: str) -> set[str]:
        found = set()
        for folder, _, files in os.walk(Path(self.root) / table):
            for name in files:
                found.add(self.relative(os.path.join(folder, name)))
        return found

    def normalized(self, path: str) -> str:
        return os.path.abspath(path)

    def relative(self, path: str) -> str:
        if "://" in path:  # a re-sync snapshot's object: named by its URI
            return path
        return layout.printable_path(os.path.relpath(path, self.root))

    def open(self, path: str, expected: FileId | None) -> BinaryIO:
        return safe_open.open_beneath(self.root, path, expected)

    def check_unchanged(self, fh: BinaryIO, expected: FileId | None) -> None:
        safe_open.check_unchanged(fh, expected)

    def changed_since_listed(self, path: str, expected: FileId | None) -> bool:
        try:
            st = os.lstat(path)
        except OSError:
            return True
        return not stat.S_ISREG(st.st_mode) or (expected is not None and not expected.matches(st))


def _newest_in_folder(folder: Path) -> int:
    """Newest mtime of the data files (and links, set aside when read) directly in one folder
    (0 if none, gone or unlistable: a symlink loop or a folder without permission never
    stops the sweep). Links are never followed."""
    newest = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if not layout.is_data_file(entry.name):
                    continue
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
    except OSError:
        return 0
    return newest


Landing = LandingZone | Location | str | os.PathLike[str]


__all__ = [
    "CHANGED",
    "HourListing",
    "Landing",
    "LandingUnavailableError",
    "LandingZone",
    "ListBudget",
    "LocalZone",
]


def _cannot_list(exc: OSError) -> str:
    return f"cannot be listed ({exc.strerror or type(exc).__name__})"
