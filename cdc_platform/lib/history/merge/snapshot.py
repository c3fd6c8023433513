"""What one merge attempt reads and hands to every stage: each table opened once
(``Snapshot``), the attempt's fixed facts (``Attempt``) and its result (``MergeResult``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGED,
    CURRENT,
    END,
    HISTORY_COLUMNS_PROPERTY,
    LAST_EVENT_AT,
    START,
    STATE_COLUMNS,
    SYNCED,
    HistoryColumns,
    from_unix_micros,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import joins, table_key
from cdc_platform.lib.history.merge.columns import APP_ID, FAULT_ENV, FILE
from cdc_platform.lib.history.table_key import PRIMARY_KEY_PROPERTY
from cdc_platform.lib.spark.session import persisted
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


class Opener(Protocol):
    """What a merge works on: the run's handle (``HistoryTable``): its session, its tables'
    places and config, and where each attempt opens its tables as they are now (``fresh``),
    the handle then handing the same snapshots to the stages after it."""

    @property
    def spark(self) -> SparkSession: ...

    @property
    def paths(self) -> TablePaths: ...

    @property
    def config(self) -> TableConfig: ...

    def fresh(self, location: Location) -> Table: ...

    def table(self, location: Location) -> Table: ...


class HistoryColumnsError(Refusal):
    """The table's selective-history setting names a column the table does not have."""


# The metadata keys of a restated span, as every run records them and the restatements sensor
# reads them: from, to, closed.
RESTATED_KEYS = ("restated_from", "restated_to", "restated_closed")


@dataclass(frozen=True)
class Restated:
    """The valid time a merge restated (docs/history-table.md, "What a run restated"): every
    instant at which some key's row image, as a read ``as_of`` it would return it, is not what
    it was before; ``closed``: a version that had already ended was rewritten or removed (late
    data changed the past, not only the live version). ``end`` is TMAX when a live version
    changed."""

    start: datetime
    end: datetime
    closed: bool

    @classmethod
    def of(cls, got: Mapping[str, Any], prefix: str) -> Restated | None:
        """From the aggregates of ``fold._span`` (micros since the epoch; absent: none)."""
        start, end = got.get(f"{prefix}restated_from"), got.get(f"{prefix}restated_to")
        if start is None or end is None:
            return None
        closed = bool(got.get(f"{prefix}restated_closed"))
        return cls(from_unix_micros(start), from_unix_micros(end), closed)

    @staticmethod
    def union(*spans: Restated | None) -> Restated | None:
        """The span covering every one given (None when none is)."""
        known = [s for s in spans if s is not None]
        if not known:
            return None
        return Restated(
            min(s.start for s in known), max(s.end for s in known), any(s.closed for s in known)
        )

    def metadata(self) -> dict[str, Any]:
        values = (self.start.isoformat(), self.end.isoformat(), self.closed)
        return dict(zip(RESTATED_KEYS, values, strict=True))


@dataclass(frozen=True)
class MergeResult:
    keys_affected: int = 0
    fast_keys: int = 0
    slow_keys: int = 0
    versions_opened: int = 0
    versions_closed: int = 0
    rows_written: int = 0
    files_removed: int = 0
    files_added: int = 0
    bytes_removed: int = 0
    bytes_added: int = 0
    changelog_bytes_read: int = 0
    history_bytes_read: int = 0
    history_version: int | None = None
    changelog_version: int | None = None
    attempts: int = 0
    restated: Restated | None = None  # the valid time whose rows changed (None: none did)

    def metadata(self) -> dict[str, Any]:
        """What an operator job reports of the merge that followed its change."""
        return {
            **self.restated_metadata(),
            "keys_affected": self.keys_affected,
            "versions_opened": self.versions_opened,
            "versions_closed": self.versions_closed,
            "files_removed": self.files_removed,
            "files_added": self.files_added,
            "delta_version": self.history_version,
        }

    def restated_metadata(self) -> dict[str, Any]:
        """``Restated.metadata``, with nulls when the merge changed no row image."""
        if self.restated is None:
            return dict(zip(RESTATED_KEYS, (None, None, False), strict=True))
        return self.restated.metadata()


def fault_point(name: str) -> None:
    """Crash the process here when ``CDC_PLATFORM_FAULT`` names this point (crash-safety tests)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), 9)


def history_schema(primary_key: Sequence[str], key_and_data: pa.Schema) -> pa.Schema:
    ts = pa.timestamp("us", tz="UTC")
    keys = [key_and_data.field(k) for k in primary_key]
    data = [f for f in key_and_data if f.name not in primary_key]
    system = [
        pa.field(START, ts),
        pa.field(END, ts),
        pa.field(ACTIVE, pa.bool_()),
        pa.field(SYNCED, ts),
        pa.field(CURRENT, pa.bool_()),
        pa.field(LAST_EVENT_AT, ts),
        pa.field(CHANGED, pa.list_(pa.string())),
    ]
    return pa.schema([f.with_nullable(True) for f in (*keys, *data, *system)])


def history_properties(
    primary_key: Sequence[str], history_columns: HistoryColumns
) -> dict[str, str]:
    """The table properties a history table records: the settings its versions follow (its key,
    ``table_key``; its selective-history setting). Set at creation, and on a table from before
    by ``record_settings``."""
    return {
        PRIMARY_KEY_PROPERTY: table_key.to_json(primary_key),
        HISTORY_COLUMNS_PROPERTY: history_columns.to_json(),
    }


def is_closed_file(f: delta.DataFile) -> bool:
    """A file of the closed segment: no row in it is any key's latest version."""
    return f.max_values.get(CURRENT) is False


@dataclass(frozen=True)
class Snapshot:
    """What one attempt saw: each of its four tables opened once, so the whole attempt sees
    one version of each and commits against it."""

    changelog: Table
    history: Table
    delete_only_keys: Table
    retracted_keys: Table
    applied: int | None  # change-log version the history table reflects
    # The history table predates a state column, or follows another history_columns
    # setting: recompute every key.
    rebuild: bool

    @classmethod
    def open(
        cls, tables: Opener, paths: TablePaths, history_columns: HistoryColumns
    ) -> Snapshot | None:
        log = tables.fresh(paths.changelog)
        if not log.exists:
            return None
        history = tables.fresh(paths.history)
        rebuild = history.dt is not None and (
            not set(STATE_COLUMNS) <= set(history.arrow_schema.names)
            or not HistoryColumns.of_table(history.dt).same_as(history_columns)
        )
        applied = None if rebuild else history.watermark(APP_ID)
        side, retracted = tables.fresh(paths.delete_only_keys), tables.fresh(paths.retracted_keys)
        return cls(log, history, side, retracted, applied, rebuild)

    @property
    def delete_only_keys_stale(self) -> bool:
        """The delete-only side table missed the history table's last commit (a crash came
        between the two), or is missing while the history table has applied events."""
        if not self.delete_only_keys.exists:
            return self.applied is not None
        return self.delete_only_keys.watermark(APP_ID) != self.applied


@dataclass(frozen=True)
class Attempt:
    """One attempt's fixed facts, handed to every stage: the snapshot it read, the pending
    change-log files, the history table it writes (created if new) and its files by segment."""

    spark: SparkSession
    paths: TablePaths
    pk: list[str]
    history_columns: HistoryColumns
    snap: Snapshot
    log_version: int  # the change-log version this attempt reads up to
    pending: list[delta.DataFile]
    retracted: DataFrame | None  # keys an un-apply took events from (``pending_retractions``)
    retracted_rows: int | None
    history: Table  # the history table this attempt writes (created if new)
    data_columns: list[str]
    # A run of a few keys: what it reuses is kept as local checkpoints (``_cached``), and it
    # runs ``interpreted``.
    small: bool
    stack: ExitStack  # what the attempt keeps (``keep``) is released when it ends

    @property
    def columns(self) -> list[str]:
        return self.history.arrow_schema.names

    @property
    def files(self) -> list[delta.DataFile]:
        return self.history.files

    @property
    def log(self) -> Table:
        return self.snap.changelog

    @property
    def current_files(self) -> list[delta.DataFile]:
        return [f for f in self.files if not is_closed_file(f)]

    @property
    def closed_files(self) -> list[delta.DataFile]:
        return [f for f in self.files if is_closed_file(f)]

    @property
    def touched_rows(self) -> int | None:
        """A bound on the run's key rows, from Delta statistics and the run's own counts
        (``lib.history.joins``: never Spark's estimate of them)."""
        return joins.add(joins.records(self.pending), self.retracted_rows)

    def keep(self, df: DataFrame) -> DataFrame:
        """``df``, computed once for the Spark jobs of this attempt that reuse it."""
        return self.stack.enter_context(_cached(df, self.small))

    def read_history(
        self, files: Sequence[delta.DataFile], where: Column | None = None
    ) -> DataFrame:
        return _read_history(self.spark, self.history, files, where)


@contextmanager
def _cached(df: DataFrame, small: bool = False) -> Iterator[DataFrame]:
    """Keep a DataFrame that several Spark jobs reuse in memory (spilling) for the block;
    a ``small`` one (a small run's: a few keys' rows) as a local checkpoint."""
    if small:
        # Its plan is cut too: the plans built on it stay small, and Spark's driver analyses
        # and optimizes each DataFrame step (two thirds of a small hour's fold was planning).
        # Computed by the first job that needs it, kept by the executors (MEMORY_AND_DISK)
        # until the driver no longer references it: ``unpersist`` does not apply.
        yield df.localCheckpoint(eager=False)
        return
    with persisted(df) as kept:
        yield kept


def _read_history(
    spark: SparkSession,
    history: Table,
    files: Sequence[delta.DataFile],
    where: Column | None = None,
) -> DataFrame:
    """Rows of ``files`` (those ``where`` keeps, filtered before the file name is computed:
    it is worked out per row) with the (table-relative) file each came from, in ``FILE``."""
    from pyspark.sql import functions as F

    if not files:
        empty = spark.createDataFrame([], history.spark_schema)
        return empty.withColumn(FILE, F.lit(None).cast("string"))
    rows = history.read(spark, files, where=where)
    return rows.withColumn(FILE, table_relative(F.input_file_name(), history.location))


def table_relative(file_url: Column, table: Location) -> Column:
    """The table-relative path (what the Delta log knows) of a file URL as Spark gives it
    (``input_file_name()``: ``file:///wh/t/data/x.parquet``, ``s3a://bucket/wh/t/data/...``)."""
    from pyspark.sql import functions as F

    path = F.url_decode(F.parse_url(file_url, F.lit("PATH")))
    return path.substr(F.lit(len(table.url_path) + 2), F.length(path))  # after "<prefix>/"
