"""One history table as a run or an operator job sees it: its config, its Delta tables (the
history table, the change log, the side tables and ledgers beside them) and its Spark session,
opened once and handed down to every stage (docs/HISTORY_MODE.md, guarantees).

Every change an operator makes goes through one protocol, ``HistoryTable.change``: bring the
history table up to date with its change log, decide on that change-log version, commit fenced
on it (a commit another writer beat is decided again from a fresh read), then merge what the
change logged or removed. The merge itself is ``merge_pending``: no stage calls the merge but
through the handle.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from deltalake.exceptions import CommitFailedError

from cdc_platform.lib.columns import col, cols
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history import changelog
from cdc_platform.lib.history.merge import (
    APP_ID,
    MergeResult,
    Restated,
    apply_pending,
    record_retracted_keys,
    table_relative,
)
from cdc_platform.lib.history.protected_columns import (
    check_hashing_salt,
    check_protected_columns,
)
from cdc_platform.lib.history.reads import Reads
from cdc_platform.lib.history.removal import GONE, fenced, marked_by
from cdc_platform.lib.history.table_key import check_key
from cdc_platform.lib.landing.where.object_store import S3Landing
from cdc_platform.lib.landing.where.zone import LandingZone
from cdc_platform.lib.ledgers import erased_keys, revoked_files
from cdc_platform.lib.spark.session import persisted
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from cdc_platform.lib.landing.decoding.keyring import Keyring
    from cdc_platform.lib.landing.where.zone import Landing

T = TypeVar("T")
_LOG_FILE = "_cdc_tmp_log_file"


@dataclass
class HistoryTable:
    """A table of the config, in its warehouse, with the session that works on it.

    The Delta tables are opened lazily and once (``history``, ``changelog``, ``table``);
    ``refresh`` forgets them after a commit, so the next stage reads the version the table
    then has. ``keyring`` is given only to a run that needs one (decryption keys, the hash
    salt, erased keys): it is a deployment's secret, never a run's config; so are the roots."""

    spark: SparkSession
    config: TableConfig
    warehouse_root: Where
    landing_root: Landing | None = None
    keyring: Keyring | None = None
    _opened: dict[str, Table] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        spark: SparkSession,
        platform: PlatformConfig,
        table: TableConfig | str,
        keyring: Keyring | None = None,
    ) -> HistoryTable:
        """The handle on a table of ``platform`` (by its config or its name)."""
        config = table if isinstance(table, TableConfig) else platform.table(table)
        return cls(spark, config, platform.warehouse_root, platform.landing_root, keyring)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def key(self) -> list[str]:
        return list(self.config.key)

    @property
    def paths(self) -> TablePaths:
        return TablePaths.of(self.warehouse_root, self.config.name)

    @property
    def landing(self) -> Landing:
        """The landing root, for an operation that reads or names landing files."""
        if self.landing_root is None:
            raise ValueError(f"{self.name}: this handle was opened without a landing root")
        return self.landing_root

    @property
    def landing_place(self) -> Where:
        """The landing root as a place (a zone object gives its own), to keep a source
        named by a run apart from it (``lib.storage.roots``)."""
        zone = self.landing
        if isinstance(zone, S3Landing):
            return zone.location
        return zone.root if isinstance(zone, LandingZone) else zone

    def table(self, location: Location) -> Table:
        """The Delta table at ``location`` (one of ``paths``), opened once until ``refresh``."""
        opened = self._opened.get(location.uri)
        return opened if opened is not None else self.fresh(location)

    def fresh(self, location: Location) -> Table:
        """The Delta table at ``location`` as it is now (read again, and kept as opened): for
        a step that decides on the latest version, an attempt after a lost race."""
        opened = self._opened[location.uri] = Table.open(location)
        return opened

    @property
    def history(self) -> Table:
        return self.table(self.paths.history)

    @property
    def changelog(self) -> Table:
        return self.table(self.paths.changelog)

    @property
    def read(self) -> Reads:
        """Point-in-time reads of the history table as the handle opened it
        (``read.as_of(ts)``, ``read.current()``, their Arrow and SQL forms)."""
        return Reads.of(self.history)

    def refresh(self) -> HistoryTable:
        """Forget the opened snapshots: the next read sees the latest versions."""
        self._opened.clear()
        return self

    def check(self, rebuilding: bool = False) -> None:
        """Refuse a config whose key or protected columns are not the table's
        (``table_key``, ``protected_columns``) before anything is written; a job that
        changes them (``rebuilding``) checks what it needs itself."""
        if not rebuilding:
            check_key(self.history, self.config.key)
            check_protected_columns(self.changelog, self.config)

    def check_salts(self, keyring: Keyring | None) -> None:
        """Refuse a keyring whose hash_salt is not the one the table's erased keys or hashed
        columns were recorded under (``pii.check_salt``): what an operator job that reads
        landing files or logs events checks before it does."""
        salt = keyring.hash_salt if keyring is not None else None
        if salt is not None:
            erased_keys.check_ledger_salt(self.paths.erased_keys, salt)
        check_hashing_salt(self.changelog, self.config, keyring)

    def revoked(self) -> set[str]:
        """The landing files un-applied so far: asked again before every commit."""
        return revoked_files.revoked_names(self.paths.revoked_files)

    def erased(self) -> Callable[[], erased_keys.ErasedKeys | None]:
        """The keys erased so far (by salted hash), asked again before every commit."""
        return erased_keys.loader(self.paths.erased_keys, self.keyring)

    def merge_pending(self, synced_at: datetime, list_keys: bool = False) -> MergeResult:
        """Merge what the change log holds and the history table does not yet reflect (the
        merge, ``lib.history.merge``); ``list_keys`` names the keys in the commit for the
        checks that follow (never an encrypted table's: its keys are decrypted data)."""
        result = apply_pending(self, synced_at, list_keys)
        self.refresh()
        return result

    def change(
        self, at: datetime, decide: Callable[[Change], T], what: str, catch_up: bool = True
    ) -> tuple[T, MergeResult]:
        """The one protocol of an operator's change (see the module docstring): ``decide`` is
        called with the change-log version the history table has caught up with (``catch_up``;
        without it, the latest one) and commits through the ``Change`` it is given, each
        commit fenced on that version. When another writer got in first the attempt is
        decided again from a fresh read; then the merge runs at ``at``."""

        caught_up: list[Restated | None] = []  # what catching up restated: reported too

        def attempt() -> T:
            log = self._caught_up(at, caught_up) if catch_up else self._latest_log()
            return decide(Change(self, log, at))

        value, _ = delta.with_commit_retries(attempt, f"{what} of {self.paths.history}")
        merged = self.merge_pending(at)
        return value, replace(merged, restated=Restated.union(*caught_up, merged.restated))

    def _latest_log(self) -> Table | None:
        log = self.refresh().changelog
        return log if log.exists else None

    def _caught_up(self, at: datetime, restated: list[Restated | None]) -> Table | None:
        """The change log as the history table now reflects it, after merging what was
        pending (None: no change log yet; the merge's restated span added to ``restated``).
        ``CommitFailedError`` when events were logged during the catch-up: the retry catches
        up and decides again."""
        restated.append(self.merge_pending(at).restated)
        log = self.changelog
        if not log.exists:
            return None
        if changelog.files_since(log, self.history.watermark(APP_ID)):
            raise CommitFailedError(f"{log}: events were logged during the catch-up")
        return log


@dataclass
class Change:
    """One attempt of a change to the change log, decided on ``log`` (None: there is none
    yet): every commit it makes lands on exactly the version after the one it decided on, or
    fails and the attempt is decided again (``changelog.Fence``)."""

    table: HistoryTable
    log: Table | None
    at: datetime  # the operation's time: when its events are logged
    version: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.version = self.log.version if self.log is not None else None

    @property
    def spark(self) -> SparkSession:
        return self.table.spark

    def append(
        self,
        events: DataFrame,
        seq_range: tuple[int, int],
        expected_rows: int,
        properties: dict[str, str] | None = None,
    ) -> int:
        """Log ``events`` (those of no revoked file nor erased key), fenced on the version
        decided on; the number of events new to the log."""
        t = self.table
        appended = changelog.append(
            t.spark,
            t.paths.changelog,
            changelog.Batch(events, t.key, seq_range, expected_rows, self.at),
            changelog.Guards(
                revoked=t.revoked, erased=t.erased(), fence=changelog.Fence(self.version)
            ),
            properties,
        )
        self.version = appended.version
        return appended.new_events

    def remove(
        self,
        mark: Callable[[DataFrame], DataFrame],
        metadata_key: str,
        files: Sequence[delta.DataFile] | None = None,
        fence: bool = False,
        forget: bool = False,
    ) -> Removal:
        """Take the events ``mark`` flags (its boolean column ``GONE``) out of the decided
        change log's ``files`` (default: all): record their keys as retracted, then rewrite
        the files holding them in one commit strictly after the version decided on. With
        ``fence`` an empty commit is made even when nothing is removed: an append that read
        the revoked list before a revocation then loses its strict commit and reads it again.
        With ``forget`` the events are recorded as forgotten first: no append logs them
        again (an un-apply needs no such record: its files are never read again).

        ``mark`` must flag each event from the event alone (a column test, a join with keys
        decided beforehand): it runs again over the rewritten files only, so a flag that
        looked at a key's other events (a window) would see part of them there."""
        log = self.log
        if log is None:
            return Removal(0, 0, 0)
        files = log.files if files is None else files
        flagged = _flagged(self.spark, log, files, mark, self.table.key)
        if flagged is None:
            fenced(log, fence, metadata_key)
        else:
            self._rewrite(log, files, mark, metadata_key, flagged, forget)
        if flagged is not None or fence:
            assert self.version is not None
            self.version += 1
        return flagged.removal if flagged is not None else Removal(0, 0, 0)

    def _rewrite(
        self,
        log: Table,
        files: Sequence[delta.DataFile],
        mark: Callable[[DataFrame], DataFrame],
        metadata_key: str,
        flagged: _Flagged,
        forget: bool,
    ) -> None:
        """Record, then rewrite the files holding flagged events without them (strict)."""
        t, version = self.table, log.version
        assert version is not None  # the caller read this snapshot of an existing log
        gone = flagged.events.filter(col(GONE))
        # Tied to this commit (``changelog.removal_committed``): if it loses its race, the
        # retry decides again and may keep some of these events, which must not stay forgotten.
        removal = uuid.uuid4().hex if forget else None
        if removal is not None:
            changelog.forget(t.paths.forgotten_events, gone, t.key, version, removal)
        # Tied to the version too: a removal that never committed only costs a recomputation.
        applied = t.fresh(t.paths.history).watermark(APP_ID)
        retracted = t.fresh(t.paths.retracted_keys)
        record_retracted_keys(retracted, gone.select(*cols(t.key)), version, applied)
        rewritten = [f for f in files if f.path in flagged.holding]
        kept_rows = sum(f.num_records or 0 for f in rewritten) - flagged.removal.events
        kept = mark(log.read(self.spark, rewritten)).filter(~col(GONE)).drop(GONE)
        info = {metadata_key: flagged.removal.events}
        try:
            with log.committing() as rewrite:
                rewrite.write(kept.coalesce(delta.file_count_for(kept_rows)))
                if removal is not None:
                    info[changelog.REMOVAL_KEY] = removal  # type: ignore[assignment]
                rewrite.commit(delta.removes_for(rewritten), metadata=info, strict=True)
        except CommitFailedError:
            if removal is not None:  # surely not committed
                changelog.unforget(t.paths.forgotten_events, removal)
            raise

    def remove_keys(self, keys: DataFrame, metadata_key: str) -> Removal:
        """Take every event of ``keys`` (decided beforehand: the mark runs again over the
        rewritten files only) out of the change log, and forget them: no append logs them
        again (a hard truncate, a re-sync replacing a key's past)."""
        from pyspark.sql import functions as F

        gone = keys.select(*cols(self.table.key)).distinct().withColumn(GONE, F.lit(True))
        with persisted(gone) as kept:
            if kept.isEmpty():
                return Removal(0, 0, 0)
            return self.remove(marked_by(kept, self.table.key), metadata_key, forget=True)


@dataclass(frozen=True)
class _Flagged:
    """The events a removal flags, read once with the change-log file each is in."""

    events: DataFrame
    holding: set[str]  # the change-log files holding a flagged event
    removal: Removal


def _flagged(
    spark: SparkSession,
    log: Table,
    files: Sequence[delta.DataFile],
    mark: Callable[[DataFrame], DataFrame],
    pk: list[str],
) -> _Flagged | None:
    """The events of ``files`` ``mark`` flags, counted in one Spark job (None: none is)."""
    from pyspark.sql import functions as F

    if not files:
        return None
    events = mark(
        log.read(spark, files).withColumn(
            _LOG_FILE, table_relative(F.input_file_name(), log.location)
        )
    )
    row = (
        events.filter(col(GONE))
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.collect_set(_LOG_FILE).alias("files"),
            F.count_distinct(*cols(pk)).alias("keys"),
        )
        .collect()[0]
    )
    removed = int(row["n"])
    if not removed:
        return None
    holding = set(row["files"])
    rewritten = sum(1 for f in files if f.path in holding)
    return _Flagged(events, holding, Removal(removed, int(row["keys"]), rewritten))


@dataclass(frozen=True)
class Removal:
    """What a ``Change.remove`` took out of the change log."""

    events: int
    keys: int
    files_rewritten: int
