"""The one ISO-8601 timestamp parser, for every landing format (Parquet strings and CSV cells).

Accepted, and freely mixed within one column:

* a zone: ``Z`` or an offset (``+02:00``, ``+0200``, ``+02``); no zone means UTC;
* ``T`` or a space between date and time; a date alone means midnight UTC;
* any number of fraction digits (``.`` or ``,``), truncated (never rounded) to microseconds.

``parse_timestamps`` raises ``pa.ArrowInvalid`` when any value does not parse;
``first_unparsable`` then names the first value that does not, by bisection, so the row a
reason names is the row that is actually bad.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import TS_TYPE

CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError)

# How far ahead of this machine's clock an operator's time may be (a re-sync's ``at``, an
# adopted table's ``_fivetran_synced``): clock skew between machines, not more. A time further
# ahead puts versions after every CDC event that lands until then.
CLOCK_SKEW = timedelta(minutes=1)

_DATE_ONLY_RE = r"^\d{4}-\d{2}-\d{2}$"
_HAS_OFFSET_RE = r"[T ]\d{2}(?::\d{2}){0,2}(?:[.,]\d+)?(?:Z|[+-]\d{2}(?::?\d{2})?)$"
_EXTRA_FRACTION_RE = r"([.,]\d{6})\d+"
_COMMA_FRACTION_RE = r"(:\d{2}),(\d)"


def parse_timestamps(strings: pa.Array | pa.ChunkedArray) -> pa.Array:
    """ISO-8601 strings to ``timestamp[us, UTC]``; nulls stay null; raises ArrowInvalid."""
    if isinstance(strings, pa.ChunkedArray):
        strings = strings.combine_chunks()
    if not pa.types.is_string(strings.type):
        strings = strings.cast(pa.string())
    try:  # fast path: every value has a zone and at most 6 fraction digits
        return pc.cast(strings, TS_TYPE)
    except pa.ArrowInvalid:
        return pc.cast(_normalize(strings), TS_TYPE)


def _normalize(strings: pa.Array) -> pa.Array:
    """Text Arrow parses as one UTC instant: fraction -> 6 digits, naive -> 'Z', date -> midnight."""
    s = pc.replace_substring_regex(strings, _COMMA_FRACTION_RE, r"\1.\2")  # pyright: ignore[reportAttributeAccessIssue]
    s = pc.replace_substring_regex(s, _EXTRA_FRACTION_RE, r"\1")  # pyright: ignore[reportAttributeAccessIssue]
    date_only = pc.match_substring_regex(s, _DATE_ONLY_RE)  # pyright: ignore[reportAttributeAccessIssue]
    has_offset = pc.match_substring_regex(s, _HAS_OFFSET_RE)  # pyright: ignore[reportAttributeAccessIssue]
    with_midnight = pc.binary_join_element_wise(s, "T00:00:00Z", "")  # pyright: ignore[reportAttributeAccessIssue]
    with_z = pc.binary_join_element_wise(s, "Z", "")  # pyright: ignore[reportAttributeAccessIssue]
    return pc.if_else(date_only, with_midnight, pc.if_else(has_offset, s, with_z))  # pyright: ignore[reportAttributeAccessIssue]


def first_failure(values: pa.Array, convert: Callable[[pa.Array], pa.Array]) -> int | None:
    """Index of the first value ``convert`` rejects, by bisection (about one more pass).

    ``convert`` must fail on a slice exactly when it fails on one of the slice's values.
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    lo, hi = 0, len(values)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            convert(values.slice(lo, mid - lo))
        except CAST_ERRORS:
            hi = mid
        else:
            lo = mid
    if hi - lo != 1:
        return None
    try:
        convert(values.slice(lo, 1))
    except CAST_ERRORS:
        return lo
    return None


def first_unparsable(strings: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first value ``parse_timestamps`` rejects (None if all parse)."""
    return first_failure(strings, parse_timestamps)


def ahead_of(t: datetime, now: datetime) -> bool:
    """Whether ``t`` is in the future of ``now`` by more than ``CLOCK_SKEW``."""
    return t > now + CLOCK_SKEW
