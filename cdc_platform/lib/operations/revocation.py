"""Un-applying a delivery, and re-admitting it: a bad landing file taken back out of a table.

``unapply`` records the files as revoked (``lib.ledgers.revoked_files``), removes their events from the
change log and recomputes the keys they touched, committing the history table once: afterwards
the table is what it would be had the files never landed. It runs in three commits, each safe
to crash after:

1. the files are recorded as revoked: from then on no materialization reads them and no change
   log append takes their events (an append racing this re-reads the list on every attempt);
2. the keys whose events go are recorded (``merge.record_retracted_keys``), then the change-log
   files holding those events are rewritten without them, in one strict commit (so that it
   lands exactly at the version after the one the keys were recorded for);
3. the merge recomputes every retracted key from what the change log still holds, whatever run
   comes first: this one, or the next materialization after a crash.

Running it again changes nothing. An event that another file also delivered (the same key and
``cdc_change_seq``) was logged once, from the file read first: un-applying that file removes it.
Materialize the other file's hour again to log it from there.

``readmit`` deletes the files' revocation and materializes the hours they are in, so their
events are logged and merged again: un-apply then re-admit gives back the same table
(``_fivetran_synced`` aside).
"""

from __future__ import annotations

import fnmatch
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from deltalake.exceptions import CommitFailedError

from cdc_platform.lib.columns import SOURCE_FILE, col, cols, internal
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import APP_ID, MergeResult, apply_pending, record_retracted_keys
from cdc_platform.lib.history.merge import table_relative as _table_relative
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.where.layout import is_data_file
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import Landing
from cdc_platform.lib.ledgers import revoked_files
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize, to_ms
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# The column ``remove_events``' callers set on each change-log event: true if it goes.
GONE = internal("gone")
# The sources of an operation's own events (``adoption``, ``resync``, ``truncation`` import
# this module, so their prefixes are spelled here too; a test checks they agree).
ADOPT_PREFIX = "adopt:"
RESYNC_PREFIX = "resync:at="
TRUNCATE_PREFIX = "truncate:before="
# Digits the landing layout can hold (padded or not): ASCII only, never more than a year's
# four (an unbounded group would hand ``datetime`` a number it overflows on).
_HOUR_PARTS = re.compile(
    r"/year=([0-9]{1,4})/month=([0-9]{1,2})/day=([0-9]{1,2})/hour=([0-9]{1,2})/[^/]+$"
)


class NoMatchingFileError(LookupError):
    """A file name or glob given to un-apply or re-admit matches no file of the table."""


class NotReadmittableError(ValueError):
    """Re-admit named an operation's events (adopt, re-sync, truncate): re-run it instead."""


@dataclass(frozen=True)
class UnapplyResult:
    files: tuple[str, ...]  # every file the request names, now revoked
    newly_revoked: tuple[str, ...]  # those this call recorded (a replay records none)
    events_removed: int
    keys_retracted: int
    changelog_files_rewritten: int
    merge: MergeResult
    hours: tuple[datetime, ...]  # the hour folders the files are in


@dataclass(frozen=True)
class ReadmitResult:
    files: tuple[str, ...]
    hours: tuple[datetime, ...]
    outcome: MaterializationOutcome | None  # None when no file is in an hour folder


def hour_of(file: str) -> datetime | None:
    """The hour folder a landing-relative file is in (None if it is not in one, or its parts
    are no hour). Total: un-apply and re-admit call it after their commits, so it never raises."""
    m = _HOUR_PARTS.search("/" + file.replace(os.sep, "/"))
    if m is None:
        return None
    try:
        return datetime(*(int(g) for g in m.groups()), tzinfo=UTC)  # type: ignore[misc]
    except (ValueError, OverflowError):
        return None


def is_landing_file(name: str, table: str) -> bool:
    """Whether a ``_cdc_source_file`` names a landing file of ``table`` (``<table>/...``), as
    opposed to an operation's own events (``adopt:``, ``resync:at=``, ``truncate:before=``, a
    re-sync snapshot's files), which no materialization logs again."""
    return name.replace(os.sep, "/").startswith(f"{table}/")


def operation_of(name: str) -> str:
    """What to run to log an operation's events again (re-admitting them logs nothing)."""
    if name.startswith(ADOPT_PREFIX):
        return f"run adopt_table again with source {name.removeprefix(ADOPT_PREFIX)}"
    if name.startswith(RESYNC_PREFIX):
        return f"run resync_table again with its snapshot and at {name.removeprefix(RESYNC_PREFIX)}"
    if name.startswith(TRUNCATE_PREFIX):
        return (
            "run truncate_table (soft) again to close the keys live now; it closes those "
            "written before its before, and the un-apply rewrote the keys it had closed"
        )
    return "it is a re-sync snapshot's file: run resync_table again with its snapshot and at"


def match(
    patterns: Sequence[str], candidates: set[str], table: str, landing_root: Landing
) -> list[str]:
    """The candidates each pattern names: a path or glob relative to the landing root
    (``orders/year=2024/*/*/*/bad-*.parquet``), to the table's folder (``year=2024/...``), or
    absolute under the landing root (a path, or on a bucket its ``s3://`` URI). ``*`` also
    matches ``/``. An operation's own source
    (``adopt:...``, ``resync:at=...``, ``truncate:before=...``, a snapshot file) is matched only
    when named exactly, never by a glob: taking it back cannot be undone by re-admitting it.
    Raises if one matches nothing."""
    if not patterns:
        raise NoMatchingFileError(f"no file given for table {table!r}")
    zone = zone_at(landing_root)
    root = zone.root
    landing = {c for c in candidates if is_landing_file(c, table)}
    operations = candidates - landing
    out: set[str] = set()
    for raw in patterns:
        exact = raw.strip()
        p = exact
        if os.path.isabs(p) or "://" in p:
            p = zone.relative(p)
        p = p.removeprefix("./")
        forms = {p, f"{table}/{p}"}
        hit = {c for c in landing if any(fnmatch.fnmatchcase(c, f) for f in forms)}
        hit |= {c for c in operations if c == exact}
        if not hit:
            globbed = sorted(c for c in operations if any(fnmatch.fnmatchcase(c, f) for f in forms))
            hint = (
                f"; an operation's events match only when named exactly: {globbed[:5]}"
                if globbed
                else ""
            )
            raise NoMatchingFileError(
                f"{raw!r} matches no landing file of table {table!r} (paths are relative to the "
                f"landing root {root} or to its {table}/ folder){hint}"
            )
        out |= hit
    return sorted(out)


def _landing_files(landing_root: Landing, table: str) -> set[str]:
    """Every data file under the table's landing folder, relative to the landing root."""
    files = zone_at(landing_root).table_files(table)
    return {f for f in files if is_data_file(f.rsplit("/", 1)[-1])}


def _logged_files(spark: SparkSession, paths: TablePaths) -> set[str]:
    """Every landing file with an event in the change log."""
    log = Table.open(paths.changelog)
    if not log.files:
        return set()
    events = log.read(spark)
    return {r[0] for r in events.select(SOURCE_FILE).distinct().collect() if r[0] is not None}


def unapply(
    spark: SparkSession,
    table: TableConfig,
    landing_root: Landing,
    warehouse_root: Where,
    patterns: Sequence[str],
    reason: str,
    run_id: str,
    now: datetime | None = None,
) -> UnapplyResult:
    """Take the named landing files' events out of the table (see the module docstring)."""
    if not reason.strip():
        raise ValueError("un-applying files needs a reason (it is recorded with them)")
    paths = TablePaths.of(warehouse_root, table.name)
    now = to_ms(now or datetime.now(UTC))
    candidates = (
        _logged_files(spark, paths)
        | _landing_files(landing_root, table.name)
        | revoked_files.revoked_names(paths.revoked_files)
    )
    files = match(patterns, candidates, table.name, landing_root)
    newly = revoked_files.add(paths.revoked_files, files, reason.strip(), run_id, now)
    (removed, keys, rewritten), _ = delta.with_commit_retries(
        lambda: _remove_events(
            spark,
            paths,
            table.key,
            revoked_files.revoked_names(paths.revoked_files),
            fence=bool(newly),
        ),
        f"change log rewrite of {paths.changelog}",
    )
    merge = apply_pending(spark, paths, table.key, now, table.history_columns)
    hours = sorted({h for f in files if (h := hour_of(f)) is not None})
    return UnapplyResult(tuple(files), tuple(newly), removed, keys, rewritten, merge, tuple(hours))


def _remove_events(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    names: set[str],
    fence: bool = False,
) -> tuple[int, int, int]:
    """One attempt: record the keys, rewrite the change-log files holding events of ``names``
    without them, commit strictly. Returns (events removed, keys, files rewritten).

    With ``fence`` (files were just revoked) a change log holding none of their events still
    gets a commit, an empty one: an append that read the revoked list before the files were
    revoked then loses its strict commit and re-reads the list, instead of logging them."""
    from pyspark.sql import functions as F

    log = Table.open(paths.changelog)
    if not names or not log.exists:
        return 0, 0, 0
    files = [f for f in log.files if revoked_files.may_hold(f, names)]
    gone = F.coalesce(col(SOURCE_FILE).isin(sorted(names)), F.lit(False))
    return remove_events(
        spark,
        paths,
        primary_key,
        log,
        files,
        lambda events: events.withColumn(GONE, gone),
        "cdc_platform.unapplied_events",
        fence,
    )


def remove_events(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    log: Table,
    files: Sequence[delta.DataFile],
    mark: Callable[[DataFrame], DataFrame],
    metadata_key: str,
    fence: bool = False,
    forget: bool = False,
) -> tuple[int, int, int]:
    """Take the events ``mark`` flags (its boolean column ``GONE``) out of ``files`` of the
    change-log snapshot ``log``: record their keys as retracted, then rewrite the files holding
    them in one strict commit. Returns (events removed, keys, files rewritten); with ``fence``
    an empty commit is made even when nothing is removed (see ``_remove_events``). With
    ``forget`` the events are recorded as forgotten first: no append logs them again (an
    un-apply needs no such record: its files are never read again).

    ``mark`` must flag each event from the event alone (a column test, a join with keys
    decided beforehand): it runs again over the rewritten files only, so a flag that looked
    at a key's other events (a window) would see part of them there."""
    from pyspark.sql import functions as F

    pk = list(primary_key)
    version = log.version
    assert version is not None  # the caller read this snapshot of an existing log
    if not files:
        return _fenced(log, fence, metadata_key)
    file_col = "_cdc_tmp_log_file"
    events = mark(
        log.read(spark, files).withColumn(
            file_col, _table_relative(F.input_file_name(), log.location)
        )
    )
    row = (
        events.filter(col(GONE))
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.collect_set(file_col).alias("files"),
            F.count_distinct(*cols(pk)).alias("keys"),
        )
        .collect()[0]
    )
    removed = int(row["n"])
    if not removed:
        return _fenced(log, fence, metadata_key)
    holding = set(row["files"])
    rewritten = [f for f in files if f.path in holding]
    applied = Table.open(paths.history).watermark(APP_ID)
    # Tied to this commit (``changelog.removal_committed``): if it loses its race, the retry
    # decides again and may keep some of these events, which must not stay forgotten.
    removal = uuid.uuid4().hex if forget else None
    if removal is not None:
        changelog.forget(paths.forgotten_events, events.filter(col(GONE)), pk, version, removal)
    # Tied to the version too: a removal that never committed only costs a recomputation.
    record_retracted_keys(paths, events.filter(col(GONE)).select(*cols(pk)), version, applied)
    kept_rows = sum(f.num_records or 0 for f in rewritten) - removed
    kept = mark(log.read(spark, rewritten)).filter(~col(GONE)).drop(GONE)
    try:
        with log.committing() as rewrite:
            rewrite.write(kept.coalesce(delta.file_count_for(kept_rows)))
            rewrite.commit(
                delta.removes_for(rewritten),
                metadata={
                    metadata_key: removed,
                    **({changelog.REMOVAL_KEY: removal} if removal else {}),
                },
                strict=True,
            )
    except CommitFailedError:
        if removal is not None:  # surely not committed
            changelog.unforget(paths.forgotten_events, removal)
        raise
    return removed, int(row["keys"]), len(rewritten)


def _fenced(log: Table, fence: bool, metadata_key: str) -> tuple[int, int, int]:
    """Nothing to remove: commit an empty version if asked to fence off racing appends."""
    if fence:
        with log.committing() as empty:
            empty.commit(metadata={metadata_key: 0}, strict=True)
    return 0, 0, 0


def readmit(
    spark: SparkSession,
    table: TableConfig,
    landing_root: Landing,
    warehouse_root: Where,
    patterns: Sequence[str],
    keyring: Keyring | None = None,
    synced_at: datetime | None = None,
) -> ReadmitResult:
    """Lift the named files' revocation and materialize the hours they are in. An
    operation's source is refused (NotReadmittableError, saying what to run instead).

    Naming a file that is no longer revoked (a re-run after a crash) is not an error: its
    hour is materialized again, which applies whatever is not applied yet.
    """
    paths = TablePaths.of(warehouse_root, table.name)
    revoked = revoked_files.revoked_names(paths.revoked_files)
    try:
        files = match(patterns, revoked, table.name, landing_root)
    except NoMatchingFileError:
        files = match(patterns, _landing_files(landing_root, table.name), table.name, landing_root)
    operations = [f for f in files if not is_landing_file(f, table.name)]
    if operations:
        raise NotReadmittableError(
            "an operation's events are not re-admitted (no landing file holds them, so nothing "
            "would log them again); the revocation stays: "
            + "; ".join(f"{f}: {operation_of(f)}" for f in operations)
        )
    revoked_files.remove(paths.revoked_files, files)
    hours = sorted({h for f in files if (h := hour_of(f)) is not None})
    outcome = (
        materialize(spark, table, landing_root, warehouse_root, hours, keyring, synced_at)
        if hours
        else None
    )
    return ReadmitResult(tuple(files), tuple(hours), outcome)
