"""``_fivetran_id``: a keyless table's key, the hash of a row's values (HISTORY_MODE section 3,
"Tables without a primary key"; the encoding is spelled out in ``docs/history-table.md``).

The hash must not depend on anything but the values: not on the column order of a file, not on
a column the row does not have (a column added to the table later is null in older rows, and a
null cell is left out), and not on the engine. So each non-null cell is encoded in a fixed,
typed byte form, the cells in the byte order of their column names' UTF-8, and SHA-256 is
taken of the whole. Another engine can recompute it from the description alone.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping
from decimal import Decimal
from functools import partial

import pyarrow as pa

from cdc_platform.lib.storage.schema import map_children

__all__ = ["python_values", "row_ids", "value_encoder"]

_NAN = struct.pack(">Q", 0x7FF8000000000000)

Encoder = Callable[[object], bytes]


# 128 bits of the hash: as unique as a key needs, and no longer than the 32 characters Delta
# keeps file statistics for (``delta.MAX_STRING_STAT``), which the merge prunes files by.
ID_HEX_DIGITS = 32
# Rows turned into Python values at a time: a file's cells are never all Python objects at once.
SLICE_ROWS = 50_000


def row_ids(columns: Mapping[str, pa.Array], rows: int) -> pa.Array:
    """The id of each of the ``rows`` rows of ``columns`` (the row's data columns, in any
    order, in the table's types): 32 lower-case hex digits each."""
    names = sorted(columns, key=lambda n: n.encode("utf-8"))
    encoders = [(_name(n), value_encoder(columns[n].type)) for n in names]
    chunks = [pa.array([], pa.string())]
    for start in range(0, rows, SLICE_ROWS):
        values = [python_values(columns[n].slice(start, SLICE_ROWS)) for n in names]
        ids = []
        for i in range(min(SLICE_ROWS, rows - start)):
            h = hashlib.sha256()
            for (name, encode), column in zip(encoders, values, strict=True):
                value = column[i]
                if value is not None:  # a null cell is not part of the row's identity
                    h.update(name)
                    h.update(encode(value))
            ids.append(h.hexdigest()[:ID_HEX_DIGITS])
        chunks.append(pa.array(ids, pa.string()))
    return pa.concat_arrays(chunks)


def python_values(column: pa.Array) -> list[object]:
    """The column as Python values, timestamps and dates (nested ones too) as their integer
    counts, which is what they are encoded as: a datetime cannot hold every value Arrow can,
    and integers are cheaper. A column comes in the table's types (microsecond timestamps)."""
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.timestamp("us", tz="UTC"))
    return column.cast(_as_integers(column.type)).to_pylist()


def _as_integers(t: pa.DataType) -> pa.DataType:
    if pa.types.is_timestamp(t):
        return pa.int64()
    if pa.types.is_date32(t):
        return pa.int32()
    return map_children(t, _as_integers)


def _name(name: str) -> bytes:
    raw = name.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


def value_encoder(t: pa.DataType) -> Encoder:
    """The byte form of a value of type ``t``: a one-letter tag, then the value (also what a
    hashed column's salt is hashed with, ``landing.rows.pii``)."""
    if pa.types.is_null(t):  # only ever null: never encoded
        return lambda v: b""
    if pa.types.is_boolean(t):
        return lambda v: b"b" + (b"\x01" if v else b"\x00")
    if pa.types.is_integer(t):
        return lambda v: b"i" + struct.pack(">q", v)
    if pa.types.is_floating(t):
        return _float
    if pa.types.is_decimal(t):
        return partial(_decimal, scale=t.scale)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return lambda v: b"s" + _sized(v.encode("utf-8"))  # type: ignore[union-attr]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return lambda v: b"x" + _sized(bytes(v))  # type: ignore[arg-type]
    if pa.types.is_date32(t):
        return lambda v: b"D" + struct.pack(">i", v)  # days, as python_values gives them
    if pa.types.is_timestamp(t):
        return lambda v: b"t" + struct.pack(">q", v)  # microseconds, as python_values gives
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _list_encoder(value_encoder(t.value_type))
    if pa.types.is_struct(t):
        return _struct_encoder(t)
    if pa.types.is_map(t):
        return _map_encoder(value_encoder(t.key_type), value_encoder(t.item_type))
    raise TypeError(f"no _fivetran_id encoding for type {t}")  # normalize_type never gives one


def _float(v: object) -> bytes:
    x = float(v)  # type: ignore[arg-type]
    if math.isnan(x):
        return b"f" + _NAN
    return b"f" + struct.pack(">d", x + 0.0)  # -0.0 + 0.0 is 0.0


def _decimal(v: object, scale: int) -> bytes:
    assert isinstance(v, Decimal)
    return b"d" + bytes([scale]) + _unscaled(v, scale).to_bytes(16, "big", signed=True)


def _unscaled(v: Decimal, scale: int) -> int:
    """The decimal's digits as an integer at the column's scale (exact: no context rounding)."""
    sign, digits, exponent = v.as_tuple()
    n = int("".join(map(str, digits)) or "0") * (-1 if sign else 1)
    shift = int(exponent) + scale
    return n * 10**shift if shift >= 0 else n // 10**-shift


def _sized(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


def _list_encoder(element: Encoder) -> Encoder:
    def encode(v: object) -> bytes:
        items = list(v)  # type: ignore[call-overload]
        out = [b"l", struct.pack(">I", len(items))]
        out += [b"\x00" if x is None else b"\x01" + element(x) for x in items]
        return b"".join(out)

    return encode


def _struct_encoder(t: pa.StructType) -> Encoder:
    fields = sorted((t.field(i) for i in range(t.num_fields)), key=lambda f: f.name.encode())
    parts = [(f.name, _name(f.name), value_encoder(f.type)) for f in fields]

    def encode(v: object) -> bytes:
        assert isinstance(v, dict)
        out = [b"r", struct.pack(">I", len(parts))]
        for key, name, element in parts:
            x = v.get(key)
            out.append(name + (b"\x00" if x is None else b"\x01" + element(x)))
        return b"".join(out)

    return encode


def _map_encoder(key: Encoder, item: Encoder) -> Encoder:
    """A map's entries in the byte order of their encoded keys: the order a file lists them in
    is not part of the value (as the fold compares maps, ``columns.same_sql``)."""

    def encode(v: object) -> bytes:
        entries = sorted(
            (key(k), b"\x00" if x is None else b"\x01" + item(x))
            for k, x in v  # type: ignore[attr-defined]
        )
        return b"".join([b"m", struct.pack(">I", len(entries)), *(k + x for k, x in entries)])

    return encode
