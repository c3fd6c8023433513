"""Materializing hours of a table: landing files -> change log -> history table.

This is the one function the Dagster asset calls; it has no Dagster import so it can be run
and tested on its own. A range of hours is one pass: every file of every hour is read in one
Spark job and merged in one commit, not hour by hour.

Every file the pipeline cannot process is set aside (quarantined, with its reason) while it
is inspected, before any of it reaches the change log: what the change log holds always folds.

Each run measures itself (``lib.spark.run_cost``): seconds and Spark jobs per stage, bytes read, and
the bytes each of its Delta commits added and removed, on the outcome's ``cost``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import MergeResult, apply_pending, fault_point
from cdc_platform.lib.history.protected_columns import (
    changelog_properties,
    check_hashing_salt,
    check_protected_columns,
    record_hashing,
)
from cdc_platform.lib.history.table_key import check_key
from cdc_platform.lib.landing.decoding.keyring import Keyring
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
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.safe_open import CHANGED
from cdc_platform.lib.landing.where.zone import Landing, LandingZone
from cdc_platform.lib.ledgers import applied_files, erased_keys, quarantine, revoked_files
from cdc_platform.lib.spark.run_cost import CostReport, RunCost, lap
from cdc_platform.lib.spark.session import ADAPTIVE, conf_restored
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession


class LandingRootMissingError(FileNotFoundError):
    """The configured landing root does not exist (a typo or an unmounted volume)."""


@dataclass(frozen=True)
class MaterializationOutcome:
    """What one materialization did; every figure ends up in the Dagster metadata."""

    files_read: int
    events_read: int
    events_new: int
    quarantined: tuple[quarantine.QuarantinedFile, ...]
    merge: MergeResult
    seconds: float
    synced_at: datetime
    history_version_before: int | None = None
    # Landing files (relative to the landing root) read by Spark's own Parquet reader, with no
    # Python decoding; every other file applied was decoded in Python tasks.
    read_natively: tuple[str, ...] = ()
    # Landing files (relative to the landing root) not read because a user un-applied them.
    revoked: tuple[str, ...] = ()
    # Bytes of the landing files opened (inspected, and read if they had rows).
    landing_bytes_read: int = 0
    # Seconds and Spark jobs per stage, bytes read and rewritten per table (``lib.spark.run_cost``).
    cost: CostReport | None = None


def committed_tables(paths: TablePaths) -> dict[str, Location]:
    """The Delta tables a materialization may commit to, by the names its cost figures use."""
    return {
        "history": paths.history,
        "changelog": paths.changelog,
        "quarantine": paths.quarantine,
        "delete_only_keys": paths.delete_only_keys,
    }


def needs_keyring(table: TableConfig, warehouse_root: Where) -> bool:
    """Whether reading ``table``'s files takes the keyring: its config's keys or hash salt
    (``TableConfig.needs_keyring``), or keys erased from it, known by their salted hash."""
    paths = TablePaths.of(warehouse_root, table.name)
    return table.needs_keyring or erased_keys.recorded(paths.erased_keys)


def check_salts(table: TableConfig, warehouse_root: Where, keyring: Keyring | None) -> None:
    """Refuse a keyring whose hash_salt is not the one the table's erased keys or hashed columns
    were recorded under (``pii.check_salt``): what an operator job that reads landing files or
    logs events checks before it does."""
    paths = TablePaths.of(warehouse_root, table.name)
    salt = keyring.hash_salt if keyring is not None else None
    if salt is not None:
        erased_keys.check_ledger_salt(paths.erased_keys, salt)
    check_hashing_salt(Table.open(paths.changelog), table, keyring)


def materialize(
    spark: SparkSession,
    table: TableConfig,
    landing_root: Landing,
    warehouse_root: Where,
    hours: Sequence[datetime],
    keyring: Keyring | None = None,
    synced_at: datetime | None = None,
    run_id: str | None = None,
) -> MaterializationOutcome:
    """Apply every file of ``hours`` to the table: change log first, then the history table;
    then, given the ``run_id``, record the files applied (``lib.ledgers.applied_files``: what the
    landing sensor compares the landing zone with).

    Raises LandingRootMissingError if ``landing_root`` does not exist; a missing table or hour
    folder inside it is just an hour with no files.
    """
    landing = zone_at(landing_root)
    if not landing.exists():
        raise LandingRootMissingError(
            f"landing_root {landing.root} does not exist, is not a folder or does not answer:"
            f" check the config (or mount the landing volume); table {table.name!r} was not"
            " materialized"
        )
    paths = TablePaths.of(warehouse_root, table.name)
    run = _Run(spark, table, landing, warehouse_root, hours, keyring, synced_at)
    with RunCost(spark, committed_tables(paths)) as cost, conf_restored(spark, ADAPTIVE):
        outcome, listing = _apply_hours(run)
    if run_id is not None:
        _record_applied(run, listing, outcome, run_id)
    read = {
        "landing": outcome.landing_bytes_read,
        "changelog": outcome.merge.changelog_bytes_read,
        "history": outcome.merge.history_bytes_read,
    }
    return replace(outcome, cost=cost.report(read))


# Below this much landing data a run plans its queries whole (adaptive execution off): Spark's
# adaptive execution submits every shuffle stage as a Spark job of its own, and a small hour's
# merge then ran 47 jobs instead of 20 (``benchmarks/run_cost.py --conf``), each a fixed cost,
# for re-planning that only pays off on large inputs. Larger runs keep it (skew, coalescing).
SMALL_RUN_BYTES = 64 * 1024 * 1024


def plan_whole_if_small(spark: SparkSession, landing_bytes: int) -> None:
    """Adaptive execution off for a run under ``SMALL_RUN_BYTES`` of landing data."""
    if landing_bytes < SMALL_RUN_BYTES:
        spark.conf.set(ADAPTIVE, "false")


@dataclass(frozen=True)
class _Run:
    """One materialization's inputs, said once: every stage below takes it."""

    spark: SparkSession
    table: TableConfig
    landing: LandingZone
    warehouse_root: Where
    hours: Sequence[datetime]
    keyring: Keyring | None
    synced_at: datetime | None

    @property
    def paths(self) -> TablePaths:
        return TablePaths.of(self.warehouse_root, self.table.name)

    @property
    def partitions(self) -> list[str]:
        return [hour_to_partition_key(h) for h in self.hours]

    def revoked(self) -> set[str]:
        """The landing files un-applied so far (asked again before each commit)."""
        return revoked_files.revoked_names(self.paths.revoked_files)


@dataclass
class _Listing:
    """The hours' files as listed once: what is read, what is not, and why."""

    listed: list[applied_files.AppliedFile]  # every file, for the applied-files ledger
    partition_of: dict[str, str]  # each file to read (or set aside unopened): its partition
    size_of: dict[str, int]
    not_read: dict[str, str]  # symlinks, files in sub-folders: never opened, and why
    skipped: list[str]  # un-applied by a user: not read

    @property
    def paths(self) -> list[str]:
        return sorted(self.partition_of)


def _apply_hours(run: _Run) -> tuple[MaterializationOutcome, _Listing]:
    """``materialize`` in stages, each marked for the run's cost (``run_cost.lap``): list,
    inspect (pass 1), append to the change log (pass 2), record the quarantine, merge."""
    lap("list_files")
    # A table another engine gave a feature the platform cannot keep, or a config naming
    # another key than the history table's, stops the run here, before it writes.
    # Each opened once here (which checks its features) and handed down.
    log, history = Table.open(run.paths.changelog), Table.open(run.paths.history)
    check_key(history, run.table.key)
    check_protected_columns(log, run.table)
    check_hashing_salt(log, run.table, run.keyring)  # another salt: refused before any read
    started = time.monotonic()
    synced_at = to_ms(run.synced_at or datetime.now(UTC))
    reader = LandingReader(run.table, run.landing, run.keyring)
    erased = erased_keys.loader(run.paths.erased_keys, run.keyring)
    if erased() is not None:  # refused here without the salt, before any read
        reader.hide_values = True  # a reason could quote a cell of an erased key's row
    listing = _list(run, reader)
    plan_whole_if_small(run.spark, sum(listing.size_of.values()))

    lap("inspect")
    fields, good, set_aside = _inspect(run, reader, listing, log, synced_at)

    new_events, native, events_read = 0, {}, 0
    with_rows = [r for r in good if r.num_rows]
    if with_rows:
        lap("changelog_append")
        append = _Append(
            run.spark, run.table, reader, run.paths, fields, synced_at, run.revoked, erased
        )
        appended, native, changed = append.run(with_rows)
        new_events = appended.new_events if appended is not None else 0
        events_read = sum(r.num_rows for r in with_rows if r.path not in changed)
        set_aside += [
            _set_aside(reader.relative(p), listing.partition_of[p], CHANGED, synced_at)
            for p in sorted(changed)
        ]
    lap("quarantine")
    quarantine.record(
        run.paths.quarantine,
        [reader.relative(p) for p in listing.paths],
        set_aside,
        partitions=run.partitions,
    )
    fault_point("after_changelog_commit")

    lap("merge_open")
    merge = apply_pending(
        run.spark,
        run.paths,
        run.table.key,
        synced_at,
        run.table.history_columns,
        list_keys=run.table.encryption == "none",  # an encrypted table's keys are decrypted data
    )
    outcome = MaterializationOutcome(
        files_read=len(listing.paths),
        events_read=events_read,
        events_new=new_events,
        quarantined=tuple(set_aside),
        merge=merge,
        seconds=round(time.monotonic() - started, 3),
        synced_at=synced_at,
        history_version_before=history.version,
        read_natively=tuple(sorted(reader.relative(p) for p in native)),
        revoked=tuple(sorted(listing.skipped)),
        landing_bytes_read=sum(s for p, s in listing.size_of.items() if p not in listing.not_read),
    )
    return outcome, listing


def _list(run: _Run, reader: LandingReader) -> _Listing:
    """Every file of the hours, listed once: the reader is told which file each name is (it
    reads nothing else there), un-applied files are skipped, unreadable entries set aside."""
    revoked = run.revoked()
    listing = _Listing([], {}, {}, {}, [])
    for hour in run.hours:
        partition = hour_to_partition_key(hour)
        for f in run.landing.files_in_hour(run.table.name, hour):
            listing.listed.append(applied_files.AppliedFile(partition, f))
            if reader.relative(f.path) in revoked:
                listing.skipped.append(reader.relative(f.path))
                continue
            listing.partition_of[f.path] = partition
            listing.size_of[f.path] = f.size
            if f.set_aside is not None:
                listing.not_read[f.path] = f.set_aside
            else:
                reader.expect({f.path: f.file_id})  # read only if still this very file
    return listing


def _inspect(
    run: _Run, reader: LandingReader, listing: _Listing, log: Table, synced_at: datetime
) -> tuple[list[pa.Field], list[FileReport], list[quarantine.QuarantinedFile]]:
    """Pass 1 over every file: the columns the change log (``log``, as the run found it) will
    have, the files to append, and those set aside (unreadable, bad rows, a type that cannot
    widen: rule 4, quarantine)."""
    reports = [FileReport(p, 0, None, why) for p, why in sorted(listing.not_read.items())]
    to_open = [p for p in listing.paths if p not in listing.not_read]
    reports += inspect_files(run.spark, reader, to_open)
    readable = [r for r in reports if r.ok]
    logged = changelog.key_and_data_fields(log)
    fields, clashes = unify_schema(logged, readable, run.table.may_widen, run.table.keyless)
    fields = with_row_id(fields, run.table.keyless)
    good = [r for r in readable if r.path not in clashes]
    set_aside = [
        replace(
            _set_aside(
                reader.relative(r.path),
                listing.partition_of[r.path],
                r.error or clashes[r.path],
                synced_at,
            ),
            row=r.error_row,
            bad_rows=r.bad_rows,
        )
        for r in reports
        if not r.ok or r.path in clashes
    ]
    return fields, good, set_aside


def _set_aside(file: str, partition: str, reason: str, at: datetime) -> quarantine.QuarantinedFile:
    return quarantine.QuarantinedFile(
        file=file, partition=partition, reason=reason, row=None, bad_rows=0, detected_at=at
    )


def _record_applied(
    run: _Run, listing: _Listing, outcome: MaterializationOutcome, run_id: str
) -> None:
    """The applied-files ledger for the run's partitions: every file listed before reading
    (each was read, set aside or un-applied), but a file that changed while it was read: its
    hour stays pending, so the landing sensor asks for it again."""
    changed = {q.file for q in outcome.quarantined if q.reason == CHANGED}
    kept = [
        a for a in listing.listed if applied_files.identity(run.landing, a.file)[0] not in changed
    ]
    applied_files.record(
        applied_files.ledger_path(run.warehouse_root, run.table.name),
        run.landing,
        run.partitions,
        kept,
        run_id,
        outcome.synced_at,
    )


# Attempts at the change-log append when files change under it: each attempt sets the changed
# files aside and appends the rest (a file rewritten again and again cannot hold its hour).
APPEND_ATTEMPTS = 3


@dataclass(frozen=True)
class _Append:
    """The change-log append of one run: what every attempt needs, said once."""

    spark: SparkSession
    table: TableConfig
    reader: LandingReader
    paths: TablePaths
    fields: Sequence[pa.Field]
    synced_at: datetime
    revoked: Callable[[], set[str]]
    erased: Callable[[], erased_keys.ErasedKeys | None]

    def run(
        self, files: Sequence[FileReport]
    ) -> tuple[changelog.AppendResult | None, dict[str, str], set[str]]:
        """Append the events of ``files`` (inspected, with rows) to the change log.

        Returns the append (None if every file changed), the files read natively, and the
        files set aside because they are no longer what the listing and pass 1 saw (rewritten
        in place, replaced): their hour is asked for again (``lib.fleet.sensor_cursor.reconcile``).
        A read that fails for another reason raises, with nothing committed.
        """
        reader = self.reader
        native = self._natively_readable(files)
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
                return self._once(left, native, before_commit), native, changed
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

    def _natively_readable(self, files: Sequence[FileReport]) -> dict[str, str]:
        """The files Spark reads itself. A file whose column is narrower than the table's (the
        table widened) is cast up by the Python decoder, as every widening is."""
        unified = {f.name: f.type for f in self.fields}
        return {
            r.path: r.source_uri
            for r in files
            if r.native
            and r.source_uri
            and r.schema is not None
            and all(unified.get(f.name, f.type) == f.type for f in r.schema)
        }

    def _once(
        self,
        files: Sequence[FileReport],
        native: dict[str, str],
        before_commit: Callable[[], None],
    ) -> changelog.AppendResult:
        """One attempt: read ``files`` (pass 2, checked against pass 1) and append them."""
        # Every file with rows has a seq range: a missing seq sets the file aside.
        seq_range = (
            min(r.seq_min for r in files if r.seq_min is not None),
            max(r.seq_max for r in files if r.seq_max is not None),
        )
        events = read_events(
            self.spark,
            self.reader,
            [r.path for r in files],
            event_schema(self.fields),
            native,
            inspected={r.path: r for r in files},
        )
        # How the batch's hashed cells were made, recorded before they are logged.
        schemas = [r.schema for r in files]
        record_hashing(self.paths.changelog, self.table, self.reader.salt, schemas)
        rows = sum(r.num_rows for r in files)
        return changelog.append(
            self.spark,
            self.paths.changelog,
            changelog.Batch(events, self.table.key, seq_range, rows, self.synced_at),
            changelog.Guards(
                revoked=self.revoked,
                forgotten=self.paths.forgotten_events,
                erased=self.erased,
                before_commit=before_commit,
            ),
            changelog_properties(self.table, self.reader.salt, schemas),
        )


def to_ms(ts: datetime) -> datetime:
    """A time truncated to the millisecond, in UTC (the precision of the history table)."""
    ts = ts.astimezone(UTC)
    return ts.replace(microsecond=(ts.microsecond // 1000) * 1000)
