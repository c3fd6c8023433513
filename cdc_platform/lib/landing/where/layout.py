"""The landing zone's layout: ``<root>/<table>/year=YYYY/month=MM/day=DD/hour=HH/<file>``.

Only file *names* are handled here (the driver never reads file contents). A partition key
is Dagster's hourly key ``YYYY-MM-DD-HH:MM``; an hour folder is where that hour's files land.
Note the folder's hour is when the file was delivered, not when its events were committed.

Nothing in the landing zone is ever silently skipped but marker files (``.``/``_`` names):
a symlink (to a file or a folder) is never followed, a file in a sub-folder of an hour folder
is not read, and anything but a regular file is not opened; each is listed with the reason it
is set aside, so the run records it in the quarantine.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cdc_platform.lib.config import PARTITION_FORMAT
from cdc_platform.lib.landing.where.safe_open import FileId

HOUR = timedelta(hours=1)


@dataclass(frozen=True, order=True)
class LandingFile:
    """One landing file, identified by its path; size and mtime fingerprint its content."""

    path: str
    size: int
    mtime_ns: int
    set_aside: str | None = None  # why it is not read (symlink, in a sub-folder, ...), if so
    # Which file the listing saw (``safe_open.FileId``): the reader opens nothing else there.
    dev: int = 0
    ino: int = 0
    # The inode's change time when listed: a rewrite in place keeps the inode but moves it
    # (nobody can set it back), so the reader refuses a file rewritten since the listing.
    ctime_ns: int = 0
    # On a bucket, the object's ETag when listed: every read is pinned to it.
    etag: str = ""

    @property
    def file_id(self) -> FileId:
        return FileId(self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns, etag=self.etag)


SYMLINK = "symlink: links in the landing zone are not followed"
IN_SUBFOLDER = "in a sub-folder of the hour folder: only files directly in an hour folder are read"
NOT_A_FILE = "not a regular file"
BAD_KEY = (
    "the object's key has an empty, '.' or '..' segment: it cannot be named safely; rename it"
    " at the source"
)
UNLISTABLE = "the hour folder cannot be listed"
UNLISTABLE_FILE = "the file cannot be examined (gone since the listing, or no permission)"
BAD_NAME = (
    "the file name is not valid UTF-8: it cannot be named in the change log or the quarantine"
    " (shown here with \\x escapes); rename it at the source"
)
# ``year=``, ``month=``, ``day=``, ``hour=`` take this many digits at most: anything longer is
# not an hour folder (``year=10000000000`` would overflow a date).
DIGITS = {"year": 4, "month": 2, "day": 2, "hour": 2}


def partition_key_to_hour(key: str) -> datetime:
    return datetime.strptime(key, PARTITION_FORMAT).replace(tzinfo=UTC)


def hour_to_partition_key(hour: datetime) -> str:
    return hour.astimezone(UTC).strftime(PARTITION_FORMAT)


def folder_spellings(table: str, hour: datetime) -> list[str]:
    """The hour folder's name below the root (``/``-separated): zero-padded as the layout
    says, then the unpadded spelling some exporters use (when it differs)."""
    h = hour.astimezone(UTC)
    padded = f"{table}/year={h.year:04d}/month={h.month:02d}/day={h.day:02d}/hour={h.hour:02d}"
    unpadded = f"{table}/year={h.year}/month={h.month}/day={h.day}/hour={h.hour}"
    return [padded] if unpadded == padded else [padded, unpadded]


def hour_folder(landing_root: Path, table: str, hour: datetime) -> Path:
    return Path(landing_root) / folder_spellings(table, hour)[0]


def _folder_variants(landing_root: Path, table: str, hour: datetime) -> list[Path]:
    """The zero-padded folder of the spec, plus the unpadded spelling some exporters use."""
    return [Path(landing_root) / name for name in folder_spellings(table, hour)]


def is_data_file(name: str) -> bool:
    """Hidden and marker files (``.crc``, ``_SUCCESS``, ``_temporary``) are not landing data."""
    return not name.startswith((".", "_"))


def files_in_hour(landing_root: Path, table: str, hour: datetime) -> list[LandingFile]:
    """The data files of one hour folder, sorted by path; empty if the folder is missing.

    Entries that are not read carry ``set_aside``: symlinks (never followed, their target
    never touched), files in sub-folders, anything that is not a regular file, and names that
    are not valid UTF-8.
    """
    found: list[LandingFile] = []
    for folder in _folder_variants(landing_root, table, hour):
        link = _linked_ancestor(Path(landing_root), folder)
        if link is not None:
            found.append(_set_aside(link, SYMLINK))
            continue
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:  # no permission, say: listed as set aside, never raised
            found.append(_set_aside(folder, f"{UNLISTABLE}: {exc.strerror}"))
            continue
        for entry in entries:
            if not is_data_file(entry.name):
                continue
            if not is_utf8(entry.name):
                found.append(_set_aside(Path(entry.path), BAD_NAME))
            elif entry.is_symlink():
                found.append(_set_aside(Path(entry.path), SYMLINK))
            elif entry.is_dir(follow_symlinks=False):
                found.extend(_files_below(Path(entry.path)))
            elif entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # renamed away since the listing, or not searchable
                    found.append(_set_aside(Path(entry.path), UNLISTABLE_FILE))
                    continue
                found.append(
                    LandingFile(
                        os.path.abspath(entry.path),
                        st.st_size,
                        st.st_mtime_ns,
                        dev=st.st_dev,
                        ino=st.st_ino,
                        ctime_ns=st.st_ctime_ns,
                    )
                )
            else:
                found.append(_set_aside(Path(entry.path), NOT_A_FILE))
    return sorted(found)


def is_utf8(name: str) -> bool:
    """Whether a name read from the file system is valid UTF-8 (Python keeps the bytes of one
    that is not as lone surrogates, which no Delta string or JSON can hold)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def printable_path(path: str) -> str:
    """A path as UTF-8 text: the bytes of a name that is not UTF-8 as ``\\xNN`` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _linked_ancestor(root: Path, folder: Path) -> Path | None:
    """The first folder between ``root`` (excluded) and ``folder`` that is a symlink, if any."""
    current = root
    for part in folder.relative_to(root).parts:
        current = current / part
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                return current
        except OSError:  # missing (no such hour), or a folder above it not searchable
            return None
    return None


def _files_below(folder: Path) -> Iterator[LandingFile]:
    """Every entry under a sub-folder of an hour folder, set aside (links not followed).

    Walked with a stack, not recursion: a folder nested thousands of levels deep is listed
    like any other; a folder that cannot be listed (too long a path, no permission) is set
    aside itself."""
    stack = [folder]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            if current != folder:
                yield _set_aside(current, IN_SUBFOLDER)
            continue
        for entry in entries:
            if not is_data_file(entry.name):
                continue
            if entry.is_symlink():
                yield _set_aside(Path(entry.path), SYMLINK)
            elif entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            else:
                yield _set_aside(Path(entry.path), IN_SUBFOLDER)


def _set_aside(path: Path, reason: str) -> LandingFile:
    try:
        st = os.lstat(path)
    except OSError:  # gone, or a path too long to stat: still listed, with its reason
        return LandingFile(os.path.abspath(path), 0, 0, reason)
    return LandingFile(
        os.path.abspath(path), st.st_size, st.st_mtime_ns, reason, ctime_ns=st.st_ctime_ns
    )


def hours_between(first: datetime, last: datetime) -> Iterator[datetime]:
    """Every hour from first to last, both included."""
    h = first.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    while h <= last:
        yield h
        h += HOUR


def all_hour_folders(landing_root: Path, table: str) -> Iterator[tuple[datetime, Path]]:
    """Every hour folder of a table, by walking the tree (cost grows with history: sweeps only).

    Total over whatever the landing zone holds: a name that is no date part (too many digits,
    not a number, not a real date), a symlink loop or a folder that cannot be listed is passed
    over, never raised, so one odd folder cannot stop a sensor. A symlinked folder is still
    listed (``files_in_hour`` sets it aside, never following it).
    """
    table_dir = Path(landing_root) / table
    for y, yp in _date_parts(table_dir, "year"):
        for m, mp in _date_parts(yp, "month"):
            for d, dp in _date_parts(mp, "day"):
                for h, hp in _date_parts(dp, "hour"):
                    try:
                        yield datetime(y, m, d, h, tzinfo=UTC), hp
                    except (ValueError, OverflowError):
                        continue


def _date_parts(folder: Path, part: str) -> list[tuple[int, Path]]:
    """The ``<part>=N`` sub-folders of ``folder`` (N of at most ``DIGITS[part]`` digits)."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:  # missing, not a folder, a symlink loop, no permission
        return []
    for entry in entries:
        name, _, digits = entry.name.partition("=")
        if name != part or not (digits.isascii() and digits.isdigit()):
            continue
        if len(digits) > DIGITS[part]:
            continue
        try:
            is_folder = entry.is_dir() or entry.is_symlink()
        except OSError:
            is_folder = entry.is_symlink()
        if is_folder:
            out.append((int(digits), Path(entry.path)))
    return sorted(out)


def fingerprint(files: Iterable[LandingFile]) -> str:
    """A stable digest of a set of files (path, size, mtime): same files, same digest."""
    digest = hashlib.sha256()
    for f in sorted(files):
        # fsencode: a name that is not UTF-8 is hashed as its bytes (the same as before for
        # every UTF-8 name, so no cursor changes).
        # An object's ETag too (a rewrite within the second of its last-modified time): a
        # local file has none, so its digest is the same as before objects were landed.
        etag = f"\0{f.etag}" if f.etag else ""
        digest.update(os.fsencode(f.path) + f"\0{f.size}\0{f.mtime_ns}{etag}\n".encode())
    return digest.hexdigest()[:16]
