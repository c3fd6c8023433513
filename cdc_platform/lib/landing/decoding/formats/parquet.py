"""Parquet landing files: read batch by batch, bounded by what they decode to.

A plain Parquet file is read in place (seeking to its footer); a compressed or encrypted one
is decoded first. Plain files whose columns Spark reads as their normalized types skip the
Python decode altogether (``landing.reading.native``, which bounds them in Spark the same way).

A footer is the writer's word: a long string dictionary-encoded over a million rows passes a
footer check and decodes to gigabytes. So the rows are read a batch at a time, text kept as
dictionaries while read, and what they decode to (``decoded_bytes``: every value expanded, as
the reader's conversions will expand it) is counted against ``max_file_bytes``; past it the
file is set aside and nothing more is decoded (docs/SECURITY.md, decoded-size bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdc_platform.lib.landing.decoding.codecs import PARQUET_MAGIC, LandingFileError, too_large
from cdc_platform.lib.landing.decoding.formats.base import (
    Described,
    FileToRead,
    LandingFormat,
    Opener,
)

__all__ = ["PARQUET", "check_parquet_size", "decoded_bytes", "parquet_bytes"]

# Rows decoded at a time: small enough that one batch of wide rows stays far below any sane
# ``max_file_bytes``, large enough that Arrow's per-batch overhead does not show.
BATCH_ROWS = 8192


def parquet_bytes(meta: pq.FileMetaData) -> int:
    """The uncompressed size of a Parquet file's row groups, as its footer gives it."""
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def check_parquet_size(meta: pq.FileMetaData, max_bytes: int) -> None:
    """Refuse a Parquet file whose row groups expand past ``max_bytes`` (a Parquet bomb:
    its pages compress as well as any ZSTD stream) before any page is read: by the sizes its
    footer gives, and by its fixed-width values, each leaf's value count times its width
    (Arrow decodes no more values than the footer counts)."""
    if max(parquet_bytes(meta), fixed_width_bytes(meta)) > max_bytes:
        raise LandingFileError(too_large(max_bytes))


# The decoded width of a value of each fixed-width Parquet physical type.
_WIDTHS = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def fixed_width_bytes(meta: pq.FileMetaData) -> int:
    """What the file's fixed-width leaves decode to: values times width (a dictionary-encoded
    ``fixed_size_binary`` of 100 kB values is a few bytes a value on disk)."""
    total = 0
    for c in range(meta.num_columns):
        leaf = meta.schema.column(c)
        width = leaf.length if leaf.physical_type == "FIXED_LEN_BYTE_ARRAY" else None
        width = width or _WIDTHS.get(leaf.physical_type, 0)
        values = sum(meta.row_group(g).column(c).num_values for g in range(meta.num_row_groups))
        total += width * values
    return total


def _text_leaves(meta: pq.FileMetaData, columns: Sequence[str] | None) -> list[str]:
    """The paths of the variable-length leaves (text, binary) of ``columns`` (None: all), at any
    depth: read as dictionaries, a value repeated a million times is held once."""
    schema = meta.schema.to_arrow_schema()
    # A map's keys and values stay as they are: Arrow casts no dictionary inside a map back.
    wanted = [n for n in columns or schema.names if not _has_map(schema.field(n).type)]
    paths = []
    for c in range(meta.num_columns):
        leaf = meta.schema.column(c)
        if leaf.physical_type == "BYTE_ARRAY" and any(
            leaf.path == n or leaf.path.startswith(n + ".") for n in wanted
        ):
            paths.append(leaf.path)
    return paths


def _has_map(t: pa.DataType) -> bool:
    if pa.types.is_map(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_map(f.type) for f in t)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_map(t.value_type)
    return False


def decoded_bytes(batch: pa.RecordBatch) -> int:
    """What ``batch`` takes once every value is expanded: a dictionary counted as the values
    it indexes, not the dictionary it holds, at any depth of lists, maps and structs."""
    return sum(_expanded_bytes(column) for column in batch.columns)


def _expanded_bytes(column: pa.Array) -> int:
    t = column.type
    if pa.types.is_dictionary(t):
        return _expanded_dictionary(column)
    if pa.types.is_map(t):
        return 8 * len(column) + _expanded_bytes(column.keys) + _expanded_bytes(column.items)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return 8 * len(column) + _expanded_bytes(column.flatten())
    if pa.types.is_fixed_size_list(t):
        return _expanded_bytes(column.flatten())
    if pa.types.is_struct(t):
        return len(column) + sum(_expanded_bytes(f) for f in column.flatten())
    return column.nbytes


def _expanded_dictionary(column: pa.Array) -> int:
    values = column.dictionary
    if _is_flat_text(values.type):
        lengths = pc.binary_length(values).cast(pa.int64())  # pyright: ignore[reportAttributeAccessIssue]
        used = pc.sum(pc.take(lengths, column.indices)).as_py() or 0  # pyright: ignore[reportAttributeAccessIssue]
        return used + 8 * len(column)  # each value's offset, as a plain string column has
    per_value = values.nbytes / max(len(values), 1)
    return int(per_value * len(column)) + column.indices.nbytes


def _is_flat_text(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


class Parquet(LandingFormat):
    name = "parquet"
    title = "Parquet"
    suffix = ".parquet"
    summary = "Apache Parquet (any writer; the schema is the file's own)"
    reads_in_place = True

    def looks_like(self, head: bytes) -> bool:
        return head[:4] == PARQUET_MAGIC

    def read(self, source: BinaryIO, file: FileToRead) -> pa.Table:
        """The file's rows, read while what they decode to fits in ``max_file_bytes``; text
        is kept as dictionaries (at any depth) while counted, then given the file's own types."""
        cap = file.table.max_file_bytes
        meta = pq.read_metadata(source)
        check_parquet_size(meta, cap)
        schema = meta.schema.to_arrow_schema()
        if file.columns:
            schema = pa.schema([schema.field(n) for n in file.columns])
        text = _text_leaves(meta, file.columns)
        pf = pq.ParquetFile(source, metadata=meta, read_dictionary=text)
        batches, total = [], 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=file.columns):
            total += decoded_bytes(batch)
            if total > cap:
                raise LandingFileError(too_large(cap))
            batches.append(batch)
        if not batches:
            return schema.empty_table()
        return pa.Table.from_batches(batches).cast(schema)

    def read_schema(self, source: BinaryIO) -> pa.Schema:
        return pq.read_schema(source)

    def describe(self, opener: Opener, compression: str) -> Described:
        if compression != "none":
            return (
                [],
                "columns unknown: ZSTD-compressed Parquet (its footer is at the end of the file)",
            )
        with opener() as fh:
            schema = pq.read_schema(fh)
        return [(f.name, str(f.type)) for f in schema], None


PARQUET = Parquet()
