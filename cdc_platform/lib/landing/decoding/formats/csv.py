"""CSV landing files as Fivetran writes them (jackson ``CsvSchema``), read into Arrow.

* The header row gives the column order; it is never assumed.
* Double-quote quoting with doubled quotes inside; backslash is an ordinary character.
* A cell equal to the table's ``null_string`` is NULL; a cell equal to ``unmodified_string``
  is NULL too and its column name is listed in ``_cdc_unmodified`` for that row.
* BINARY cells are base64; every other cell is cast to the type the config declares.

Everything is read as strings first, then cast column by column with Arrow compute; the row
of a failing value is only searched for (by bisection) once a cast has failed.
"""

from __future__ import annotations

import binascii
import codecs as _text_codecs
import csv
import io
import re
from collections.abc import Callable, Sequence
from typing import IO, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from cdc_platform.lib.columns import CDC_COLUMNS, OP, SEQ, TS, TS_TYPE, UNMODIFIED
from cdc_platform.lib.landing.decoding.codecs import (
    LandingFileError,
    looks_like_text,
    open_decoded_stream,
)
from cdc_platform.lib.landing.decoding.formats.base import (
    Described,
    FileToRead,
    LandingFormat,
    Opener,
    TableOptions,
)
from cdc_platform.lib.landing.rows.timestamps import CAST_ERRORS, first_failure, parse_timestamps

__all__ = ["CDC_TYPES", "CSV", "arrow_type", "read_csv_events"]

CDC_TYPES = {OP: "string", SEQ: "long", TS: "timestamp"}

_SIMPLE_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "long": pa.int64(),
    "int": pa.int32(),
    "short": pa.int16(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
    "timestamp": TS_TYPE,
    "date": pa.date32(),
    "binary": pa.binary(),
}
_DECIMAL_RE = re.compile(r"^decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)$")
_HEADER_SCAN_LIMIT = 1 << 20  # a header row longer than this is not a header
_SHOWN_VALUE_CHARS = 60
_BASE64_RE = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


def arrow_type(type_name: str) -> pa.DataType:
    """The Arrow type of a config column type (``long`` -> int64, ``decimal(p,s)`` -> decimal128)."""
    t = type_name.strip().lower()
    if t in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[t]
    m = _DECIMAL_RE.match(t)
    if m:
        precision, scale = int(m.group(1)), int(m.group(2))
        if precision <= 38:
            return pa.decimal128(precision, scale)
        return pa.decimal256(precision, scale)
    raise ValueError(f"unknown column type {type_name!r}")


def read_csv_events(
    data: bytes | bytearray | memoryview | IO[bytes],
    table: TableOptions,
    source: str,
    hide_values: bool | None = None,
) -> pa.Table:
    """One CSV landing file as an Arrow table of change events.

    Columns: the header's data columns in header order with their declared types, then
    ``cdc_operation_type`` (string), ``cdc_change_seq`` (int64), ``cdc_commit_timestamp``
    (timestamp us UTC), then ``_cdc_unmodified`` (list<string>). Raises LandingFileError
    naming the 1-based data row when one row is at fault; the reason quotes no cell when
    ``hide_values`` (default: for an encrypted table).
    """
    hide = table.encryption != "none" if hide_values is None else hide_values
    header, stream = _read_header(data, source)
    _check_header(header, table, source)

    invalid: list[tuple[int | None, int, int, str]] = []

    def on_invalid_row(row) -> str:
        invalid.append((row.number, row.expected_columns, row.actual_columns, row.text))
        return "error"

    try:
        raw = pacsv.read_csv(
            stream,
            read_options=pacsv.ReadOptions(use_threads=False, block_size=1 << 22),
            parse_options=pacsv.ParseOptions(
                delimiter=",",
                quote_char='"',
                double_quote=True,
                escape_char=False,
                newlines_in_values=True,
                ignore_empty_lines=True,
                invalid_row_handler=on_invalid_row,
            ),
            convert_options=pacsv.ConvertOptions(
                column_types={name: pa.string() for name in header},
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
                null_values=[],
            ),
        )
    except pa.ArrowInvalid as exc:
        if invalid:
            number, expected, actual, text = invalid[0]
            row = number - 1 if number is not None else None
            where = f"row {row}" if row is not None else "a row"
            hint = " (an unterminated quote?)" if text.count('"') % 2 else ""
            raise LandingFileError(
                f"{where}: expected {expected} cells, found {actual}{hint}", row, source
            ) from None
        detail = "" if hide else f": {exc}"
        raise LandingFileError(f"malformed CSV{detail}", None, source) from None

    if raw.column_names != header:  # pyarrow read the same header row we did
        raise LandingFileError(
            "malformed CSV header: pyarrow read another header row than the first line",
            None,
            source,
        )
    return _convert(raw, header, table, source, hide)


# -- header ---------------------------------------------------------------------------------------


def _read_header(data, source: str) -> tuple[list[str], IO[bytes] | pa.BufferReader]:
    """The header's column names, and a stream of the whole file (header included) for pyarrow."""
    if isinstance(data, bytes | bytearray | memoryview):
        buf = bytes(data) if not isinstance(data, bytes) else data
        end = _header_end(buf[:_HEADER_SCAN_LIMIT])
        if end is None and len(buf) > _HEADER_SCAN_LIMIT:
            raise LandingFileError(
                "malformed CSV: no end of the header row in the first 1 MiB", None, source
            )
        header_bytes = buf if end is None else buf[:end]
        stream: IO[bytes] | pa.BufferReader = pa.BufferReader(pa.py_buffer(buf))
    else:
        prefix = b""
        end = None
        while True:
            chunk = data.read(1 << 16)
            if not chunk:
                break
            prefix += chunk
            end = _header_end(prefix)
            if end is not None:
                break
            if len(prefix) > _HEADER_SCAN_LIMIT:
                raise LandingFileError(
                    "malformed CSV: no end of the header row in the first 1 MiB", None, source
                )
        header_bytes = prefix if end is None else prefix[:end]
        stream = io.BufferedReader(_PrefixedStream(prefix, data), buffer_size=1 << 20)
    header_bytes = header_bytes.removeprefix(_text_codecs.BOM_UTF8)
    if not header_bytes.strip(b"\r\n"):
        raise LandingFileError("empty file: no CSV header row", None, source)
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise LandingFileError("malformed CSV header: not UTF-8 text", None, source) from None
    try:
        rows = list(
            csv.reader(
                io.StringIO(text, newline=""), doublequote=True, escapechar=None, strict=True
            )
        )
    except csv.Error as exc:
        raise LandingFileError(f"malformed CSV header: {exc}", None, source) from None
    if len(rows) != 1:
        raise LandingFileError("malformed CSV header row", None, source)
    return rows[0], stream


def _header_end(buf: bytes) -> int | None:
    """Offset of the first line break outside quotes, or None if not in ``buf``."""
    pos = 0
    while True:
        quote = buf.find(b'"', pos)
        nl = _first_newline(buf, pos, quote if quote >= 0 else len(buf))
        if nl is not None:
            return nl
        if quote < 0:
            return None
        close = buf.find(b'"', quote + 1)  # a doubled quote "" closes and reopens: same thing
        if close < 0:
            return None
        pos = close + 1


def _first_newline(buf: bytes, start: int, stop: int) -> int | None:
    hits = [i for i in (buf.find(b"\n", start, stop), buf.find(b"\r", start, stop)) if i >= 0]
    return min(hits) if hits else None


def _check_header(header: list[str], table: TableOptions, source: str) -> None:
    """The header names known columns, each once. A name the table does not declare is named
    by its position, never quoted: a file that is not the table's CSV (another file swapped in,
    a data row where the header should be, the keyring) would have its first line echoed."""

    def label(name: str, i: int) -> str:
        known = name in CDC_COLUMNS or name in table.columns
        return f"'{name}'" if known else f"#{i + 1}"

    seen: set[str] = set()
    for i, name in enumerate(header):
        if name in seen:
            raise LandingFileError(
                f"column {label(name, i)} appears twice in the header", None, source
            )
        seen.add(name)
    blocked = {c.lower() for c in table.block_columns or ()}
    for i, name in enumerate(header):
        if name not in CDC_COLUMNS and name not in table.columns and name.lower() not in blocked:
            raise LandingFileError(
                f"column #{i + 1} of the header is not a column the config declares"
                " (its name is not shown: the file may not be this table's)",
                None,
                source,
            )
    missing = [c for c in CDC_COLUMNS if c not in seen]
    if missing:
        raise LandingFileError(f"missing change column(s) {missing} in the header", None, source)


class _PrefixedStream(io.RawIOBase):
    """Bytes already read from a stream, then the rest of the stream."""

    def __init__(self, prefix: bytes, rest: IO[bytes]) -> None:
        super().__init__()
        self._prefix = memoryview(prefix)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._prefix:
            n = min(len(buffer), len(self._prefix))
            buffer[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        chunk = self._rest.read(len(buffer))
        if not chunk:
            return 0
        n = len(chunk)
        buffer[:n] = chunk
        return n


# -- conversion -----------------------------------------------------------------------------------


def _convert(
    raw: pa.Table, header: list[str], table: TableOptions, source: str, hide: bool
) -> pa.Table:
    n = raw.num_rows
    # A blocked column is never parsed: its cells cannot set a file aside (``landing.rows.pii``).
    blocked = {c.lower() for c in table.block_columns or ()}
    data_cols = [c for c in header if c not in CDC_COLUMNS and c.lower() not in blocked]
    names: list[str] = []
    arrays: list[pa.Array] = []
    unmodified_masks: list[pa.Array | None] = []

    for name in [*data_cols, *CDC_COLUMNS]:
        is_cdc = name in CDC_COLUMNS
        type_name = CDC_TYPES[name] if is_cdc else table.columns[name]
        target = arrow_type(type_name)
        strings = raw.column(name).combine_chunks()
        missing = None
        if table.null_string is not None:
            missing = pc.equal(strings, table.null_string)  # pyright: ignore[reportAttributeAccessIssue]
        if not is_cdc:
            unmodified = None
            if table.unmodified_string is not None:
                unmodified = pc.equal(strings, table.unmodified_string)  # pyright: ignore[reportAttributeAccessIssue]
                missing = unmodified if missing is None else pc.or_(missing, unmodified)  # pyright: ignore[reportAttributeAccessIssue]
            unmodified_masks.append(unmodified)
        values = (
            strings
            if missing is None
            else pc.if_else(missing, pa.scalar(None, pa.string()), strings)  # pyright: ignore[reportAttributeAccessIssue]
        )
        arrays.append(_cast_column(values, strings, target, type_name, name, source, hide))
        names.append(name)

    names.append(UNMODIFIED)
    arrays.append(_unmodified_lists(n, data_cols, unmodified_masks))
    return pa.Table.from_arrays(arrays, names=names)


def _cast_column(
    values: pa.Array,
    strings: pa.Array,
    target: pa.DataType,
    type_name: str,
    name: str,
    source: str,
    hide: bool,
) -> pa.Array:
    """Cast one column of strings (nulls already applied); on failure, name the first bad row."""
    if pa.types.is_string(target):
        return values
    if pa.types.is_binary(target):
        return _decode_base64(values, strings, name, source, hide)
    cast = _caster(target)
    try:
        return cast(values)
    except CAST_ERRORS as exc:
        row = first_failure(values, cast)
        if row is None:
            detail = "" if hide else f": {exc}"
            raise LandingFileError(
                f"column '{name}': cannot cast to {type_name}{detail}", None, source
            ) from None
        raise LandingFileError(
            f"row {row + 1}, column '{name}': {_show(strings[row].as_py(), hide)}"
            f" is not a valid {type_name}",
            row + 1,
            source,
        ) from None


def _caster(target: pa.DataType) -> Callable[[pa.Array], pa.Array]:
    """Timestamps go through the one ISO-8601 parser every landing format shares."""
    if pa.types.is_timestamp(target):
        return lambda a: pc.cast(parse_timestamps(a), target)
    return lambda a: pc.cast(a, target)


def _decode_base64(
    values: pa.Array, strings: pa.Array, name: str, source: str, hide: bool
) -> pa.Array:
    """Vectorised base64 -> binary: validate by regex, decode all cells in one call, re-split."""
    n = len(values)
    if n == 0:
        return pa.array([], pa.binary())
    nulls = pc.is_null(values)  # pyright: ignore[reportAttributeAccessIssue]
    text = pc.fill_null(values, "")
    valid = pc.match_substring_regex(text, _BASE64_RE)  # pyright: ignore[reportAttributeAccessIssue]
    if not pc.all(valid).as_py():  # pyright: ignore[reportAttributeAccessIssue]
        row = pc.index(valid, False).as_py()
        raise LandingFileError(
            f"row {row + 1}, column '{name}': {_show(strings[row].as_py(), hide)}"
            " is not valid base64 (binary)",
            row + 1,
            source,
        )
    lengths = pc.cast(pc.binary_length(text), pa.int64())  # pyright: ignore[reportAttributeAccessIssue]  # multiples of 4 (validated)
    pads = pc.add(  # pyright: ignore[reportAttributeAccessIssue]
        pc.cast(pc.ends_with(text, "="), pa.int64()),  # pyright: ignore[reportAttributeAccessIssue]
        pc.cast(pc.ends_with(text, "=="), pa.int64()),  # pyright: ignore[reportAttributeAccessIssue]
    )
    # With '=' replaced by 'A' every cell is whole 4-char groups, so the concatenation decodes
    # in one call; cell i then spans `full` bytes of which the last `pads` are filler.
    unpadded = pc.replace_substring(text, "=", "A")  # pyright: ignore[reportAttributeAccessIssue]
    decoded = binascii.a2b_base64(_string_data(unpadded))
    full = pc.multiply(pc.divide(lengths, 4), 3)  # pyright: ignore[reportAttributeAccessIssue]
    keep = pc.subtract(full, pads)  # pyright: ignore[reportAttributeAccessIssue]
    starts = pa.concat_arrays([pa.array([0], pa.int64()), pc.cumulative_sum(full)])  # pyright: ignore[reportAttributeAccessIssue]
    ends = pc.add(starts.slice(0, n), keep)  # pyright: ignore[reportAttributeAccessIssue]
    # Offsets of 2n cells alternating value / filler: sort(starts + ends) interleaves them.
    offsets = pc.cast(pa.concat_arrays([starts, ends]).sort(), pa.int32())
    pairs = pa.Array.from_buffers(
        pa.binary(), 2 * n, [None, offsets.buffers()[1], pa.py_buffer(decoded)]
    )
    out = pc.list_element(pa.FixedSizeListArray.from_arrays(pairs, 2), 0)  # pyright: ignore[reportAttributeAccessIssue]
    return pc.if_else(nulls, pa.scalar(None, pa.binary()), out)  # pyright: ignore[reportAttributeAccessIssue]


def _string_data(arr: pa.Array) -> memoryview:
    """The concatenated bytes of a string array without nulls (zero-copy)."""
    _validity, offsets_buf, data_buf = arr.buffers()
    offsets = pa.Array.from_buffers(
        pa.int32(), len(arr) + 1, [None, offsets_buf], offset=arr.offset
    )
    start, end = offsets[0].as_py(), offsets[-1].as_py()
    if data_buf is None or end == start:
        return memoryview(b"")
    return memoryview(data_buf)[start:end]


def _unmodified_lists(n: int, data_cols: list[str], masks: list[pa.Array | None]) -> pa.Array:
    """list<string> per row: the names of the columns whose cell was ``unmodified_string``."""
    rows: list[pa.Array] = []
    cols: list[pa.Array] = []
    counts = pa.repeat(pa.scalar(0, pa.int32()), n)
    for j, mask in enumerate(masks):
        if mask is None:
            continue
        idx = pc.indices_nonzero(mask)  # pyright: ignore[reportAttributeAccessIssue]
        if len(idx):
            rows.append(idx)
            cols.append(pa.repeat(pa.scalar(j, pa.int32()), len(idx)))
            counts = pc.add(counts, pc.cast(mask, pa.int32()))  # pyright: ignore[reportAttributeAccessIssue]
    offsets = pa.concat_arrays(
        [pa.array([0], pa.int32()), pc.cast(pc.cumulative_sum(counts), pa.int32())]  # pyright: ignore[reportAttributeAccessIssue]
    )
    if rows:
        cells = pa.table({"row": pa.concat_arrays(rows), "col": pa.concat_arrays(cols)})
        order = pc.sort_indices(cells, sort_keys=[("row", "ascending"), ("col", "ascending")])  # pyright: ignore[reportAttributeAccessIssue]
        col_idx = pc.take(cells.column("col"), order)
        values = pc.take(pa.array(data_cols, pa.string()), col_idx).combine_chunks()
    else:
        values = pa.array([], pa.string())
    return pa.ListArray.from_arrays(offsets, values, type=pa.list_(pa.string()))


def _show(value: str | None, hide: bool) -> str:
    """A cell as a reason quotes it; never for an encrypted table (``hide``)."""
    if hide:
        return "the value"
    if value is None:
        return "null"
    if len(value) > _SHOWN_VALUE_CHARS:
        value = value[:_SHOWN_VALUE_CHARS] + "..."
    return repr(value)


# -- the format ------------------------------------------------------------------------------------


class Csv(LandingFormat):
    name = "csv"
    title = "CSV"
    suffix = ".csv"
    summary = "Fivetran-style CSV: a header row, every column's type declared in `columns`"

    def looks_like(self, head: bytes) -> bool:
        return looks_like_text(head)

    def read(self, source: BinaryIO, file: FileToRead) -> pa.Table:
        # Decoded plaintext is in memory already: its bytes (not a copy: ``getvalue``) take the
        # header scan's exact limit.
        data = source.getvalue() if isinstance(source, io.BytesIO) else source
        return read_csv_events(data, file.table, source=file.name, hide_values=file.hide_values)

    def describe(self, opener: Opener, compression: str) -> Described:
        with open_decoded_stream(opener(), compression, "none", []) as stream:
            sample = stream.read(_SAMPLE_BYTES)
            complete = not stream.read(1)
        return _sampled_columns(sample, complete)

    def config_problem(self, primary_key: Sequence[str], columns: dict[str, str]) -> str | None:
        missing = [c for c in primary_key if c not in columns]
        if columns and not missing:
            return None
        key = f", including the key {missing or list(primary_key)}" if primary_key else ""
        return f"a CSV table must declare the type of every column{key}"


CSV = Csv()

_SAMPLE_BYTES = 64 * 1024  # of a CSV file's plaintext: its header and first rows


def _sampled_columns(sample: bytes, complete: bool) -> Described:
    """The header's columns with types inferred from the rows in ``sample`` (change columns
    get their fixed types)."""
    sample = sample.removeprefix(b"\xef\xbb\xbf")
    if not complete:  # drop the last, cut row
        cut = max(sample.rfind(b"\n"), sample.rfind(b"\r"))
        sample = sample[: cut + 1] if cut > 0 else sample
    parse = pacsv.ParseOptions(double_quote=True, escape_char=False, newlines_in_values=True)
    try:
        table = pacsv.read_csv(
            io.BytesIO(sample),
            parse_options=parse,
            convert_options=pacsv.ConvertOptions(strings_can_be_null=True),
        )
        names, types = table.column_names, [_config_type(t) for t in table.schema.types]
        note = None
    except (pa.ArrowInvalid, ValueError):
        # a row cut inside a quoted value, say: the header alone, every column a string
        line = sample.splitlines()[0] if sample.strip() else b""
        header = next(csv.reader([line.decode("utf-8", "replace")]), [])
        names, types = header, ["string"] * len(header)
        note = "CSV column types unknown (rows not parsed): every type is 'string'"
    columns = [(n, CDC_TYPES.get(n, t)) for n, t in zip(names, types, strict=True)]
    missing = [c for c in CDC_COLUMNS if c not in names]
    if missing:
        extra = f"the header lacks the change column(s) {missing}: files would be set aside"
        note = f"{note}; {extra}" if note else extra
    return columns, note


def _config_type(t: pa.DataType) -> str:
    """The config (Spark SQL) type name for a type pyarrow inferred from CSV cells."""
    if pa.types.is_integer(t):
        return "long"
    if pa.types.is_floating(t):
        return "double"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_date(t):
        return "date"
    if isinstance(t, pa.Decimal128Type | pa.Decimal256Type):
        return f"decimal({t.precision},{t.scale})"
    return "string"  # strings, all-null columns, times
