"""The landing reader: one table's files opened safely, decoded, and checked row by row.

``LandingReader`` is what Spark ships to its tasks: it opens a file only below its root and only
as listed (``safe_open``), decodes it (``codecs``), reads it in its format (``formats``) and
holds its rows to ``rows``' rules. ``FileReport`` is what inspecting one file found.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import (
    CDC_COLUMNS,
    CHANGELOG_SYSTEM_COLUMNS,
    OP,
    ROW_ID,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    TS,
    UNMODIFIED,
    UNMODIFIED_TYPE,
    is_reserved,
)
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.codecs import LandingFileError, decode_file
from cdc_platform.lib.landing.decoding.formats import format_named
from cdc_platform.lib.landing.decoding.formats.base import FileToRead, LandingFormat
from cdc_platform.lib.landing.decoding.keyring import Keyring, KeyringError
from cdc_platform.lib.landing.rows.pii import hash_column, hashed_field, hashed_source
from cdc_platform.lib.landing.rows.row_id import row_ids
from cdc_platform.lib.landing.rows.rules import (
    first_invalid_row,
    has_text,
    is_string_like,
    needs_value_check,
    to_type,
    unmodified_rows,
    validate_rows,
)
from cdc_platform.lib.landing.rows.timestamps import CAST_ERRORS, first_failure, parse_timestamps
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.safe_open import CHANGED, FileId
from cdc_platform.lib.landing.where.zone import Landing, LandingUnavailableError
from cdc_platform.lib.storage.schema import (
    normalize_type,
    unsupported_type,
)

__all__ = [
    "CHANGED_MARKER",
    "FileReport",
    "LandingReader",
    "changed_file_error",
    "changed_files_named",
]


@dataclass(frozen=True)
class FileReport:
    """What inspecting one landing file found: its schema, or why it is set aside."""

    path: str
    num_rows: int
    schema: pa.Schema | None
    error: str | None = None
    error_row: int | None = None
    bad_rows: int = 0
    seq_min: int | None = None
    seq_max: int | None = None
    # Read by Spark's own (vectorized) Parquet reader, not decoded in Python; ``source_uri`` is
    # the file as Spark names it (``_metadata.file_path``), known once its rows were validated.
    native: bool = False
    source_uri: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class LandingReader:
    """Decodes a table's landing files; picklable, so Spark ships it to the tasks.

    Only the table's own keys travel, inside the pickled task closure (over Spark's encrypted
    RPC), never in Spark conf, logs or the UI.
    For an encrypted table no reason ever quotes a cell (or a library message that might):
    reasons name the row and the column only.
    """

    def __init__(
        self, table: TableConfig, landing_root: Landing, keyring: Keyring | None = None
    ) -> None:
        self.table = table
        # Names files (``relative``) and, unless ``source`` says otherwise, opens them.
        self.zone = zone_at(landing_root)
        # Where files are opened: never outside it, never through a symlink, never another
        # file than the one listed (``LandingZone.open``). A snapshot reader's is its folder.
        self.source = self.zone
        self.keyring = (keyring or Keyring.empty()).for_table(table.name)
        # A table with hashed or blocked columns quotes no cell either: a reason could quote one.
        self.hide_values = table.encryption != "none" or table.protects_columns
        # Matched whatever a file's letter case (Delta column names are case-insensitive).
        self.blocked = frozenset(c.lower() for c in table.block_columns or ())
        self.hashed = frozenset(c.lower() for c in table.hash_columns or ())
        self.salt = self.keyring.hash_salt if self.hashed else None
        if self.hashed and self.salt is None:
            raise KeyringError(
                f"table '{table.name}' has hash_columns, but the keyring (CDC_KEYRING) has no "
                "hash_salt: nothing is read without it"
            )
        # The file each path was when listed: a path holding another file since is not read.
        self.expected: dict[str, FileId] = {}

    @property
    def root(self) -> str:
        """The folder (or bucket prefix) files are opened below."""
        return self.source.root

    @property
    def landing_root(self) -> str:
        return self.zone.root

    def expect(self, listed: Mapping[str, FileId]) -> None:
        """Read each of these paths only if it is still the file the listing saw."""
        self.expected.update({self.source.normalized(p): i for p, i in listed.items()})

    def listed(self, path: str) -> FileId | None:
        """The file the listing saw at ``path`` (None: not listed, nothing to compare)."""
        return self.expected.get(self.source.normalized(path))

    def open(self, path: str) -> BinaryIO:
        """``path`` opened through ``LandingZone.open``: below the root, no symlink, the file
        (or object version) listed. Every read of a file's bytes goes through this."""
        return self.source.open(path, self.listed(path))

    def changed_since_listed(self, paths: Sequence[str]) -> set[str]:
        """The paths that are no longer the file the listing saw (gone, a symlink or another
        file now, rewritten in place, or an object overwritten), asked from the driver."""
        return {p for p in paths if self.source.changed_since_listed(p, self.listed(p))}

    @property
    def format(self) -> LandingFormat:
        """The table's landing format (``landing.decoding.formats``): how its files are read."""
        return format_named(self.table.format)

    def __repr__(self) -> str:
        return f"LandingReader({self.table.name!r})"

    # -- decoding ---------------------------------------------------------------------------

    def relative(self, path: str) -> str:
        """A file's name as the change log, the quarantine and the ledgers record it (a name
        that is not UTF-8, only ever set aside, with ``\\x`` escapes)."""
        return self.zone.relative(path)

    def show(self, value: object) -> str:
        """A cell as a reason may quote it: never for an encrypted table."""
        if self.hide_values:
            return "the value"
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."

    def _detail(self, exc: BaseException) -> str:
        return "" if self.hide_values else f": {exc}"

    def load(self, path: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The file's rows as Arrow, types normalized; raises LandingFileError with a reason."""
        t, fmt = self.table, self.format
        file = FileToRead(path, t, self.hide_values, columns)
        listed = self.listed(path)
        try:
            opened = self.open(path)
        except OSError as exc:  # gone since the listing, or unreadable
            raise LandingFileError(f"not a readable {fmt.title} file{self._detail(exc)}") from None
        with opened as fh:
            try:
                if t.is_encoded:  # decoded first, bounded by max_file_bytes as it decodes
                    plain = io.BytesIO(self._decoded(fh, path))
                    self.source.check_unchanged(fh, listed)
                    tbl = fmt.read(plain, file)
                else:  # read in place: the format bounds what it reads (a Parquet footer)
                    tbl = fmt.read(fh, file)
                    self.source.check_unchanged(fh, listed)
            except LandingFileError:
                raise
            except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
                self.source.check_unchanged(fh, listed)  # an object overwritten mid-read
                raise LandingFileError(
                    f"not a readable {fmt.title} file{self._detail(exc)}"
                ) from None
        tbl = tbl.drop_columns([n for n in tbl.column_names if n.lower() in self.blocked])
        self._check_names(tbl.schema)
        self._check_utf8(tbl)
        return self._normalize(tbl)

    def _kept(self, schema: pa.Schema) -> pa.Schema:
        """A file's columns as the table keeps them: blocked ones gone, hashed ones text."""
        return pa.schema(
            [
                self._hashed_as(f, schema) if f.name.lower() in self.hashed else f
                for f in schema
                if f.name.lower() not in self.blocked
            ]
        )

    def _check_utf8(self, tbl: pa.Table) -> None:
        """Every string is valid UTF-8 (Parquet readers take any bytes as text): else the
        first bad row and column, never the value."""
        for i, (name, column) in enumerate(zip(tbl.column_names, tbl.columns, strict=True)):
            if not has_text(column.type):
                continue
            try:
                column.validate(full=True)
            except pa.ArrowInvalid:
                # Arrow validates a nested column's children whole: its row is not known.
                top = is_string_like(column.type)
                row = first_invalid_row(column.combine_chunks()) if top else None
                where = f"row {row + 1}, " if row is not None else ""
                raise LandingFileError(
                    f"{where}column {self.label(name, i)}: text that is not valid UTF-8",
                    row + 1 if row is not None else None,
                ) from None

    def _decoded(self, fh: BinaryIO, path: str) -> bytes:
        """The plaintext of an encoded file (decrypted, decompressed), at most ``max_file_bytes``."""
        t = self.table
        return decode_file(
            fh,
            t.compression,
            t.encryption,
            self.keyring.keys_for(t.name, self.relative(path)) if t.encryption != "none" else [],
            looks_like=self.format.looks_like,
            table=t.name,
            relative_path=self.relative(path),
            max_bytes=t.max_file_bytes,
        )

    def label(self, name: str, position: int) -> str:
        """How a reason names a column of a file: by name (a landing file's own schema)."""
        return f"'{name}'"

    def _check_names(self, schema: pa.Schema) -> None:
        """Column names the table can hold: each once (ignoring case), none reserved or empty."""
        seen: dict[str, tuple[str, int]] = {}
        for i, f in enumerate(schema):
            name = self.label(f.name, i)
            if not f.name:
                raise LandingFileError(f"column #{i + 1} has an empty name")
            other = seen.get(f.name.lower())
            if other is not None and other[0] == f.name:
                raise LandingFileError(f"column {name} appears twice")
            if other is not None:
                raise LandingFileError(
                    f"columns {self.label(*other)} and {name} differ only in case"
                    " (Delta column names are case-insensitive)"
                )
            seen[f.name.lower()] = (f.name, i)
            if f.name == UNMODIFIED:
                if not (pa.types.is_null(f.type) or normalize_type(f.type) == UNMODIFIED_TYPE):
                    raise LandingFileError(
                        f"column '{UNMODIFIED}' has type {f.type}, expected list<string>"
                    )
            elif is_reserved(f.name):
                raise LandingFileError(
                    f"column {name} uses a reserved system prefix (_fivetran_, _cdc_)"
                )
            elif f.name in CDC_COLUMNS and pa.types.is_duration(f.type):
                # A data column's duration becomes microseconds; a seq or time must not.
                raise LandingFileError(
                    f"column {name} has type {f.type}: a change column is never one"
                )
            elif f.name not in CDC_COLUMNS:
                why = unsupported_type(f.type)
                if why is None and f.name in self.table.file_key and pa.types.is_map(f.type):
                    why = "a key column cannot be a map (a key is compared and sorted as it is)"
                if why:
                    raise LandingFileError(f"column {name} has type {f.type}: {why}")

    def _normalize(self, tbl: pa.Table) -> pa.Table:
        cols = []
        for i, (name, column) in enumerate(zip(tbl.column_names, tbl.columns, strict=True)):
            if name == OP:
                convert: Callable[[pa.Array], pa.Array] = lambda a: pc.utf8_upper(  # noqa: E731  # pyright: ignore[reportAttributeAccessIssue]
                    to_type(a, pa.string())
                )
            elif name == TS and is_string_like(column.type):
                convert = parse_timestamps
            elif name == UNMODIFIED and pa.types.is_null(column.type):
                convert = lambda a: pa.nulls(len(a), UNMODIFIED_TYPE)  # noqa: E731
            elif name.lower() in self.hashed:
                assert self.salt is not None  # checked when the reader was made
                target, salt = normalize_type(column.type), self.salt
                convert = lambda a, t=target, s=salt: hash_column(to_type(a, t), s)  # noqa: E731
            else:
                target = normalize_type(column.type)
                convert = lambda a, target=target: to_type(a, target)  # noqa: E731
            cols.append(self._convert(name, column.combine_chunks(), convert, i))
        out = pa.table(cols, names=tbl.column_names)
        if not self.hashed:
            return out
        return out.cast(pa.schema([self._hashed_as(f, tbl.schema) for f in out.schema]))

    def _hashed_as(self, field: pa.Field, source: pa.Schema) -> pa.Field:
        """A hashed column's field, naming the type it was hashed in (``pii.hashed_field``):
        an erasure hashes a cleartext in each type the change log records."""
        if field.name.lower() not in self.hashed or hashed_source(field) is not None:
            return field
        return hashed_field(field.name, normalize_type(source.field(field.name).type))

    def _convert(
        self,
        name: str,
        values: pa.Array,
        convert: Callable[[pa.Array], pa.Array],
        position: int = 0,
    ) -> pa.Array:
        try:
            return convert(values)
        except CAST_ERRORS:
            pass
        row = first_failure(values, convert)
        if name == TS and is_string_like(values.type):
            what = "is not an ISO-8601 timestamp"
        elif pa.types.is_integer(values.type):
            what = "is out of range for a 64-bit integer"
        elif pa.types.is_timestamp(values.type) or pa.types.is_date(values.type):
            what = "is out of range (years 1 to 9999)"
        elif pa.types.is_duration(values.type):
            what = "is out of range (a duration is kept as 64-bit microseconds)"
        else:
            what = f"cannot be read as {normalize_type(values.type)} without losing it"
        label = self.label(name, position)
        if row is None:
            raise LandingFileError(f"column {label}: a value {what}")
        if pa.types.is_duration(values.type):  # as Python it may not fit a timedelta
            shown = f"{self.show(values.cast(pa.int64())[row].as_py())} {values.type.unit}"
        else:
            shown = self.show(values[row].as_py())
        raise LandingFileError(f"row {row + 1}, column {label}: {shown} {what}", row + 1)

    # -- pass 1: inspect ----------------------------------------------------------------------

    def reads_footer_first(self) -> bool:
        """A file read in place (plain Parquet): pass 1 checks its footer's columns before
        reading any row."""
        return not self.table.is_encoded

    def inspect(self, path: str) -> FileReport:
        needed = [*self.table.file_key, *CDC_COLUMNS]
        try:
            if self.reads_footer_first():
                # Blocked columns go; a hashed one keeps its type until its values are checked.
                schema = self._read_schema(path)
                schema = pa.schema(  # a file's own field metadata is not ours to keep
                    [f.remove_metadata() for f in schema if f.name.lower() not in self.blocked]
                )
                self._check_names(schema)
                missing = [c for c in needed if c not in schema.names]
                if missing:
                    return FileReport(path, 0, None, f"missing required column(s) {missing}")
                checked = [
                    f.name
                    for f in schema
                    if f.name in needed or f.name == UNMODIFIED or needs_value_check(f.type)
                ]
                tbl = self.load(path, columns=checked)
            else:
                tbl = self.load(path)
                schema = tbl.schema
            schema = self._kept(pa.schema([f.with_type(normalize_type(f.type)) for f in schema]))
        except LandingFileError as exc:
            return FileReport(path, 0, None, str(exc), getattr(exc, "row", None))
        except LandingUnavailableError:
            raise  # the store, not the file: the run fails and its hour is asked for again
        except Exception as exc:  # a reader bug or an exotic file must still name the file
            return FileReport(
                path,
                0,
                None,
                f"could not read the file: {type(exc).__name__}{self._detail(exc)}",
            )
        error, row, bad = self._bad_rows(tbl)
        if error:
            return FileReport(path, tbl.num_rows, schema, error, row, bad)
        bounds = pc.min_max(tbl[SEQ]).as_py() if tbl.num_rows else {"min": None, "max": None}  # pyright: ignore[reportAttributeAccessIssue]
        return FileReport(
            path,
            tbl.num_rows,
            schema,
            seq_min=bounds["min"],
            seq_max=bounds["max"],
        )

    def _bad_rows(self, tbl: pa.Table) -> tuple[str | None, int | None, int]:
        """``rows.validate_rows``, and for a keyless table ``rows.unmodified_rows`` (pass 1 and
        pass 2 hold a file to the same rules)."""
        error, row, bad = validate_rows(tbl, self.table.file_key, self.show)
        if not error and self.table.keyless:
            return unmodified_rows(tbl)
        return error, row, bad

    def _read_schema(self, path: str) -> pa.Schema:
        """The file's columns without its rows (only for a format that keeps them apart)."""
        fmt = self.format
        try:
            with self.open(path) as fh:
                schema = fmt.read_schema(fh)
        except (pa.ArrowException, OSError) as exc:
            raise LandingFileError(f"not a readable {fmt.title} file{self._detail(exc)}") from None
        assert schema is not None, f"{fmt.name} files are read in place but have no schema"
        return schema

    # -- pass 2: read -------------------------------------------------------------------------

    def read_conformed(
        self, path: str, schema: pa.Schema, inspected: FileReport | None = None
    ) -> Iterator[pa.RecordBatch]:
        """The file's events shaped exactly as ``schema`` (missing columns become nulls).

        With ``inspected`` (pass 1's report), the rows must still be the ones inspected: valid,
        as many, within its seq range; else the file changed between the passes and nothing of
        it is returned (``changed_file_error``), as when it no longer loads at all."""
        try:
            tbl = self.load(path)
        except LandingFileError:
            # Only a file that is no longer the listed one counts as changed (set aside); any
            # other error (EIO, memory) fails the run, whose hour the sensor asks for again.
            if inspected is None or not self.changed_since_listed([path]):
                raise
            raise changed_file_error(self.relative(path)) from None
        if inspected is not None:
            self._check_as_inspected(path, tbl, inspected)
        n = tbl.num_rows
        arrays: list[pa.Array] = []
        for field in schema:
            if field.name == SOURCE_FILE:
                arrays.append(pa.array([self.relative(path)] * n, pa.string()))
            elif field.name == SOURCE_ROW:
                arrays.append(pa.array(range(1, n + 1), pa.int64()))
            elif field.name in tbl.column_names:
                arrays.append(tbl.column(field.name).cast(field.type))  # checked in pass 1
            else:
                arrays.append(pa.nulls(n, field.type))
        if ROW_ID in schema.names:  # a keyless table: the id of each row as the table types it
            data = {
                f.name: a
                for f, a in zip(schema, arrays, strict=True)
                if f.name != ROW_ID and f.name not in CHANGELOG_SYSTEM_COLUMNS
            }
            arrays[schema.get_field_index(ROW_ID)] = row_ids(data, n)
        yield from pa.table(arrays, schema=schema).to_batches(max_chunksize=50_000)

    def _check_as_inspected(self, path: str, tbl: pa.Table, inspected: FileReport) -> None:
        error, _, _ = self._bad_rows(tbl)
        bounds = pc.min_max(tbl[SEQ]).as_py() if tbl.num_rows else {"min": None, "max": None}  # pyright: ignore[reportAttributeAccessIssue]
        same = (tbl.num_rows, bounds["min"], bounds["max"]) == (
            inspected.num_rows,
            inspected.seq_min,
            inspected.seq_max,
        )
        if error or not same:
            raise changed_file_error(self.relative(path))


# A file found changed in pass 2 is named in the error by this marker and its relative path in
# hex (a Spark task's error reaches the driver as text; hex survives any name).
CHANGED_MARKER = "cdc-changed-file:"
_CHANGED_RE = re.compile(re.escape(CHANGED_MARKER) + r"([0-9a-fA-F]+)")


def changed_file_error(relative: str) -> LandingFileError:
    """Pass 2 found a file other than pass 1 inspected (rewritten in place between them)."""
    return LandingFileError(f"{CHANGED} [{CHANGED_MARKER}{relative.encode().hex()}]")


def changed_files_named(exc: BaseException) -> set[str]:
    """The relative paths a failed read named as changed (``changed_file_error``)."""
    names = set()
    for match in _CHANGED_RE.finditer(str(exc)):
        try:
            names.add(bytes.fromhex(match.group(1)).decode())
        except ValueError:
            continue
    return names
