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
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import partial

import pyarrow as pa

__all__ = ["python_values", "row_ids", "value_encoder"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DAY = date(1970, 1, 1)
_MICRO = timedelta(microseconds=1)
_NAN = struct.pack(">Q", 0x7FF8000000000000)

Encoder = Callable[[object], bytes]


def row_ids(columns: Mapping[str, pa.Array]) -> pa.Array:
    """The id of every row of ``columns`` (the row's data columns, in any order): 64 lower-case
    hex digits each."""
    names = sorted(columns, key=lambda n: n.encode("utf-8"))
    parts = [(_name(n), value_encoder(columns[n].type), python_values(columns[n])) for n in names]
    rows = len(columns[names[0]]) if names else 0
    ids = []
    for i in range(rows):
        h = hashlib.sha256()
        for name, encode, values in parts:
            value = values[i]
            if value is not None:  # a null cell is not part of the row's identity
                h.update(name)
                h.update(encode(value))
        ids.append(h.hexdigest())
    return pa.array(ids, pa.string())


def python_values(column: pa.Array) -> list[object]:
    """The column as Python values; timestamps and dates as their integer counts, which is
    what they are encoded as (and cheaper than datetimes)."""
    if pa.types.is_timestamp(column.type):
        return column.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_pylist()
    if pa.types.is_date32(column.type):
        return column.cast(pa.int32()).to_pylist()
    return column.to_pylist()


def _name(name: str) -> bytes:
    raw = name.encode("utf-8")
    return struct.pack(">I", len(raw)) + raw


def value_encoder(t: pa.DataType) -> Encoder:
    """The byte form of a value of type ``t``: a one-letter tag, then the value (also what a
    hashed column's salt is hashed with, ``landing.pii``)."""
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
        return lambda v: b"D" + struct.pack(">i", _days(v))
    if pa.types.is_timestamp(t):
        return lambda v: b"t" + struct.pack(">q", _micros(v))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _list_encoder(value_encoder(t.value_type))
    if pa.types.is_struct(t):
        return _struct_encoder(t)
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


def _days(v: object) -> int:
    return v if isinstance(v, int) else (v - _EPOCH_DAY).days  # type: ignore[operator]


def _micros(v: object) -> int:
    if isinstance(v, int):
        return v
    assert isinstance(v, datetime)
    return (v.astimezone(UTC) - _EPOCH) // _MICRO


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
