"""Materializing hours of a table: landing files -> change log -> history table.

This is the one function the Dagster asset calls; it has no Dagster import so it can be run
and tested on its own. A range of hours is one pass: every file of every hour is read in one
Spark job and merged in one commit, not hour by hour.

Every file the pipeline cannot process is set aside (quarantined, with its reason) while it
is inspected, before any of it reaches the change log: what the change log holds always folds.

Each run measures itself (``lib.run_cost``): seconds and Spark jobs per stage, bytes read, and
the bytes each of its Delta commits added and removed, on the outcome's ``cost``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_platform.lib import changelog, delta, quarantine, revoked_files
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.keyring import Keyring
from cdc_platform.lib.landing import files_in_hour, hour_to_partition_key
from cdc_platform.lib.merge import MergeResult, apply_pending, fault_point
from cdc_platform.lib.reading import (
    FileReport,
    LandingReader,
    NativeGuard,
    NativeReadChangedError,
    event_schema,
    inspect_files,
    read_events,
    unify_schema,
)
from cdc_platform.lib.run_cost import CostReport, RunCost, lap
from cdc_platform.lib.spark import ADAPTIVE, conf_restored
from cdc_platform.lib.storage import Location, Where
from cdc_platform.lib.warehouse import TablePaths

if TYPE_CHECKING:
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
    # Seconds and Spark jobs per stage, bytes read and rewritten per table (``lib.run_cost``).
    cost: CostReport | None = None


def committed_tables(paths: TablePaths) -> dict[str, Location]:
    """The Delta tables a materialization may commit to, by the names its cost figures use."""
    return {
        "history": paths.history,
        "changelog": paths.changelog,
        "quarantine": paths.quarantine,
        "delete_only_keys": paths.delete_only_keys,
    }


def materialize(
    spark: SparkSession,
    table: TableConfig,
    landing_root: Path,
    warehouse_root: Where,
    hours: Sequence[datetime],
    keyring: Keyring | None = None,
    synced_at: datetime | None = None,
) -> MaterializationOutcome:
    """Apply every file of ``hours`` to the table: change log first, then the history table.

    Raises LandingRootMissingError if ``landing_root`` does not exist; a missing table or hour
    folder inside it is just an hour with no files.
    """
    if not Path(landing_root).is_dir():
        raise LandingRootMissingError(
            f"landing_root {landing_root} does not exist or is not a folder: check the config"
            f" (or mount the landing volume); table {table.name!r} was not materialized"
        )
    paths = TablePaths.of(warehouse_root, table.name)
    with RunCost(spark, committed_tables(paths)) as cost, conf_restored(spark, ADAPTIVE):
        outcome = _apply_hours(spark, table, landing_root, paths, hours, keyring, synced_at)
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


def _apply_hours(
    spark: SparkSession,
    table: TableConfig,
    landing_root: Path,
    paths: TablePaths,
    hours: Sequence[datetime],
    keyring: Keyring | None,
    synced_at: datetime | None,
) -> MaterializationOutcome:
    """``materialize`` in stages, each marked for the run's cost (``run_cost.lap``)."""
    lap("list_files")
    # A table another engine gave a feature the platform cannot keep stops the run here.
    delta.check_tables(paths.changelog, paths.history)
    started = time.monotonic()
    synced_at = to_ms(synced_at or datetime.now(UTC))
    reader = LandingReader(table, landing_root, keyring)

    def revoked_now() -> set[str]:
        return revoked_files.revoked_names(paths.revoked_files)

    revoked = revoked_now()
    skipped: list[str] = []
    partition_of: dict[str, str] = {}
    size_of: dict[str, int] = {}
    not_read: dict[str, str] = {}  # symlinks, files in sub-folders: never opened
    for hour in hours:
        for f in files_in_hour(landing_root, table.name, hour):
            if reader.relative(f.path) in revoked:
                skipped.append(reader.relative(f.path))
                continue
            partition_of[f.path] = hour_to_partition_key(hour)
            size_of[f.path] = f.size
            if f.set_aside is not None:
                not_read[f.path] = f.set_aside
            else:
                reader.expect({f.path: f.file_id})  # read only if still this very file
    all_paths = sorted(partition_of)
    plan_whole_if_small(spark, sum(size_of.values()))

    lap("inspect")
    reports = [FileReport(p, 0, None, reason) for p, reason in sorted(not_read.items())]
    reports += inspect_files(spark, reader, [p for p in all_paths if p not in not_read])
    readable = [r for r in reports if r.ok]
    fields, clashes = unify_schema(
        changelog.key_and_data_fields(paths.changelog), readable, table.may_widen
    )
    good = [r for r in readable if r.path not in clashes]

    set_aside = [
        quarantine.QuarantinedFile(
            file=reader.relative(r.path),
            partition=partition_of[r.path],
            reason=r.error or clashes[r.path],
            row=r.error_row,
            bad_rows=r.bad_rows,
            detected_at=synced_at,
        )
        for r in reports
        if not r.ok or r.path in clashes
    ]

    events_read = sum(r.num_rows for r in good)
    new_events = 0
    native: dict[str, str] = {}
    if events_read:
        lap("changelog_append")
        with_rows = [r for r in good if r.num_rows]
        # A file whose column is narrower than the table's (the table widened) is cast up by
        # the Python decoder, as every widening is (Arrow's casts, one engine for all of them).
        unified = {f.name: f.type for f in fields}
        native = {
            r.path: r.source_uri
            for r in with_rows
            if r.native
            and r.source_uri
            and r.schema is not None
            and all(unified.get(f.name, f.type) == f.type for f in r.schema)
        }
        # Spark reads these by path: checked before, and before the commit (``NativeGuard``).
        guard = NativeGuard(reader, sorted(native))
        native = {p: uri for p, uri in native.items() if p in guard.readable}
        # Every file with rows has a seq range: a missing seq sets the file aside.
        seq_range = (
            min(r.seq_min for r in with_rows if r.seq_min is not None),
            max(r.seq_max for r in with_rows if r.seq_max is not None),
        )

        def append(native: dict[str, str]) -> changelog.AppendResult:
            events = read_events(
                spark, reader, [r.path for r in with_rows], event_schema(fields), native
            )
            return changelog.append(
                spark,
                paths.changelog,
                events,
                table.primary_key,
                seq_range,
                events_read,
                synced_at,
                revoked=revoked_now,
                forgotten=paths.forgotten_events,
                before_commit=guard.verify if native else None,
            )

        try:
            appended = append(native)
        except Exception as exc:
            # A file swapped under Spark may fail its read before the guard is asked (an
            # error naming the swapped-in target): a changed file means the read was not ours.
            if not native or not (isinstance(exc, NativeReadChangedError) or guard.changed()):
                raise
            native = {}  # every file through the checked descriptor, in Python
            appended = append(native)
        new_events = appended.new_events
    lap("quarantine")
    quarantine.record(
        paths.quarantine,
        [reader.relative(p) for p in all_paths],
        set_aside,
        partitions=[hour_to_partition_key(h) for h in hours],
    )
    fault_point("after_changelog_commit")

    lap("merge_open")
    version_before = delta.version_or_none(paths.history)
    merge = apply_pending(
        spark,
        paths,
        table.primary_key,
        synced_at,
        table.history_columns,
        list_keys=table.encryption == "none",  # an encrypted table's keys are decrypted data
    )
    return MaterializationOutcome(
        files_read=len(all_paths),
        events_read=events_read,
        events_new=new_events,
        quarantined=tuple(set_aside),
        merge=merge,
        seconds=round(time.monotonic() - started, 3),
        synced_at=synced_at,
        history_version_before=version_before,
        read_natively=tuple(sorted(reader.relative(p) for p in native)),
        revoked=tuple(sorted(skipped)),
        landing_bytes_read=sum(size_of[p] for p in all_paths if p not in not_read),
    )


def to_ms(ts: datetime) -> datetime:
    """A time truncated to the millisecond, in UTC (the precision of the history table)."""
    ts = ts.astimezone(UTC)
    return ts.replace(microsecond=(ts.microsecond // 1000) * 1000)
