"""What a landing format is: the interface every format module implements, and what a format
is handed to read a file.

A format knows a table's config only by ``TableOptions``, the few keys it reads (the config's
``TableConfig`` is one): the config names the formats (``FORMATS``, to check a ``format:``
value), so a format importing the config would make the two import each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, ClassVar, Protocol

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Described", "FileToRead", "LandingFormat", "Opener", "TableOptions"]

Opener = Callable[[], BinaryIO]
# (column name, config type name) pairs, and a note on what is unknown or guessed.
Described = tuple[list[tuple[str, str]], str | None]


class TableOptions(Protocol):
    """The keys of a table's config a format reads (``TableConfig`` has them all)."""

    @property
    def encryption(self) -> str: ...

    @property
    def columns(self) -> Mapping[str, str]: ...  # CSV: every column's declared type

    @property
    def block_columns(self) -> Sequence[str] | None: ...

    @property
    def null_string(self) -> str | None: ...

    @property
    def unmodified_string(self) -> str | None: ...

    @property
    def max_file_bytes(self) -> int: ...


@dataclass(frozen=True)
class FileToRead:
    """One landing file as its format is asked to read it."""

    name: str  # its path, as a reason names it
    table: TableOptions
    hide_values: bool  # an encrypted table's reasons quote no cell
    columns: Sequence[str] | None = None  # only these, where the format can (a hint)


class LandingFormat(ABC):
    """What the platform needs of a landing file format, as the reader and discovery use it."""

    name: ClassVar[str]  # the config's ``format:`` value
    title: ClassVar[str]  # how a reason names a file of it ("not a readable Parquet file")
    suffix: ClassVar[str]  # the file-name part that says it (``part-1.csv.zst.aes``)
    summary: ClassVar[str]  # one line for docs/configuration.md
    # Read straight from the open landing file, bounded by the format itself (a Parquet footer
    # gives the plaintext size before any page is read); else decoded into memory first,
    # bounded by ``max_file_bytes`` as it is decoded.
    reads_in_place: ClassVar[bool] = False

    @abstractmethod
    def looks_like(self, head: bytes) -> bool:
        """Whether a file's first plaintext bytes start a file of this format (discovery,
        and the decryption's wrong-key check)."""

    @abstractmethod
    def read(self, source: BinaryIO, file: FileToRead) -> pa.Table:
        """The file's rows as Arrow, as written (``reading.file_reader`` normalizes
        the types); raises
        ``LandingFileError`` naming the row and the column, never a cell when ``hide_values``."""

    def read_schema(self, source: BinaryIO) -> pa.Schema | None:
        """The file's columns without its rows, where the format keeps them apart (a Parquet
        footer); None: only reading the rows tells them."""
        return None

    @abstractmethod
    def describe(self, opener: Opener, compression: str) -> Described:
        """The columns (with config type names) a new table's first file shows discovery,
        from a cheap read: its footer or its header and first rows, never the whole file."""

    def config_problem(self, primary_key: Sequence[str], columns: dict[str, str]) -> str | None:
        """What a ``tables:`` entry of this format lacks (None: nothing), for ``columns``."""
        return None
