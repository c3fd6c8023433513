"""A landing batch: files listed once, inspected (pass 1), then read (pass 2) as one.

The one path from landing files to change events, shared by a materialization (the files of
its hours) and a re-sync (its snapshot folder's files): the reader is told which file each
listed name is and opens nothing else; every file is inspected before any is read, and set
aside whole when it cannot be read (HISTORY_MODE.md, rule 4); the events are read checked
against what pass 1 saw, and a file that changes meanwhile is set aside, not half applied.
What becomes of the events (the change log, the re-sync's checks) is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from cdc_platform.lib.landing.reading.file_reader import (
    FileReport,
    LandingReader,
    changed_files_named,
)
from cdc_platform.lib.landing.reading.native import NativeGuard, NativeReadChangedError
from cdc_platform.lib.landing.reading.passes import (
    event_schema,
    inspect_files,
    read_events,
    unify_schema,
    with_row_id,
)
from cdc_platform.lib.landing.where.layout import LandingFile, hour_to_partition_key
from cdc_platform.lib.landing.where.safe_open import FileId
from cdc_platform.lib.landing.where.zone import LandingZone

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["APPEND_ATTEMPTS", "Inspected", "LandingBatch", "Listing"]

T = TypeVar("T")
# What logs a batch's events: (the files read, their events, the check to run just before
# its commit) -> what it logged. Raising from the check discards what it wrote.
Write = Callable[[Sequence[FileReport], "DataFrame", Callable[[], None]], T]

# Attempts at the change-log append when files change under it: each attempt sets the changed
# files aside and appends the rest (a file rewritten again and again cannot hold its hour).
APPEND_ATTEMPTS = 3


@dataclass
class Listing:
    """A batch's files as listed once: what is read, what is not, and why."""

    paths: list[str]  # every file to read or set aside unopened, sorted
    not_read: dict[str, str] = field(default_factory=dict)  # symlinks, sub-folders': why
    partition_of: dict[str, str] = field(default_factory=dict)  # an hour's file: its partition
    size_of: dict[str, int] = field(default_factory=dict)
    # Every file of the hours with its partition, un-applied ones too (the applied-files ledger).
    listed: list[tuple[str, LandingFile]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # un-applied by a user: not read


@dataclass(frozen=True)
class Inspected:
    """Pass 1 over a batch: every file's report, the table's key and data columns after the
    batch (rule 4: only added, only widened; a keyless table's id first), and the files whose
    column types clash with them, with why."""

    reports: list[FileReport]
    fields: list[pa.Field]
    clashes: dict[str, str]

    @property
    def good(self) -> list[FileReport]:
        """The files to read: readable, and no type clash."""
        return [r for r in self.reports if r.ok and r.path not in self.clashes]

    @property
    def rejected(self) -> list[tuple[FileReport, str]]:
        """The files set aside, each with its reason."""
        return [
            (r, r.error or self.clashes[r.path])
            for r in self.reports
            if not r.ok or r.path in self.clashes
        ]


@dataclass(frozen=True)
class LandingBatch:
    """One batch of landing files, read by ``reader`` in ``spark``'s tasks."""

    spark: SparkSession
    reader: LandingReader
    listing: Listing

    @classmethod
    def of_hours(
        cls,
        spark: SparkSession,
        reader: LandingReader,
        zone: LandingZone,
        hours: Sequence[datetime],
        revoked: set[str],
    ) -> LandingBatch:
        """Every file of the table's ``hours``, listed once: files un-applied (``revoked``,
        by relative name) are skipped, unreadable entries set aside unopened."""
        listing = Listing([])
        for hour in hours:
            partition = hour_to_partition_key(hour)
            for f in zone.files_in_hour(reader.table.name, hour):
                listing.listed.append((partition, f))
                if reader.relative(f.path) in revoked:
                    listing.skipped.append(reader.relative(f.path))
                    continue
                listing.partition_of[f.path] = partition
                listing.size_of[f.path] = f.size
                if f.set_aside is not None:
                    listing.not_read[f.path] = f.set_aside
                else:
                    reader.expect({f.path: f.file_id})  # read only if still this very file
        listing.paths = sorted(listing.partition_of)
        return cls(spark, reader, listing)

    @classmethod
    def of_files(
        cls, spark: SparkSession, reader: LandingReader, files: Mapping[str, FileId]
    ) -> LandingBatch:
        """``files`` as listed (a snapshot folder's, whole): each read only if still that file."""
        reader.expect(files)
        return cls(spark, reader, Listing(list(files)))

    def inspect(self, logged: pa.Schema | None, native: bool = True) -> Inspected:
        """Pass 1 over every file, against the columns the change log has (``logged``);
        ``native`` False inspects every file in Python (``passes.inspect_files``)."""
        table, not_read = self.reader.table, self.listing.not_read
        reports = [FileReport(p, 0, None, why) for p, why in sorted(not_read.items())]
        to_open = [p for p in self.listing.paths if p not in not_read]
        reports += inspect_files(self.spark, self.reader, to_open, native=native)
        readable = [r for r in reports if r.ok]
        fields, clashes = unify_schema(logged, readable, table.may_widen, table.keyless)
        return Inspected(reports, with_row_id(fields, table.keyless), clashes)

    def events(self, paths: Sequence[str], fields: Sequence[pa.Field]) -> DataFrame:
        """Pass 2 over ``paths``, decoded in Python tasks, as events shaped by ``fields``."""
        return read_events(self.spark, self.reader, paths, event_schema(fields))

    def append(
        self, files: Sequence[FileReport], fields: Sequence[pa.Field], write: Write[T]
    ) -> tuple[T | None, dict[str, str], set[str]]:
        """Pass 2 over ``files`` (inspected, with rows), their events handed to ``write``.

        Returns what ``write`` returned (None if every file changed), the files read natively,
        and the files set aside because they are no longer what the listing and pass 1 saw
        (rewritten in place, replaced): their hour is asked for again
        (``lib.fleet.sensor_cursor.reconcile``). A read that fails for another reason raises,
        with nothing committed.
        """
        reader = self.reader
        native = _natively_readable(files, fields)
        # Spark reads these by path: checked before, and before the commit (``NativeGuard``).
        guard = NativeGuard(reader, sorted(native))
        native = {p: uri for p, uri in native.items() if p in guard.readable}
        changed: set[str] = set()
        left = list(files)
        for attempt in range(APPEND_ATTEMPTS):
            listed = [r.path for r in left]

            def before_commit(listed: list[str] = listed, native: dict[str, str] = native) -> None:
                if native:
                    guard.verify()
                if reader.changed_since_listed(listed):
                    raise NativeReadChangedError("a landing file changed while it was read")

            try:
                return self._once(left, fields, native, write, before_commit), native, changed
            except Exception as exc:
                now_changed = reader.changed_since_listed(listed) | {
                    p for p in listed if reader.relative(p) in changed_files_named(exc)
                }
                swapped = bool(native) and (
                    isinstance(exc, NativeReadChangedError) or guard.changed()
                )
                if (not now_changed and not swapped) or attempt == APPEND_ATTEMPTS - 1:
                    raise
            # A file swapped under Spark's by-path read: every file through the checked
            # descriptor.
            native = {} if swapped else {p: u for p, u in native.items() if p not in now_changed}
            changed |= now_changed
            left = [r for r in left if r.path not in now_changed]
            if not left:
                return None, native, changed
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _once(
        self,
        files: Sequence[FileReport],
        fields: Sequence[pa.Field],
        native: dict[str, str],
        write: Write[T],
        before_commit: Callable[[], None],
    ) -> T:
        """One attempt: read ``files`` (pass 2, checked against pass 1) and write them."""
        events = read_events(
            self.spark,
            self.reader,
            [r.path for r in files],
            event_schema(fields),
            native,
            inspected={r.path: r for r in files},
        )
        return write(files, events, before_commit)


def _natively_readable(files: Sequence[FileReport], fields: Sequence[pa.Field]) -> dict[str, str]:
    """The files Spark reads itself. A file whose column is narrower than the table's (the
    table widened) is cast up by the Python decoder, as every widening is."""
    unified = {f.name: f.type for f in fields}
    return {
        r.path: r.source_uri
        for r in files
        if r.native
        and r.source_uri
        and r.schema is not None
        and all(unified.get(f.name, f.type) == f.type for f in r.schema)
    }
