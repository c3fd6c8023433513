"""A ledger: a small Delta table of facts the platform keeps about landing files.

The quarantine (``lib.ledgers.quarantine``), the files each partition was applied from
(``lib.ledgers.applied_files``) and the revoked files (``lib.ledgers.revoked_files``) are each a ledger: a few
rows per file, read whole, changed by one commit that replaces, adds or deletes some rows. A
ledger that was never written reads as empty and is created by its first rows.

A ledger written every hour gains a file an hour: ``compact`` rewrites its small files as few,
sorted by the column its readers filter on, and ``read(where_in=...)`` then opens only the files
(and row groups) whose statistics may hold the values asked for.
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake.transaction import AddAction

from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.table import Table

# A compacted ledger file's rows, and its row groups' (a filtered read skips row groups too).
ROWS_PER_FILE = 100_000
ROW_GROUP_ROWS = 8_192
# delta-rs may cut a long string's statistics: a bound this long is not trusted for pruning.
_STAT_CHARS = 32

WhereIn = tuple[str, Collection[str]]  # (column, values): the rows whose column is one of them


@dataclass(frozen=True)
class Compacted:
    """What ``Ledger.compact`` did: the files before, those it replaced, those it wrote."""

    files: list[delta.DataFile]
    removed: list[delta.DataFile]
    adds: list[AddAction]
    version: int | None


@dataclass(frozen=True)
class Ledger:
    path: Where
    schema: pa.Schema

    def exists(self) -> bool:
        return delta.exists(self.path)

    def read(
        self, columns: Sequence[str] | None = None, where_in: WhereIn | None = None
    ) -> pa.Table:
        """Every row (``columns`` only, if given), or those ``where_in`` selects, reading only
        the files whose statistics may hold them; none when the ledger was never written."""
        wanted = (
            self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns])
        )
        if not self.exists() or (where_in is not None and not where_in[1]):
            return wanted.empty_table()
        if where_in is None:
            return delta.read_arrow(self.path, columns=columns)
        column, values = where_in
        loc = Location.of(self.path)
        dt = delta.open_table(loc)
        if not loc.is_local:  # delta-rs' engine prunes the files by the same statistics
            predicate = delta.in_predicate(column, sorted(values))
            return pa.table(dt.scan(columns=wanted.names, predicate=predicate)).cast(wanted)
        import pyarrow.compute as pc
        import pyarrow.dataset as ds

        files = matching_files(delta.snapshot_files(dt), where_in)
        schema = delta.table_arrow_schema(dt)
        dataset = ds.dataset(delta.absolute_paths(loc, files), schema=schema, format="parquet")
        keep = pc.field(column).isin(sorted(values))
        return dataset.to_table(columns=wanted.names, filter=keep)

    def files_read(self, where_in: WhereIn | None = None) -> list[delta.DataFile]:
        """The files ``read(where_in=...)`` opens (all of them without ``where_in``)."""
        if not self.exists():
            return []
        files = delta.snapshot_files(delta.open_table(self.path))
        return files if where_in is None else matching_files(files, where_in)

    def compact(self, sort_by: Sequence[str], small_rows: int = ROWS_PER_FILE // 2) -> Compacted:
        """Rewrite the ledger's small files (fewer than ``small_rows`` rows; two at least) as
        files of ``ROWS_PER_FILE`` rows sorted by ``sort_by``, in one strict commit marked
        ``dataChange=false``: no row changes, and a filtered read skips by the new files'
        statistics. A writer committing meanwhile makes it fail, writing nothing."""
        table = Table.open(self.path)
        files = table.files
        chosen = [f for f in files if (f.num_records or 0) < small_rows]
        if len(chosen) < 2:
            return Compacted(files, [], [], table.version)
        rows = pa.concat_tables(self._file_rows(f.path) for f in chosen)
        rows = rows.sort_by([(c, "ascending") for c in sort_by])
        with table.committing() as rewrite:
            rewrite.adds += self._write_files(rows)
            removes = delta.removes_for(chosen, data_change=False)
            metadata = {"cdc_platform.operation": "compact"}
            version = rewrite.commit(removes, metadata=metadata, strict=True)
        return Compacted(files, chosen, rewrite.adds, version)

    def _file_rows(self, relative: str) -> pa.Table:
        """One data file's rows as the ledger's schema (a column added since reads as null),
        read whole into memory first: no Python file handler in Arrow's threads."""
        fs = Location.of(self.path).filesystem()
        with fs.open_input_file(delta.relative_file(self.path, relative)) as fh:
            data = pq.read_table(pa.BufferReader(fh.read()))
        columns = [
            data[f.name].cast(f.type)
            if f.name in data.column_names
            else pa.nulls(len(data), f.type)
            for f in self.schema
        ]
        return pa.Table.from_arrays(columns, schema=self.schema)

    def _write_files(self, rows: pa.Table) -> list[AddAction]:
        """``rows`` as Parquet files of ``ROWS_PER_FILE`` rows in a ``data/<uuid>/`` folder of
        their own (``delta.write_files``' layout), with their add actions."""
        loc = Location.of(self.path)
        fs, folder = loc.filesystem(), f"{delta.DATA_DIR}/{uuid.uuid4().hex}"
        fs.create_dir(folder)
        for i, start in enumerate(range(0, rows.num_rows, ROWS_PER_FILE)):
            chunk = rows.slice(start, ROWS_PER_FILE)
            with fs.open_output_stream(f"{folder}/part-{i:05d}.snappy.parquet") as out:
                pq.write_table(chunk, out, row_group_size=ROW_GROUP_ROWS, compression="snappy")
        return delta.adds_for_written(loc, folder, data_change=False)

    def rows(self) -> list[dict[str, Any]]:
        return self.read().to_pylist()

    def append(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Add ``rows`` in one commit (creating the ledger if need be)."""
        if rows:
            self._write(rows, mode="append")

    def replace(self, rows: Sequence[Mapping[str, Any]], where: str | None) -> None:
        """Put ``rows`` in place of the rows matching ``where`` (a delta-rs predicate, say
        ``delta.in_predicate``), in one commit. A ledger never written is created with
        ``rows``; ``where`` None replaces nothing in an existing one."""
        if not self.exists():
            self.append(rows)
        elif where is not None:
            self._write(rows, mode="overwrite", predicate=where)

    def delete(self, where: str) -> None:
        """Delete the rows matching ``where``, in one commit."""
        delta.open_table(self.path).delete(where)

    def _write(self, rows: Sequence[Mapping[str, Any]], **options: Any) -> None:
        from deltalake import write_deltalake

        loc = Location.of(self.path)
        if loc.is_local:
            loc.path.mkdir(parents=True, exist_ok=True)
        data = pa.Table.from_pylist(list(rows), schema=self.schema)
        # A column added to a ledger's schema (the applied files' ``etag``) is added to a
        # ledger written before it, its earlier rows null; the protocol stays reader 1 / writer 2.
        write_deltalake(
            loc.uri, data, storage_options=loc.storage_options, schema_mode="merge", **options
        )


def matching_files(files: Sequence[delta.DataFile], where_in: WhereIn) -> list[delta.DataFile]:
    """The ``files`` whose statistics of the column may hold one of the values: a file with no
    usable bounds (none recorded, not text, or long enough to have been cut) is kept."""
    column, values = where_in
    wanted = sorted(values)
    kept = []
    for f in files:
        lo, hi = f.min_values.get(column), f.max_values.get(column)
        bounded = isinstance(lo, str) and isinstance(hi, str) and len(hi) < _STAT_CHARS
        first = bisect.bisect_left(wanted, str(lo))  # the least value not below the file's
        if not bounded or (first < len(wanted) and wanted[first] <= str(hi)):
            kept.append(f)
    return kept
