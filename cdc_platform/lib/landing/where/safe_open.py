"""Opening a listed file so that what is read is what was listed.

The landing zone is written by someone else, and between the listing (``where.layout``: a
regular file, not a symlink) and the read a file or any folder above it can be swapped for a
symlink (to the keyring, say). So a file is never opened by path alone: ``open_beneath``
walks from a trusted root one component at a time with ``O_NOFOLLOW`` (a symlink anywhere
below the root is refused, not followed), opens the file without following it and without
blocking (a FIFO cannot hang the reader), checks with ``fstat`` on the opened descriptor that
it is a regular file, and that it is the file the listing saw (``FileId``: device and inode,
and its size, modification and change times, so a file rewritten in place since the listing
is refused too: the rewrite moves the inode's change time, which nobody can set back).
Everything is then read through that descriptor, and ``unchanged`` checks it again once read.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass
from typing import BinaryIO

from cdc_platform.lib.landing.decoding.codecs import LandingFileError

SYMLINK = "symlink: links in the landing zone are not followed"
NOT_A_FILE = "not a regular file"
CHANGED = (
    "changed since it was listed (replaced, or rewritten in place); not read in this run. Its"
    " hour is read again once the file is stable (the landing sensor sees the change)"
)
OUTSIDE = "outside the folder it was listed in; not read"

_HOST = socket.gethostname()
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class FileId:
    """Which file a listing saw at a path: device and inode, and its size, modification and
    change times (0: not known, not compared). On a mount seen from another host (a Spark
    executor's) the device number may differ, so only the rest is compared there."""

    dev: int
    ino: int
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    host: str = _HOST
    etag: str = ""  # an object's (``where.object_store``): what every read of it is pinned to

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def matches(self, st: os.stat_result) -> bool:
        same_device = self.dev == st.st_dev or self.host != _HOST
        times = (self.size, self.mtime_ns, self.ctime_ns)
        now = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        same_content = all(a == b for a, b in zip(times, now, strict=True) if a)
        return same_device and self.ino == st.st_ino and same_content


def open_beneath(root: str, path: str, expected: FileId | None = None) -> BinaryIO:
    """``path`` (below ``root``) opened for reading, checked as the module docstring says.

    Raises LandingFileError (symlink, not a regular file, replaced since listed, outside the
    root) or OSError (missing, unreadable). The caller owns the returned file.
    """
    fd = _open_fd(root, path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LandingFileError(NOT_A_FILE)
        if expected is not None and not expected.matches(st):
            raise LandingFileError(CHANGED)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_unchanged(fh: BinaryIO, expected: FileId | None) -> None:
    """Raise LandingFileError(CHANGED) if the opened file no longer matches the listing: a
    rewrite in place while it was being read."""
    if expected is not None and not expected.matches(os.fstat(fh.fileno())):
        raise LandingFileError(CHANGED)


def _open_fd(root: str, path: str) -> int:
    root = os.path.abspath(root)
    rel = os.path.relpath(os.path.abspath(path), root)
    parts = rel.split(os.sep)
    if rel in (".", "") or parts[0] == os.pardir:
        raise LandingFileError(OUTSIDE)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LandingFileError(SYMLINK) from None
                raise
            os.close(dir_fd)
            dir_fd = fd
        try:
            return os.open(parts[-1], _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise LandingFileError(SYMLINK) from None
            raise
    finally:
        os.close(dir_fd)


def path_ids(root: str, path: str) -> tuple[tuple[int, int, int, int], ...]:
    """(device, inode, mode, ctime in ns) of every component of ``path`` below ``root``, by
    ``lstat``: taken before and after Spark reads the file by path, any difference (a symlink
    put in, a folder or the file renamed away and back: a rename changes the inode's ctime)
    means Spark may have read something else."""
    root = os.path.abspath(root)
    rel = os.path.relpath(os.path.abspath(path), root)
    if rel in (".", "") or rel.split(os.sep)[0] == os.pardir:
        raise LandingFileError(OUTSIDE)
    out = []
    current = root
    for part in rel.split(os.sep):
        current = os.path.join(current, part)
        st = os.lstat(current)
        out.append((st.st_dev, st.st_ino, st.st_mode, st.st_ctime_ns))
    return tuple(out)
