"""New tables: table folders in the landing zone that the config does not list.

Pure (no Dagster): :func:`unlisted_tables` lists them, :func:`describe` reads what one of its
files says about it (columns, encoding, a primary key guess) and writes a ``tables:`` entry to
paste into the config (:meth:`DiscoveredTable.config_snippet`), and
:func:`with_discovered_tables` gives every unlisted plain-Parquet table a :class:`TableConfig`
from the config's ``discover:`` template.

Only cheap reads: a listing of the landing root, the one prefix listing of an unlisted table's
hour folders (on a bucket, page by page until a landing file shows up, within a budget of
requests: a folder of junk keys costs a bounded number, and the new-tables sensor goes on where
it stopped next tick), and of its first file its first bytes, its Parquet footer or its CSV
header and first rows. Encrypted files are never decrypted (no key is loaded here), and a
ZSTD-compressed Parquet file is not decompressed (its footer is at its end): their columns are
reported as unknown, and the snippet says so.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cache, partial
from pathlib import Path
from typing import BinaryIO

import yaml

from cdc_platform.lib.columns import CDC_COLUMNS, is_reserved
from cdc_platform.lib.config import PARTITION_FORMAT, ConfigError, PlatformConfig, TableConfig
from cdc_platform.lib.landing.decoding.codecs import (
    LandingFileError,
    looks_like_zstd,
    open_decoded_stream,
)
from cdc_platform.lib.landing.decoding.formats import FORMATS, format_of_head, format_of_name
from cdc_platform.lib.landing.decoding.formats.base import Opener
from cdc_platform.lib.landing.where.layout import LandingFile
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import (
    Landing,
    LandingUnavailableError,
    LandingZone,
    ListBudget,
)
from cdc_platform.lib.storage.warehouse import current_table_name

__all__ = [
    "DiscoveredTable",
    "Encoding",
    "describe",
    "first_landing_file",
    "guess_primary_key",
    "sniff_encoding",
    "unlisted_tables",
    "with_discovered_tables",
]

# The names a config table may have (lib.config): letters, digits, '_', not a leading digit or '_'.
_TABLE_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_log = logging.getLogger(__name__)
_PLAIN_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEAD_BYTES = 4096
_ZSTD_SUFFIXES = (".zst", ".zstd")
_AES_SUFFIXES = (".aes", ".enc")
# On a bucket: what looking for unlisted tables may list in one call (a tick of the new-tables
# sensor, a code-location load with ``discover:``), and describing one table.
UNLISTED_LIST_REQUESTS = 100
UNLISTED_LIST_SECONDS = 20.0


def unlisted_budget() -> ListBudget:
    """The listing budget of one search for unlisted tables."""
    return ListBudget(UNLISTED_LIST_REQUESTS, UNLISTED_LIST_SECONDS)


@dataclass(frozen=True)
class Encoding:
    """How a table's files are encoded, as a ``tables:`` entry declares it."""

    format: str = "parquet"  # parquet | csv
    compression: str = "none"  # none | zstd
    encryption: str = "none"  # none | aes-256-cbc
    # What was inferred from the file name rather than its bytes (encrypted files only).
    guessed: tuple[str, ...] = ()

    @property
    def is_plain_parquet(self) -> bool:
        return (self.format, self.compression, self.encryption) == ("parquet", "none", "none")


@dataclass(frozen=True)
class DiscoveredTable:
    """An unlisted table folder and what its first landing file says about the table."""

    name: str
    # (name, type) in file order: Arrow types for Parquet (``int64``, ``timestamp[us, tz=UTC]``),
    # config types for CSV (``long``, ``string``); empty when the file could not be read.
    columns: list[tuple[str, str]]
    primary_key: tuple[str, ...]  # a guess (see ``primary_key_reason``); empty: keyless
    first_hour: datetime  # the first hour folder holding a landing file
    sample_file: str  # that folder's first landing file (absolute path)
    encoding: Encoding = field(default_factory=Encoding)
    primary_key_reason: str = ""
    # Why the columns are unknown, or what else about them is a guess.
    notes: tuple[str, ...] = ()

    @property
    def start(self) -> str:
        """``start`` for the config: the first hour holding a file, ``YYYY-MM-DD-HH:00``."""
        return self.first_hour.strftime(PARTITION_FORMAT)

    @property
    def data_columns(self) -> list[tuple[str, str]]:
        """The columns but the three change columns."""
        return [(c, t) for c, t in self.columns if c not in CDC_COLUMNS]

    def config_snippet(self) -> str:
        """A ``tables:`` entry for this table (indented to paste under ``tables:``)."""
        enc = self.encoding
        lines = [
            f"# new table folder '{self.name}': first file {_quoted(_relative(self.sample_file))}",
            f"- name: {_scalar(self.name)}",
            (
                f"  primary_key: [{', '.join(_scalar(c) for c in self.primary_key)}]"
                if self.primary_key
                else "  keyless: true"
            )
            + f"  # GUESS: {self.primary_key_reason}; check it",
            f'  start: "{self.start}"  # the first hour folder holding a file',
        ]
        if enc.format != "parquet":
            lines.append(f"  format: {enc.format}")
        if enc.compression != "none":
            lines.append(f"  compression: {enc.compression}")
        if enc.encryption != "none":
            lines.append(f"  encryption: {enc.encryption}")
        if enc.guessed:
            lines.append(f"  # GUESS from the file name: {', '.join(enc.guessed)}; check it")
        if enc.format == "csv":
            declared = self.data_columns
            if declared:
                types = ", ".join(f"{_scalar(c)}: {_scalar(t)}" for c, t in declared)
                lines.append(f"  columns: {{{types}}}")
                markers = (
                    "null_string" if not self.primary_key else "null_string / unmodified_string"
                )
                lines += [
                    "  # GUESS: column types from the first rows (binary cells are base64 and look",
                    f"  # like strings); check them, and set {markers} if used",
                ]
            else:
                lines.append("  columns: {}  # REQUIRED for CSV: declare every column's type")
        for note in self.notes:
            lines.append(f"  # {note}")
        return "\n".join("  " + line for line in lines) + "\n"


# -- listing ---------------------------------------------------------------------------------------


def unlisted_tables(
    landing_root: Landing,
    known_names: Iterable[str],
    budget: ListBudget | None = None,
    progress: dict[str, str] | None = None,
) -> list[str]:
    """Table folders under ``landing_root`` that ``known_names`` does not list, sorted.

    A table folder is a folder (not a symlink: the landing zone's links are never followed)
    named as a config table may be named, holding at least one ``year=/month=/day=/hour=``
    folder with a landing file. Hidden (``.``) and ``_`` folders, files and folders with no
    landing file are not. Names compare case-insensitively, as the config's do.

    On a bucket each folder is listed page by page until a landing file shows up, and only
    while ``budget`` lasts: first a page for each folder (a table's first page holds its first
    files), then the folders not decided yet go on, the longest waiting first. ``progress``
    (table -> the key its listing goes on after) holds, afterwards, every folder not decided:
    given back to the next call, those go on from there.
    """
    known = {n.lower() for n in known_names}
    landing = zone_at(landing_root)
    progress = {} if progress is None else progress
    candidates = [
        n for n in landing.table_names() if _TABLE_NAME_RE.match(n) and n.lower() not in known
    ]
    before = {n: k for n, k in progress.items() if n in candidates}
    order = [n for n in candidates if n not in before] + list(before)
    found: list[str] = []
    undecided: dict[str, str] = {}
    for name in order:  # a page each
        if budget is not None and not budget.take():
            undecided[name] = before.get(name, "")
            continue
        _look(landing, name, ListBudget(1), before.get(name, ""), found, undecided)
    waited = dict(undecided)
    undecided.clear()
    for name, after in waited.items():  # then on, the longest waiting first
        if budget is not None and budget.spent:
            undecided[name] = after
            continue
        _look(landing, name, budget, after, found, undecided)
    # Those that went on this time wait the longest next time.
    stalled = {n: k for n, k in undecided.items() if k == waited.get(n)}
    progress.clear()
    progress.update(stalled)
    progress.update({n: k for n, k in undecided.items() if n not in stalled})
    return sorted(found)


def _look(
    landing: LandingZone,
    name: str,
    budget: ListBudget | None,
    after: str,
    found: list[str],
    undecided: dict[str, str],
) -> None:
    """List ``name`` from ``after`` within ``budget``: found, undecided, or neither."""
    try:
        page, after_now = _first_page(landing, name, budget, after)
    except OSError:  # unreadable (permissions): not a table folder this platform can read
        return
    if page is not None:
        found.append(name)
    elif after_now is not None:
        undecided[name] = after_now


def _first_page(
    landing: LandingZone, table: str, budget: ListBudget | None, after: str = ""
) -> tuple[dict[datetime, list[LandingFile]] | None, str | None]:
    """(the hours of the first listing page holding a landing file, or None; where the
    listing goes on when ``budget`` ran out first): the table's one prefix listing, a page at a
    time from ``after`` (a folder walk, whole, off a bucket)."""
    while budget is None or budget.take():
        part = landing.hour_files(table, after, ListBudget(1))
        if any(_readable(f) for files in part.files.values() for f in files):
            return part.files, None
        if part.resume_after is None:
            return None, None
        after = part.resume_after
    return None, after


def _readable(f: LandingFile) -> bool:
    """A file to describe: not set aside, and no control character in its name (it would go
    into the snippet, the log and the alert)."""
    return f.set_aside is None and os.path.basename(f.path).isprintable()


def first_landing_file(landing_root: Landing, table: str) -> tuple[datetime, str] | None:
    """(hour, absolute path) of the first landing file of the table's earliest hour with one."""
    first = _first_file(landing_root, table)
    return (first[0], first[1].path) if first is not None else None


def _first_file(landing_root: Landing, table: str) -> tuple[datetime, LandingFile, int] | None:
    """(hour, listing, files skipped) of the first landing file of the earliest hour with one:
    on a bucket, of the first listing page holding one, within ``unlisted_budget`` (key order
    is time order, but for unpadded folders). A file whose name has a control character (a
    newline, say) is skipped and counted: its name would go into the snippet, the log and the
    alert."""
    skipped = 0
    page, _ = _first_page(zone_at(landing_root), table, unlisted_budget())
    for hour, files in sorted((page or {}).items()):
        readable = [f for f in files if f.set_aside is None]
        named = [f for f in readable if _readable(f)]
        skipped += len(readable) - len(named)
        if named:
            return hour, named[0], skipped
    return None


# -- describing ------------------------------------------------------------------------------------


def sniff_encoding(path: str | Path, opener: Opener | None = None) -> Encoding:
    """The encoding of one landing file, from its first bytes (and, if encrypted, its name).

    Parquet starts ``PAR1``, a ZSTD frame with its magic number, CSV is UTF-8 text; anything
    else is taken as AES-256-CBC ciphertext, whose compression and format only the file name
    can tell (``part-1.csv.zst.aes``, as Fivetran names its batch files). ``opener`` opens the
    file (``describe``'s: checked against the listing, no symlink followed).
    """
    with _open(path, opener) as fh:
        head = fh.read(_HEAD_BYTES)
    default = next(iter(FORMATS))
    if not head:  # empty: reading it says what is wrong
        return Encoding(default)
    if looks_like_zstd(head):
        try:
            with open_decoded_stream(_open(path, opener), "zstd", "none", []) as stream:
                plain = stream.read(_HEAD_BYTES)
        except LandingFileError:  # a corrupt frame: only the name can tell the format
            fmt = format_of_name(path).name
            return Encoding(fmt, "zstd", guessed=(f"format {fmt} (the ZSTD data did not decode)",))
        known = format_of_head(plain, path)
        if known is None:  # neither Parquet nor UTF-8 text (Latin-1, a NUL): the name, else CSV
            fmt = format_of_name(path, default="csv").name
            return Encoding(fmt, "zstd", guessed=(f"format {fmt} (the ZSTD data is not UTF-8)",))
        return Encoding(known.name, "zstd")
    known = format_of_head(head, path)
    if known is not None:
        return Encoding(known.name)
    suffixes = _suffixes(path)
    fmt = format_of_name(path).name
    compression = "zstd" if any(s in suffixes for s in _ZSTD_SUFFIXES) else "none"
    guessed = [f"format {fmt}", f"compression {compression}"]
    if not any(s in suffixes for s in _AES_SUFFIXES):
        guessed.append("encryption (neither Parquet, ZSTD nor text)")
    return Encoding(fmt, compression, "aes-256-cbc", tuple(guessed))


def _suffixes(path: str | Path) -> list[str]:
    return [s.lower() for s in Path(path).suffixes]


def describe(landing_root: Landing, name: str) -> DiscoveredTable:
    """What the table's first landing file says: encoding, columns, a primary key guess.

    Raises FileNotFoundError when the table has no landing file (any more). A file that cannot
    be read is described with unknown columns and a note saying why, never an exception.
    """
    landing = zone_at(landing_root)
    first = _first_file(landing, name)
    if first is None:
        raise FileNotFoundError(f"{landing.root}/{name}: no landing file in an hour folder")
    hour, listed, skipped = first
    path = listed.path

    def opener() -> BinaryIO:
        # Through the checked descriptor: a file swapped for a symlink since the listing is
        # refused, never read (its first line would go into the alert).
        return landing.open(path, listed.file_id)

    notes: list[str] = []
    if skipped:
        notes.append(
            f"{skipped} earlier file(s) not read: a control character in the name (rename them)"
        )
    columns: list[tuple[str, str]] = []
    try:
        encoding = sniff_encoding(path, opener)
    except LandingUnavailableError:
        raise  # the store, not the file: described on a later tick
    except Exception as exc:  # unreadable: report it, never fail the sensor
        encoding = Encoding()
        notes.append(f"columns unknown: the file could not be read ({type(exc).__name__})")
    else:
        try:
            columns, note = _read_columns(path, encoding, opener)
        except LandingUnavailableError:
            raise
        except Exception as exc:  # any unreadable file: report it, never fail the sensor
            note = f"columns unknown: the file could not be read ({_one_line(exc)})"
        if note:
            notes.append(note)
    unprintable = [i for i, (c, _) in enumerate(columns) if not c.isprintable()]
    if unprintable:
        notes.append(
            f"column(s) #{', #'.join(str(i + 1) for i in unprintable)} not listed: a control"
            " character in the name (rename them at the source)"
        )
        columns = [c for i, c in enumerate(columns) if i not in unprintable]
    pk, reason = guess_primary_key(name, [c for c, _ in columns])
    return DiscoveredTable(
        name=name,
        columns=columns,
        primary_key=(pk,) if pk else (),
        first_hour=hour,
        sample_file=path,
        encoding=encoding,
        primary_key_reason=reason,
        notes=tuple(notes),
    )


def _read_columns(
    path: str, encoding: Encoding, opener: Opener | None = None
) -> tuple[list[tuple[str, str]], str | None]:
    """(columns, a note on what is unknown or guessed)."""
    if encoding.encryption != "none":
        return [], "columns unknown: the files are encrypted (AES-256-CBC); not decrypted here"
    return FORMATS[encoding.format].describe(partial(_open, path, opener), encoding.compression)


def guess_primary_key(table: str, columns: list[str]) -> tuple[str | None, str]:
    """(column, why): ``id``, ``<table>_id``, ``<singular>_id``; None when the columns are
    known and none is such a key: the table is proposed keyless (HISTORY_MODE section 3)."""
    candidates = [
        c for c in columns if not c.lower().startswith("cdc_") and not is_reserved(c) and c
    ]
    if not columns:
        return "id", "a placeholder, the columns are unknown"
    if not candidates:
        return "id", "a placeholder, the file has no data column"
    by_lower = {c.lower(): c for c in reversed(candidates)}
    for wanted in ("id", f"{table}_id", f"{_singular(table)}_id"):
        if wanted.lower() in by_lower:
            return by_lower[wanted.lower()], f"the column '{by_lower[wanted.lower()]}'"
    return None, "no id column, so keyed by a hash of each row's values"


def _singular(name: str) -> str:
    lower = name.lower()
    if lower.endswith("ies") and len(name) > 3:
        return name[:-3] + "y"
    if lower.endswith(("sses", "xes", "ches", "shes")):
        return name[:-2]
    if lower.endswith("s") and not lower.endswith("ss"):
        return name[:-1]
    return name


# -- the discover: template -------------------------------------------------------------------------


def with_discovered_tables(platform: PlatformConfig) -> PlatformConfig:
    """The config plus, when it has a ``discover:`` template, a table for every unlisted table
    folder whose files are plain Parquet (primary key and start from the template, everything
    else the default).

    A folder whose first file is CSV, compressed or encrypted is not added: the default
    (Parquet) would set every file aside. Nor is one whose name is taken (case-insensitively)
    by a table, or is a name the platform writes (a ``<table>_current``): that one is skipped
    with a warning saying why (``derived_name_reason``), and the config is refused
    (ConfigError naming both) when a table of that name was already discovered and written.
    The ``cdc_new_tables`` sensor reports them all.
    """
    template = platform.discover
    if template is None:
        return platform
    taken = {t.name.lower() for t in platform.tables}
    derived = {current_table_name(t.name).lower(): t for t in platform.tables if t.current_table}
    # A table discovered before keeps its asset while the store does not answer: its change
    # log in the warehouse says it was discovered (a load during an outage drops nothing).
    written = cache(partial(_written_tables, platform))
    undecided: dict[str, str] = {}
    try:
        names = unlisted_tables(
            platform.landing_root, [t.name for t in platform.tables], unlisted_budget(), undecided
        )
    except LandingUnavailableError as exc:  # the bucket does not answer now
        _log.warning(f"discover: the landing zone cannot be listed ({exc})")
        names = sorted(written())
    if undecided:  # past the listing budget: kept if discovered before, else on a later load
        kept = sorted(n for n in undecided if n in written())
        _log.warning(
            f"discover: {len(undecided)} folder(s) not looked at in full within the listing "
            f"budget ({UNLISTED_LIST_REQUESTS} requests); kept as discovered before: {kept}"
        )
        names = sorted({*names, *kept})
    added: list[TableConfig] = []
    for name in names:
        if name.lower() in taken:
            continue
        owner = derived.get(name.lower())
        if owner is not None:
            _refuse_if_written(platform, name, owner)
            _log.warning(derived_name_reason(name, owner))
            continue
        if name not in undecided and not _plain_parquet(platform, name, written):
            continue
        taken.add(name.lower())
        added.append(
            TableConfig(
                name=name,
                primary_key=template.primary_key,
                keyless=template.keyless,
                start=template.start,
                expected_delivery_hours=template.expected_delivery_hours,
            )
        )
    if not added:
        return platform
    return replace(platform, tables=(*platform.tables, *added))


def _plain_parquet(platform: PlatformConfig, name: str, written: Callable[[], set[str]]) -> bool:
    """Whether the table's first landing file is plain Parquet (the template's format); when
    the store does not answer, whether the table was discovered and written before."""
    landing = zone_at(platform.landing_root)
    try:
        first = _first_file(landing, name)
        return first is not None and (
            sniff_encoding(
                first[1].path, partial(landing.open, first[1].path, first[1].file_id)
            ).is_plain_parquet
        )
    except (OSError, LandingFileError):  # unreadable or changing now: not added yet
        return False
    except LandingUnavailableError as exc:
        kept = name in written()
        _log.warning(f"discover: {name!r} cannot be looked at now ({exc}); kept: {kept}")
        return kept


def _written_tables(platform: PlatformConfig) -> set[str]:
    """The tables with a change log in the warehouse (``_cdc/<table>/changelog``)."""
    from pyarrow import fs as pafs

    from cdc_platform.lib.storage import delta
    from cdc_platform.lib.storage.stores import Location
    from cdc_platform.lib.storage.warehouse import TablePaths

    try:
        system = Location.of(platform.warehouse_root) / "_cdc"
        infos = system.filesystem().get_file_info(pafs.FileSelector("", allow_not_found=True))
    except OSError:
        return set()
    names = {i.base_name for i in infos if i.type == pafs.FileType.Directory}
    return {n for n in names if delta.exists(TablePaths.of(platform.warehouse_root, n).changelog)}


def derived_name_reason(folder: str, owner: TableConfig) -> str:
    """Why a landing folder is not discovered: the platform writes a table of that name."""
    return (
        f"landing folder {folder!r} is not discovered: table {owner.name!r} has "
        f"current_table: true, and its current table is {current_table_name(owner.name)!r} "
        "(a discovered table of that name would share its warehouse folder); rename the folder "
        "or list it under another name"
    )


def _refuse_if_written(platform: PlatformConfig, folder: str, owner: TableConfig) -> None:
    """A table of that name was already discovered and written (its change log is in the
    warehouse): refuse the config, since the current table would overwrite that history."""
    from cdc_platform.lib.storage import delta
    from cdc_platform.lib.storage.warehouse import TablePaths

    written = TablePaths.of(platform.warehouse_root, folder)
    if delta.exists(written.changelog):
        raise ConfigError(
            f"table {owner.name!r}, field 'current_table': its current table "
            f"{current_table_name(owner.name)!r} is the discovered table {folder!r}, whose "
            f"history is in {written.history}; turn current_table off, or move that table "
            "and its landing folder away first"
        )


# -- formatting ------------------------------------------------------------------------------------


def _scalar(name: str) -> str:
    """A name as a YAML scalar: plain when it reads back as itself, else JSON-quoted (valid
    YAML: every control character, line break and non-ASCII character escaped, so a name
    never breaks out of its line of the snippet)."""
    if _PLAIN_NAME_RE.match(name) and yaml.safe_load(name) == name:
        return name
    return _quoted(name)


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)


def _open(path: str | Path, opener: Opener | None) -> BinaryIO:
    return opener() if opener is not None else open(path, "rb")


def _relative(path: str) -> str:
    """``<table>/year=.../hour=HH/<file>``: the last six parts of a landing file's path."""
    return "/".join(Path(path).parts[-6:])


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:199] + "…"
