"""Landing formats: one module per format, each knowing how to recognise, read and describe
its files (the interface they implement: ``base``), and ``FORMATS``, the registry of them all.
What a landing file must hold is the format's business only up to Arrow: from there on
(validation, conversion, the change log) every format is read the same way.

Adding a format is one module here with a ``LandingFormat``, named in ``FORMATS``, plus its
tests and its line in docs/configuration.md (generated from ``FORMATS``).
"""

from __future__ import annotations

from pathlib import Path

from cdc_platform.lib.landing.decoding.formats.base import LandingFormat
from cdc_platform.lib.landing.decoding.formats.csv import CSV
from cdc_platform.lib.landing.decoding.formats.parquet import PARQUET

__all__ = ["FORMATS", "format_named", "format_of_head", "format_of_name"]

# Every format, the default (the config's ``format:`` when unset) first.
FORMATS: dict[str, LandingFormat] = {f.name: f for f in (PARQUET, CSV)}


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
