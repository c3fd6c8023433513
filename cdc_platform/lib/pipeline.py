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
from cdc_platform.lib.errors import PlatformError
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import MergeResult, fault_point
from cdc_platform.lib.history.protected_columns import (
    changelog_properties,
    check_hashing_salt,
    record_hashing,
)
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.batch import Inspected, LandingBatch, Listing
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.reading.file_reader import FileReport, LandingReader
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.safe_open import CHANGED
from cdc_platform.lib.landing.where.zone import Landing, LandingZone
from cdc_platform.lib.ledgers import applied_files, erased_keys, quarantine
from cdc_platform.lib.operations.operation import to_ms
from cdc_platform.lib.spark.run_cost import CostReport, RunCost, lap
from cdc_platform.lib.spark.session import ADAPTIVE, conf_restored
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


class LandingRootMissingError(PlatformError, FileNotFoundError):
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
    """``materialize_hours`` on a handle opened for the call."""
    handle = HistoryTable(spark, table, warehouse_root, landing_root, keyring)
    return materialize_hours(handle, hours, synced_at, run_id)


def materialize_hours(
    t: HistoryTable,
    hours: Sequence[datetime],
    synced_at: datetime | None = None,
    run_id: str | None = None,
) -> MaterializationOutcome:
    """Apply every file of ``hours`` to the table: change log first, then the history table;
    then, given the ``run_id``, record the files applied (``lib.ledgers.applied_files``: what the
    landing sensor compares the landing zone with).

    Raises LandingRootMissingError if the landing root does not exist; a missing table or hour
    folder inside it is just an hour with no files.
    """
    spark, table = t.spark, t.config
    landing = zone_at(t.landing)
    if not landing.exists():
        raise LandingRootMissingError(
            f"landing_root {landing.root} does not exist, is not a folder or does not answer:"
            f" check the config (or mount the landing volume); table {table.name!r} was not"
            " materialized"
        )
    run = _Run(t, landing, hours, synced_at)
    with RunCost(spark, committed_tables(t.paths)) as cost, conf_restored(spark, ADAPTIVE):
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

    handle: HistoryTable  # the table, its session and keyring, its Delta tables opened once
    landing: LandingZone
    hours: Sequence[datetime]
    synced_at: datetime | None

    @property
    def spark(self) -> SparkSession:
        return self.handle.spark

    @property
    def table(self) -> TableConfig:
        return self.handle.config

    @property
    def keyring(self) -> Keyring | None:
        return self.handle.keyring

    @property
    def paths(self) -> TablePaths:
        return self.handle.paths

    @property
    def partitions(self) -> list[str]:
        return [hour_to_partition_key(h) for h in self.hours]


def _apply_hours(run: _Run) -> tuple[MaterializationOutcome, Listing]:
    """``materialize`` in stages, each marked for the run's cost (``run_cost.lap``): list,
    inspect (pass 1), append to the change log (pass 2), record the quarantine, merge."""
    lap("list_files")
    # A table another engine gave a feature the platform cannot keep, or a config naming
    # another key than the history table's, stops the run here, before it writes.
    # Each opened once here (which checks its features) and handed down.
    log, history = run.handle.changelog, run.handle.history
    run.handle.check()
    check_hashing_salt(log, run.table, run.keyring)  # another salt: refused before any read
    started = time.monotonic()
    synced_at = to_ms(run.synced_at or datetime.now(UTC))
    reader = LandingReader(run.table, run.landing, run.keyring)
    erased = run.handle.erased()
    if erased() is not None:  # refused here without the salt, before any read
        reader.hide_values = True  # a reason could quote a cell of an erased key's row
    batch = LandingBatch.of_hours(run.spark, reader, run.landing, run.hours, run.handle.revoked())
    listing = batch.listing
    plan_whole_if_small(run.spark, sum(listing.size_of.values()))

    lap("inspect")
    # The columns the change log will have: those it has as the run found it, and the batch's.
    inspected = batch.inspect(changelog.key_and_data_fields(log))
    fields, good = inspected.fields, inspected.good
    set_aside = _set_aside_inspected(inspected, listing, reader, synced_at)

    new_events, native, events_read = 0, {}, 0
    with_rows = [r for r in good if r.num_rows]
    if with_rows:
        lap("changelog_append")
        write = _log_events(run, reader, synced_at, erased)
        appended, native, changed = batch.append(with_rows, fields, write)
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
    # An encrypted table's keys are decrypted data: never named in its commit.
    merge = run.handle.merge_pending(synced_at, list_keys=run.table.encryption == "none")
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


def _set_aside_inspected(
    inspected: Inspected, listing: Listing, reader: LandingReader, at: datetime
) -> list[quarantine.QuarantinedFile]:
    """The files pass 1 set aside: unreadable, bad rows, a type that cannot widen (rule 4,
    quarantine)."""
    return [
        replace(
            _set_aside(reader.relative(r.path), listing.partition_of[r.path], why, at),
            row=r.error_row,
            bad_rows=r.bad_rows,
        )
        for r, why in inspected.rejected
    ]


def _set_aside(file: str, partition: str, reason: str, at: datetime) -> quarantine.QuarantinedFile:
    return quarantine.QuarantinedFile(
        file=file, partition=partition, reason=reason, row=None, bad_rows=0, detected_at=at
    )


def _record_applied(
    run: _Run, listing: Listing, outcome: MaterializationOutcome, run_id: str
) -> None:
    """The applied-files ledger for the run's partitions: every file listed before reading
    (each was read, set aside or un-applied), but a file that changed while it was read: its
    hour stays pending, so the landing sensor asks for it again."""
    changed = {q.file for q in outcome.quarantined if q.reason == CHANGED}
    kept = [
        applied_files.AppliedFile(partition, f)
        for partition, f in listing.listed
        if applied_files.identity(run.landing, f)[0] not in changed
    ]
    applied_files.record(
        applied_files.of_table(run.paths),
        run.landing,
        run.partitions,
        kept,
        run_id,
        outcome.synced_at,
    )


def _log_events(
    run: _Run,
    reader: LandingReader,
    synced_at: datetime,
    erased: Callable[[], erased_keys.ErasedKeys | None],
) -> Callable[[Sequence[FileReport], DataFrame, Callable[[], None]], changelog.AppendResult]:
    """What the batch's append hands its events to (``LandingBatch.append``, once per attempt):
    the change log, with how the hashed cells were made recorded first."""

    def write(
        files: Sequence[FileReport], events: DataFrame, before_commit: Callable[[], None]
    ) -> changelog.AppendResult:
        # Every file with rows has a seq range: a missing seq sets the file aside.
        seq_range = (
            min(r.seq_min for r in files if r.seq_min is not None),
            max(r.seq_max for r in files if r.seq_max is not None),
        )
        # How the batch's hashed cells were made, recorded before they are logged.
        schemas = [r.schema for r in files]
        record_hashing(run.handle.fresh(run.paths.changelog), run.table, reader.salt, schemas)
        rows = sum(r.num_rows for r in files)
        return changelog.append(
            run.spark,
            run.paths.changelog,
            changelog.Batch(events, run.table.key, seq_range, rows, synced_at),
            changelog.Guards(
                revoked=run.handle.revoked,
                forgotten=run.paths.forgotten_events,
                erased=erased,
                before_commit=before_commit,
            ),
            changelog_properties(run.table, reader.salt, schemas),
        )

    return write
