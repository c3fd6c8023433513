"""The rules every landing row is held to once decoded, whatever its format.

Values convert to the platform's types without loss (``to_type``; docs/HISTORY_MODE.md
section 1: one type per column), and each row has its key, a known operation, a seq and a
commit timestamp in range (``validate_rows``): a file with any bad row is set aside whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import (
    CDC_COLUMNS,
    OP,
    OPERATIONS,
    SEQ,
    TMAX,
    TMIN,
    TS,
    TS_TYPE,
    UNMODIFIED,
)
from cdc_platform.lib.storage.schema import (
    is_list,
    normalize_type,
)

__all__ = [
    "first_invalid_row",
    "has_text",
    "is_string_like",
    "needs_value_check",
    "row_reason",
    "to_type",
    "validate_rows",
]


# Spark, Delta and Python's datetime all represent years 1 to 9999, no more.
_DATE_MIN, _DATE_MAX = -719_162, 2_932_896  # 0001-01-01 and 9999-12-31, in days since 1970
_US_MIN, _US_MAX = _DATE_MIN * 86_400_000_000, (_DATE_MAX + 1) * 86_400_000_000 - 1


def has_text(t: pa.DataType) -> bool:
    """Whether a type holds strings anywhere (checked for UTF-8 by the Python inspection)."""
    if is_string_like(t):
        return True
    if is_list(t):
        return has_text(t.value_type)
    if pa.types.is_struct(t):
        return any(has_text(f.type) for f in t)
    return False


def first_invalid_row(values: pa.Array) -> int | None:
    """The first row of ``values`` that fails Arrow's full validation (bisecting prefixes)."""
    lo, hi = 0, len(values)  # the first bad row is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            values.slice(lo, mid - lo).validate(full=True)
            lo = mid
        except pa.ArrowInvalid:
            hi = mid
    try:
        values.slice(lo, 1).validate(full=True)
    except pa.ArrowInvalid:
        return lo
    return None


def needs_value_check(t: pa.DataType) -> bool:
    """True if normalizing a column of type ``t`` can fail on some value (checked in pass 1)."""
    if pa.types.is_dictionary(t):
        return needs_value_check(t.value_type)
    return (
        pa.types.is_uint64(t)
        or has_text(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_decimal(t)
        or pa.types.is_duration(t)  # seconds or milliseconds may overflow as microseconds
        or pa.types.is_nested(t)
    )


def is_string_like(t: pa.DataType) -> bool:
    return pa.types.is_string(normalize_type(t))


def to_type(values: pa.Array, target: pa.DataType) -> pa.Array:
    """``values`` as ``target``, never losing a value: raises ArrowInvalid if one does not fit.

    Nanosecond timestamps are truncated to microseconds (the one documented loss: Spark and
    Delta keep microseconds); Spark's date and timestamp range (years 1 to 9999) is enforced.
    """
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_timestamp(values.type) and values.type.unit == "ns":
        values = pc.floor_temporal(values, unit="microsecond")  # pyright: ignore[reportAttributeAccessIssue]
    if pa.types.is_duration(values.type):
        values = duration_micros(values)
    out = values if values.type == target else values.cast(target, safe=True)
    if pa.types.is_timestamp(target) or pa.types.is_date(target):
        bounds = pc.min_max(out.cast(pa.int64() if pa.types.is_timestamp(target) else pa.int32()))  # pyright: ignore[reportAttributeAccessIssue]
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        low, high = (_US_MIN, _US_MAX) if pa.types.is_timestamp(target) else (_DATE_MIN, _DATE_MAX)
        if lo is not None and (lo < low or hi > high):
            raise pa.ArrowInvalid("outside the years 1 to 9999")
    return out


# Microseconds per unit of a duration, or (for nanoseconds) units per microsecond.
_PER_UNIT = {"s": 1_000_000, "ms": 1_000, "us": 1}


def duration_micros(values: pa.Array) -> pa.Array:
    """A duration column as int64 microseconds (docs/history-table.md, types): exact for
    seconds to microseconds (an overflow raises ArrowInvalid), nanoseconds floored as a
    timestamp's are (-1500 ns is -2 us, as Python's ``timedelta // timedelta(microseconds=1)``)."""
    raw = values.cast(pa.int64())
    unit = values.type.unit
    if unit in _PER_UNIT:
        return pc.multiply_checked(raw, _PER_UNIT[unit])  # pyright: ignore[reportAttributeAccessIssue]
    truncated = pc.divide(raw, 1_000)  # pyright: ignore[reportAttributeAccessIssue]  # toward zero
    below = pc.less(pc.subtract(raw, pc.multiply(truncated, 1_000)), 0)  # pyright: ignore[reportAttributeAccessIssue]
    return pc.subtract(truncated, below.cast(pa.int64()))  # pyright: ignore[reportAttributeAccessIssue]


def validate_rows(
    tbl: pa.Table,
    primary_key: Sequence[str],
    show: Callable[[object], str] = repr,
) -> tuple[str | None, int | None, int]:
    """The first bad row (1-based) and why, plus how many rows are bad; (None, None, 0) if clean.

    ``show`` renders a cell for the reason (an encrypted table's reader never shows one).
    A commit timestamp must lie in [0001-01-01, 9999-12-31T23:59:59.999Z): at TMAX or later
    a version could not be told from a live one (a delete there would leave the key active).
    """
    missing = [c for c in (*primary_key, *CDC_COLUMNS) if c not in tbl.column_names]
    if missing:
        return f"missing required column(s) {missing}", None, 0
    if tbl.num_rows == 0:
        return None, None, 0
    if not pa.types.is_integer(tbl[SEQ].type):
        return f"{SEQ} has type {tbl[SEQ].type}, expected an integer", None, 0
    if not pa.types.is_timestamp(tbl[TS].type):
        return f"{TS} has type {tbl[TS].type}, expected a timestamp", None, 0
    checks: list[pa.ChunkedArray] = [pc.is_null(tbl[key]) for key in primary_key]  # pyright: ignore[reportAttributeAccessIssue]
    op = tbl[OP]
    checks.append(pc.invert(pc.fill_null(pc.is_in(op, pa.array(OPERATIONS)), False)))  # pyright: ignore[reportAttributeAccessIssue]
    checks.append(pc.is_null(tbl[SEQ]))  # pyright: ignore[reportAttributeAccessIssue]
    checks.append(pc.is_null(tbl[TS]))  # pyright: ignore[reportAttributeAccessIssue]
    ts = tbl[TS].cast(TS_TYPE)
    out_of_range = pc.or_(  # pyright: ignore[reportAttributeAccessIssue]
        pc.less(ts, pa.scalar(TMIN, TS_TYPE)),  # pyright: ignore[reportAttributeAccessIssue]
        pc.greater_equal(ts, pa.scalar(TMAX, TS_TYPE)),  # pyright: ignore[reportAttributeAccessIssue]
    )
    checks.append(pc.fill_null(out_of_range, False))
    any_bad = checks[0]  # there is always a key, seq and timestamp check
    for mask in checks[1:]:
        any_bad = pc.or_(any_bad, mask)  # pyright: ignore[reportAttributeAccessIssue]
    bad_count = pc.sum(any_bad.cast(pa.int64())).as_py() or 0  # pyright: ignore[reportAttributeAccessIssue]
    if not bad_count:
        return None, None, 0
    first = pc.index(any_bad, True).as_py()
    for check, mask in enumerate(checks):
        if mask[first].as_py():
            reason = row_reason(check, primary_key, op[first].as_py(), show)
            return bad_rows_reason(first + 1, reason, bad_count), first + 1, bad_count
    raise AssertionError("unreachable: a bad row matched no check")


def unmodified_rows(tbl: pa.Table) -> tuple[str | None, int | None, int]:
    """For a keyless table: the first row marking a cell unmodified, which has no id (its
    values are not all known; HISTORY_MODE section 3), and how many do; like ``validate_rows``."""
    if UNMODIFIED not in tbl.column_names or tbl.num_rows == 0:
        return None, None, 0
    marked = pc.fill_null(pc.greater(pc.list_value_length(tbl[UNMODIFIED]), 0), False)  # pyright: ignore[reportAttributeAccessIssue]
    count = pc.sum(marked.cast(pa.int64())).as_py() or 0  # pyright: ignore[reportAttributeAccessIssue]
    if not count:
        return None, None, 0
    first = pc.index(marked, True).as_py() + 1  # pyright: ignore[reportAttributeAccessIssue]
    reason = "marks cells unmodified: a keyless table's row is identified by all its values"
    return bad_rows_reason(first, reason, count), first, count


def row_reason(
    check: int, primary_key: Sequence[str], op: object, show: Callable[[object], str] = repr
) -> str:
    """Why a row is bad, by the number of the first check it fails, in ``validate_rows``'s
    order: each key column null, then the operation, seq missing, ts missing, ts out of range.
    (The Spark SQL validation of natively read files numbers its checks the same way.)"""
    n = len(primary_key)
    if check < n:
        return f"primary key column '{primary_key[check]}' is null"
    return (
        f"{OP} {show(op)} is not INSERT, UPDATE or DELETE",
        f"{SEQ} is missing",
        f"{TS} is missing",
        f"{TS} is out of range (must be before 9999-12-31T23:59:59.999Z)",
    )[check - n]


def bad_rows_reason(row: int, reason: str, bad_count: int) -> str:
    more = f" ({bad_count} bad rows in all)" if bad_count > 1 else ""
    return f"row {row}: {reason}{more}"
