"""Parquet landing files: read through the footer, which bounds what a file may expand to.

A plain Parquet file is read in place (seeking to its footer); a compressed or encrypted one
is decoded first. Plain files whose columns Spark reads as their normalized types skip the
Python decode altogether (``landing.native``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_platform.lib.landing.codecs import PARQUET_MAGIC, LandingFileError, too_large
from cdc_platform.lib.landing.formats import Described, FileToRead, LandingFormat, Opener

if TYPE_CHECKING:
    pass

__all__ = ["PARQUET", "check_parquet_size", "parquet_bytes"]


def parquet_bytes(meta: pq.FileMetaData) -> int:
    """The uncompressed size of a Parquet file's row groups, as its footer gives it."""
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def check_parquet_size(meta: pq.FileMetaData, max_bytes: int) -> None:
    """Refuse a Parquet file whose row groups expand past ``max_bytes`` (a Parquet bomb:
    its pages compress as well as any ZSTD stream) before any page is read."""
    if parquet_bytes(meta) > max_bytes:
        raise LandingFileError(too_large(max_bytes))


class Parquet(LandingFormat):
    name = "parquet"
    title = "Parquet"
    suffix = ".parquet"
    summary = "Apache Parquet (any writer; the schema is the file's own)"
    reads_in_place = True

    def looks_like(self, head: bytes) -> bool:
        return head[:4] == PARQUET_MAGIC

    def read(self, source: BinaryIO, file: FileToRead) -> pa.Table:
        """The file's rows, once its footer says they fit in ``max_file_bytes``."""
        pf = pq.ParquetFile(source)
        check_parquet_size(pf.metadata, file.table.max_file_bytes)
        return pf.read(columns=list(file.columns) if file.columns else None)

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
