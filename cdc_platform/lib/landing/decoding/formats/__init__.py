"""Landing formats: one module per format, each knowing how to recognise, read and describe
its files. What a landing file must hold is the format's business only up to Arrow: from
there on (validation, conversion, the change log) every format is read the same way.

Adding a format is one module here with a :class:`LandingFormat`, named in ``FORMATS``, plus
its tests and its line in docs/configuration.md (generated from ``FORMATS``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, ClassVar

if TYPE_CHECKING:
    import pyarrow as pa

    from cdc_platform.lib.config import TableConfig

__all__ = [
    "FORMATS",
    "FileToRead",
    "LandingFormat",
    "format_named",
    "format_of_head",
    "format_of_name",
]

Opener = Callable[[], BinaryIO]
# (column name, config type name) pairs, and a note on what is unknown or guessed.
Described = tuple[list[tuple[str, str]], str | None]


@dataclass(frozen=True)
class FileToRead:
    """One landing file as its format is asked to read it."""

    name: str  # its path, as a reason names it
    table: TableConfig
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
        """The file's rows as Arrow, as written (``reader`` normalizes the types); raises
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


def _formats() -> dict[str, LandingFormat]:
    from cdc_platform.lib.landing.decoding.formats.csv import CSV
    from cdc_platform.lib.landing.decoding.formats.parquet import PARQUET

    return {f.name: f for f in (PARQUET, CSV)}


# Every format, the default (the config's ``format:`` when unset) first.
FORMATS: dict[str, LandingFormat] = _formats()


def format_named(name: str) -> LandingFormat:
    """The format a config names (the config refuses any other name before a run)."""
    return FORMATS[name]


def format_of_head(head: bytes, path: str | Path) -> LandingFormat | None:
    """The format whose start ``head`` is; where several fit (CSV takes any text), the one the
    file's name says, else the first registered."""
    fits = [f for f in FORMATS.values() if f.looks_like(head)]
    named = [f for f in fits if f.suffix in _suffixes(path)]
    return (named or fits or [None])[0]


def format_of_name(path: str | Path, default: str | None = None) -> LandingFormat:
    """The format a file's name says (``part-1.csv.zst.aes``); when it says none, ``default``
    (a format's name), else the first registered."""
    named = [f for f in FORMATS.values() if f.suffix in _suffixes(path)]
    if named:
        return named[0]
    return FORMATS[default] if default else next(iter(FORMATS.values()))


def _suffixes(path: str | Path) -> list[str]:
    return [s.lower() for s in Path(path).suffixes]
