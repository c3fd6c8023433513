"""Hypothesis strategies for CDC event batches and their landing-file layout.

Table shape: primary key ``id`` (int), data columns ``name`` (str | None) and ``amount``
(int | None), plus ``extra`` (str | None) that only some events carry (schema drift).

The values come from tiny pools so that equal images, no-op updates and collisions are
frequent. The returned list is in *delivery* order, which must not matter to any consumer.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import strategies as st

from cdc_platform_tests.reference import UNMODIFIED

BASE_TIME = datetime(2024, 1, 1, tzinfo=UTC)
PRIMARY_KEY = ["id"]
DATA_COLUMNS = ["name", "amount", "extra"]
MAX_DELAY_HOURS = 5

Draw = Callable[[st.SearchStrategy[Any]], Any]

_NAMES = st.sampled_from(["ann", "bob", None])
_AMOUNTS = st.sampled_from([0, 1, None])
_EXTRAS = st.sampled_from(["x", None])
_OP_SPELLINGS = {
    "INSERT": ["INSERT", "insert", "Insert"],
    "UPDATE": ["UPDATE", "update", "Update"],
    "DELETE": ["DELETE", "delete", "Delete"],
}


def _time_step(draw: Draw, previous: datetime) -> datetime:
    """The next commit time: same instant, same ms (possibly a smaller microsecond), a few ms,
    or seconds/minutes later. Never before the previous event's millisecond."""
    kind = draw(st.sampled_from(["same", "same_ms", "sub_ms", "few_ms", "seconds", "minutes"]))
    if kind == "same":
        return previous
    if kind == "same_ms":
        # Anywhere in the previous event's millisecond, even earlier microseconds than it:
        # order inside a millisecond is by seq, not by raw microseconds.
        ms_floor = previous.replace(microsecond=(previous.microsecond // 1000) * 1000)
        return ms_floor + timedelta(microseconds=draw(st.integers(0, 999)))
    if kind == "sub_ms":
        # Under a millisecond later: may or may not cross into the next millisecond.
        return previous + timedelta(microseconds=draw(st.integers(1, 999)))
    if kind == "few_ms":
        return previous + timedelta(milliseconds=draw(st.integers(1, 3)))
    if kind == "seconds":
        return previous + timedelta(seconds=draw(st.integers(1, 59)))
    return previous + timedelta(minutes=draw(st.integers(1, 5)))


def _op_spelling(draw: Draw, op: str) -> str:
    return draw(st.sampled_from(_OP_SPELLINGS[op]))


def _data_cells(draw: Draw, allow_unmodified: bool) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for col, values in (("name", _NAMES), ("amount", _AMOUNTS), ("extra", _EXTRAS)):
        if col == "extra" and not draw(st.booleans()):
            continue  # drift: this event does not carry the column at all
        if allow_unmodified and draw(st.integers(0, 3)) == 0:
            cells[col] = UNMODIFIED
        else:
            cells[col] = draw(values)
    return cells


@st.composite
def cdc_event_batches(draw: Draw, max_keys: int = 4, max_events: int = 40) -> list[dict[str, Any]]:
    """A list of CDC events (in delivery order) for a table keyed by ``id``.

    Contains duplicates (same seq, identical content), visibly identical events with new
    seqs, UPDATE-first keys, several events per millisecond, microsecond differences that
    collapse into one millisecond, deletes (of unknown keys, twice in a row), partial
    UPDATEs with ``UNMODIFIED`` cells and an ``extra`` column only some events carry.
    ``cdc_change_seq`` increases with commit time; delivery order may be shuffled.
    """
    n_keys = draw(st.integers(1, max_keys))
    n_events = draw(st.integers(0, max_events))
    seq = draw(st.integers(1, 1_000))
    ts = BASE_TIME + timedelta(microseconds=draw(st.integers(0, 2 * 3600 * 1_000_000)))

    distinct: list[dict[str, Any]] = []
    for _ in range(n_events):
        ts = _time_step(draw, ts)
        seq += draw(st.integers(1, 3))
        kind = draw(
            st.sampled_from(["insert", "update", "partial_update", "delete", "repeat_visible"])
        )
        if kind == "repeat_visible" and distinct:
            # Visibly identical to an earlier event, but a new seq and a later time.
            earlier = draw(st.sampled_from(distinct))
            event = {k: v for k, v in earlier.items() if not k.startswith("cdc_")}
            event["cdc_operation_type"] = earlier["cdc_operation_type"]
        else:
            if kind == "repeat_visible":
                kind = "insert"
            op = {"insert": "INSERT", "delete": "DELETE"}.get(kind, "UPDATE")
            key = draw(st.integers(0, n_keys - 1))
            event = {"id": key}
            if op == "DELETE":
                # A delete carries only the key: data columns absent or null.
                if draw(st.booleans()):
                    event.update({"name": None, "amount": None})
            else:
                event.update(_data_cells(draw, allow_unmodified=kind == "partial_update"))
            event["cdc_operation_type"] = _op_spelling(draw, op)
        event["cdc_change_seq"] = seq
        event["cdc_commit_timestamp"] = ts
        distinct.append(event)

    # Exact duplicates: same seq, identical content (a fresh dict, as a re-delivery would be).
    delivered = list(distinct)
    if distinct:
        for _ in range(draw(st.integers(0, min(5, len(distinct))))):
            delivered.append(dict(draw(st.sampled_from(distinct))))

    if draw(st.booleans()):
        delivered = list(draw(st.permutations(delivered)))
    return delivered


def hour_floor(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def assign_to_files(
    draw: Draw,
    events: list[dict[str, Any]],
    start_hour: datetime | None = None,
    max_files_per_hour: int = 3,
) -> dict[tuple[datetime, str], list[dict[str, Any]]]:
    """Split events into landing files: ``{(folder_hour, file_name): [events]}``.

    Call inside an ``@st.composite`` (pass its ``draw``). Each event lands in a folder hour at
    or after its commit hour floor and at most ``MAX_DELAY_HOURS`` later (late delivery), and
    never before ``start_hour`` if given. Duplicates are placed independently, so they may
    land in different files or folders. Files keep the events' relative delivery order.
    """
    files: dict[tuple[datetime, str], list[dict[str, Any]]] = {}
    for event in events:
        floor = hour_floor(event["cdc_commit_timestamp"])
        if start_hour is not None:
            floor = max(floor, hour_floor(start_hour))
        late = draw(st.integers(0, 3)) == 0
        delay = draw(st.integers(1, MAX_DELAY_HOURS)) if late else 0
        folder = floor + timedelta(hours=delay)
        index = draw(st.integers(0, max_files_per_hour - 1))
        files.setdefault((folder, f"part-{index:05d}.parquet"), []).append(event)
    return files


@st.composite
def landing_files(
    draw: Draw, events: list[dict[str, Any]], start_hour: datetime | None = None
) -> dict[tuple[datetime, str], list[dict[str, Any]]]:
    """Strategy form of ``assign_to_files`` for a fixed list of events."""
    return assign_to_files(draw, events, start_hour)


@st.composite
def cdc_landing_batches(
    draw: Draw, max_keys: int = 4, max_events: int = 40
) -> tuple[list[dict[str, Any]], dict[tuple[datetime, str], list[dict[str, Any]]]]:
    """Events and their landing-file layout together: ``(events, files)``."""
    events = draw(cdc_event_batches(max_keys=max_keys, max_events=max_events))
    return events, assign_to_files(draw, events)
