"""One Delta table as a run sees it: where it is and the snapshot read from it, once.

A run opens each table it touches once (``Table.open``) and hands the handle down, so every
stage of the run sees the same version; a commit is made against the snapshot the handle read
(``delta.commit``: strict commits refuse one made meanwhile). There is one way to read a
table's files into Spark (``Table.read``) and one way to write files and commit them
(``Table.committing``): files written for a commit that did not happen are removed, so a
failure leaves nothing half-applied (docs/HISTORY_MODE.md, guarantees).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.schema import NATIVE_READ_OPTIONS, spark_schema, widest
from cdc_platform.lib.storage.stores import Location, Where

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction, RemoveAction
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

# The platform's table properties are short JSON values; anything longer was not written by it.
MAX_PROPERTY_CHARS = 100_000


@dataclass(frozen=True)
class Table:
    """A Delta table's location and, once it exists, its snapshot at ``version``.

    ``dt`` is None before the table's first commit. The handle does not follow later commits:
    ``reopened()`` gives the latest snapshot when a caller needs it. (A commit made through it
    moves ``dt``, and so ``watermark()``, on, as delta-rs does; ``version``, ``files`` and
    ``arrow_schema`` keep describing the snapshot read.)"""

    location: Location
    dt: DeltaTable | None
    version: int | None

    @classmethod
    def open(cls, where: Where, version: int | None = None) -> Table:
        """The latest snapshot (or ``version``'s); checked for features the platform cannot
        keep (``delta.check_features``)."""
        loc = Location.of(where)
        if not delta.exists(loc):
            return cls(loc, None, None)
        dt = delta.open_table(loc, version)
        return cls(loc, dt, dt.version())

    @classmethod
    def of(cls, where: Where, dt: DeltaTable) -> Table:
        """A handle on a snapshot opened elsewhere (a table just created or committed)."""
        return cls(Location.of(where), dt, dt.version())

    def reopened(self) -> Table:
        return Table.open(self.location)

    def at(self, version: int) -> Table:
        """The same table at an earlier ``version``."""
        return Table.open(self.location, version)

    @property
    def exists(self) -> bool:
        return self.dt is not None

    def watermark(self, app_id: str) -> int | None:
        """The version of ``app_id``'s input the table says it contains (a Delta app
        transaction), None if it says nothing or does not exist."""
        return self.dt.transaction_version(app_id) if self.dt is not None else None

    def json_property(self, name: str, max_chars: int = MAX_PROPERTY_CHARS) -> object | None:
        """The table property ``name`` as JSON (None: no table, or no such property). A value
        that is not JSON within ``max_chars`` (or nests too deep) raises ``ValueError``:
        another tool wrote it, and the caller says so rather than guessing."""
        if self.dt is None:
            return None
        text = self.dt.metadata().configuration.get(name)
        if text is None:
            return None
        if len(text) > max_chars:
            raise ValueError(f"{self}: the table property {name} is too long")
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError(f"{self}: the table property {name} is not JSON") from None

    def set_properties(self, properties: Mapping[str, str]) -> None:
        """Set table properties in one strict metadata commit against this snapshot (one made
        meanwhile raises ``CommitFailedError``); the platform's own keys are not Delta's, which
        delta-rs refuses unless told otherwise."""
        from deltalake import CommitProperties

        if self.dt is None:
            raise ValueError(f"{self}: the table does not exist yet")
        self.dt.alter.set_table_properties(
            dict(properties),
            raise_if_not_exists=False,
            commit_properties=CommitProperties(max_commit_retries=0),
        )

    def stored(self, files: Sequence[delta.DataFile] | None = None) -> bool:
        """Whether every one of ``files`` (default: the snapshot's) is still in storage (a
        VACUUM removes the files of older versions)."""
        import pyarrow.fs as pafs

        paths = [f.path for f in (self.files if files is None else files)]
        infos = self.location.filesystem().get_file_info(paths)
        return all(i.type == pafs.FileType.File for i in infos)

    @cached_property
    def files(self) -> list[delta.DataFile]:
        """The snapshot's files with their statistics (none before the first commit)."""
        return delta.snapshot_files(self.dt) if self.dt is not None else []

    @cached_property
    def arrow_schema(self) -> pa.Schema:
        if self.dt is None:
            raise ValueError(f"{self.location}: the table does not exist yet")
        return delta.table_arrow_schema(self.dt)

    @cached_property
    def spark_schema(self) -> StructType:
        return spark_schema(self.arrow_schema)

    def read(
        self,
        spark: SparkSession,
        files: Sequence[delta.DataFile | str] | None = None,
        schema: StructType | None = None,
        options: Mapping[str, str] | None = None,
        where: Column | None = None,
    ) -> DataFrame:
        """The rows of ``files`` (default: the whole snapshot), read with ``schema`` (default:
        the table's), each file by its literal name (``delta.read_files``); no file, no row."""
        schema = schema if schema is not None else self.spark_schema
        files = self.files if files is None else files
        if not files:
            return spark.createDataFrame([], schema)
        reader = spark.read.schema(schema).options(**dict(options or {}))
        rows = delta.read_files(reader, self.location, files)
        return rows.filter(where) if where is not None else rows

    def ensure(
        self, schema: pa.Schema, description: str, properties: Mapping[str, str] | None = None
    ) -> Table:
        """Create the table if it is missing (with ``properties``), add the (nullable) columns
        ``schema`` has and it lacks; the handle as it then is (``self`` when nothing changed)."""
        dt = delta.ensure_table(self.location, schema, description, self.dt, properties)
        return self if dt is self.dt else Table.of(self.location, dt)

    def widened(self, spark: SparkSession, target: pa.Schema) -> Table:
        """The table with the (wider) types ``target`` has for its columns, in one strict
        commit (docs/HISTORY_MODE.md, schema changes: a column only widens, no value is lost).

        Every file is rewritten on its own, its rows cast by Arrow (as new files are when they
        are decoded), so the table keeps its file layout and statistics; the commit replaces
        them all and sets the new schema (an overwrite, which keeps the table's properties and
        app transactions). Columns ``target`` lacks, or has narrower or the same, are left as
        they are. ``self`` when nothing widens.
        """
        current = self.arrow_schema
        wanted = {f.name: f.type for f in target}
        widened = pa.schema(
            [
                f.with_type(wanted[f.name]) if _widens(f.type, wanted.get(f.name)) else f
                for f in current
            ]
        )
        if widened.types == current.types:
            return self
        changes = {
            f.name: f"{f.type} -> {widened.field(f.name).type}"
            for f in current
            if widened.field(f.name).type != f.type
        }
        from pyspark.sql.pandas.types import from_arrow_schema

        as_stored = from_arrow_schema(current)  # each file read as it is, then cast by Arrow
        with self.committing() as rewrite:
            for f in self.files:
                rows = self.read(spark, [f], as_stored, NATIVE_READ_OPTIONS)
                rewrite.write(delta.arrow_cast(rows, widened).coalesce(1))
            rewrite.commit(
                schema=widened,
                metadata={"cdc_platform.widened_columns": changes},
                strict=True,
                overwrite=True,
            )
        return self.reopened()

    @contextmanager
    def committing(self) -> Iterator[Commit]:
        """Write files for one commit; if the block raises, before or during the commit, the
        files it wrote are removed (no reader ever saw them)."""
        pending = Commit(self)
        try:
            yield pending
        except BaseException:
            delta.discard(self.location, pending.adds)
            raise

    def __str__(self) -> str:
        return str(self.location)


@dataclass
class Commit:
    """The files written for one commit of ``table`` (``Table.committing``)."""

    table: Table
    adds: list[AddAction] = field(default_factory=list)

    def write(
        self, df: DataFrame, partition_by: str | None = None, data_change: bool = True
    ) -> list[AddAction]:
        """Have Spark write ``df`` into the table's folder (``delta.write_files``)."""
        written = delta.write_files(df, self.table.location, partition_by, data_change)
        self.adds += written
        return written

    def commit(
        self,
        removes: Sequence[RemoveAction] = (),
        schema: pa.Schema | None = None,
        app_transaction: tuple[str, int] | None = None,
        metadata: Mapping[str, Any] | None = None,
        strict: bool = False,
        overwrite: bool = False,
    ) -> int:
        """Commit what was written and ``removes`` as one version, against the snapshot the
        table handle read (``delta.commit``); returns the new version."""
        if self.table.dt is None:
            raise ValueError(f"{self.table}: create the table (Table.ensure) before committing")
        _ = self.table.files, self.table.arrow_schema  # read before ``dt`` moves on
        return delta.commit(
            self.table.dt,
            self.adds,
            removes,
            schema if schema is not None else self.table.arrow_schema,
            app_transaction=app_transaction,
            metadata=metadata,
            strict=strict,
            overwrite=overwrite,
        )


def _widens(have: pa.DataType, to: pa.DataType | None) -> bool:
    return to is not None and to != have and widest(have, to) == to
