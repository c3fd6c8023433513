"""The platform's type rules, below every layer that reads or writes a table: one Arrow type per
logical type (``normalize_type``), the types a file may not carry (``unsupported_type``), how a
column widens (``widest``; docs/HISTORY_MODE.md, schema changes) and the Spark schema a Delta
table is read with. The landing reader, the change log and the storage layer all use them, so
they live here rather than in any one of those."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pyarrow as pa

from cdc_platform.lib.columns import TS_TYPE

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

# Spark's Parquet reader options for files written by other tools: their dates and timestamps
# are proleptic Gregorian already (no legacy-calendar rebase).
NATIVE_READ_OPTIONS = {"datetimeRebaseMode": "CORRECTED", "int96RebaseMode": "CORRECTED"}


def normalize_type(t: pa.DataType) -> pa.DataType:
    """One Arrow type per logical type, so files written by different tools agree.

    Per Arrow type (every type Parquet can carry):

    * bool; int8..int64 and uint8..uint32 -> int64; uint64 -> int64, a value above 2^63-1
      sets the file aside ("out of range"), it never wraps;
    * float16/32/64 -> float64; decimal32/64/128/256 of precision <= 38 -> decimal128;
    * string, large_string, string_view -> string; binary, large, fixed, view -> binary;
    * date32/64 -> date32; time32/64 -> string (Delta has no time type);
    * duration of any unit -> int64 microseconds, floored as timestamps are (Delta has no
      duration type; top-level columns only, ``unsupported_type``);
    * timestamp of any unit, with or without zone -> timestamp[us, UTC] (naive means UTC,
      nanoseconds are truncated to microseconds);
    * list, large_list, fixed_size_list, list_view -> list of the normalized element type;
      struct -> struct of normalized fields; map -> map of normalized key and value types;
      dictionary -> its value type; null stays null (no evidence of a type yet).

    ``unsupported_type`` names the types that are set aside instead.
    """
    if pa.types.is_dictionary(t):
        return normalize_type(t.value_type)
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    if pa.types.is_decimal(t):
        return pa.decimal128(t.precision, t.scale) if t.precision <= 38 else t
    if is_text(t):
        return pa.string()
    if is_bytes(t):
        return pa.binary()
    if pa.types.is_timestamp(t):
        return TS_TYPE
    if pa.types.is_date(t):
        return pa.date32()
    if pa.types.is_time(t):
        return pa.string()
    if pa.types.is_duration(t):
        return pa.int64()
    return map_children(t, normalize_type)


def map_children(t: pa.DataType, convert: Callable[[pa.DataType], pa.DataType]) -> pa.DataType:
    """``t`` with ``convert`` applied to the types it is made of (a list's element, every
    list kind becoming a list; a struct's fields; a map's key and item), or ``t`` itself when
    it is made of none: how a rule for leaf types reaches into nested ones."""
    if is_list(t):
        return pa.list_(convert(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, convert(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(convert(t.key_type), convert(t.item_type))
    return t


def unsupported_type(t: pa.DataType, nested: bool = False) -> str | None:
    """Why a column of Arrow type ``t`` cannot be kept (the file is set aside), or None.

    Decisions: a **map** is kept as a top-level column, compared by its entries sorted by key
    (``columns.same_sql``); inside a list, a struct or another map it is rejected (Spark
    compares no map, and the comparison is per column). A **duration** column is
    kept as its microseconds (``normalize_type``); inside a list or struct it is rejected (the
    conversion is per column). An Arrow **interval** has no Delta type (a Parquet INTERVAL
    column is read as its 12 bytes, a fixed-size binary, and kept so); **decimal** beyond 38
    digits has no Spark or Delta type; a struct with no field or with field names equal but
    for case cannot be stored in Delta.
    """
    if pa.types.is_dictionary(t):
        return unsupported_type(t.value_type, nested)
    if pa.types.is_map(t):
        if nested:
            return "a map inside a list, struct or map is not supported (a top-level one is)"
        return unsupported_type(t.key_type, nested=True) or unsupported_type(
            t.item_type, nested=True
        )
    if pa.types.is_duration(t) and nested:
        return "a duration inside a list or struct is not supported (a top-level one is)"
    if pa.types.is_interval(t):
        return "interval columns are not supported (Delta has no interval type)"
    if pa.types.is_decimal(t) and t.precision > 38:
        return f"decimal precision {t.precision} is above the 38 digits Spark and Delta support"
    if is_list(t):
        return unsupported_type(t.value_type, nested=True)
    if pa.types.is_struct(t):
        if t.num_fields == 0:
            return "a struct without fields cannot be stored"
        names = [f.name.lower() for f in t]
        if len(set(names)) != len(names):
            return "a struct with field names equal but for case cannot be stored"
        for f in t:
            why = unsupported_type(f.type, nested=True)
            if why:
                return why
        return None
    # The leaf types ``normalize_type`` maps: the numbers, booleans, dates and timestamps
    # (what widens to a string), text, bytes, times, durations and null.
    simple = (
        _widens_to_string(t)
        or is_text(t)
        or is_bytes(t)
        or pa.types.is_time(t)
        or pa.types.is_duration(t)
        or pa.types.is_null(t)
    )
    return None if simple else f"type {t} is not supported"


def is_text(t: pa.DataType) -> bool:
    """Every Arrow string type (``normalize_type`` makes each a plain string)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def is_bytes(t: pa.DataType) -> bool:
    """Every Arrow binary type (``normalize_type`` makes each a plain binary)."""
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    )


def is_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    )


WIDENINGS = (
    "a column widens from a decimal to one with more digits, from date to timestamp, "
    "and from any number, boolean, date or timestamp to string"
)


def widest(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type both normalized types widen to, or None when neither widens to the other.

    A column only widens, never narrows, so no value is lost (AlterTable changes types but
    never drops data): integers and floats are int64 and float64 already (``normalize_type``);
    a decimal takes the larger scale and the larger number of integer digits (at most 38
    digits); a date becomes a timestamp (midnight UTC); any number, boolean, date or timestamp
    becomes a string. Widening is symmetric, so the order files are read in does not matter.
    """
    if a == b:
        return a
    if pa.types.is_decimal(a) and pa.types.is_decimal(b):
        scale = max(a.scale, b.scale)
        digits = max(a.precision - a.scale, b.precision - b.scale) + scale
        return pa.decimal128(digits, scale) if digits <= 38 else None
    if {a, b} == {pa.date32(), TS_TYPE}:
        return TS_TYPE
    for one, other in ((a, b), (b, a)):
        if pa.types.is_string(one) and _widens_to_string(other):
            return pa.string()
    return None


def _widens_to_string(t: pa.DataType) -> bool:
    return (
        pa.types.is_boolean(t)
        or pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_decimal(t)
        or pa.types.is_date(t)
        or pa.types.is_timestamp(t)
    )


def spark_schema(arrow: pa.Schema) -> StructType:
    """The Spark schema a table of this Arrow schema is read with (its types normalized)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(pa.schema([pa.field(f.name, normalize_type(f.type)) for f in arrow]))
