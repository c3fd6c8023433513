"""An independent, deliberately simple reference fold of docs/HISTORY_MODE.md section 3.

Pure Python, one loop per key, written from the contract text only. Property tests compare
the Spark implementation against ``reference_history``; keep this file boring and obviously
correct rather than fast.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

TMAX = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
ONE_MS = timedelta(milliseconds=1)

# A test puts this object in a data cell to mean "unmodified" (partial UPDATE, rule 1).
UNMODIFIED = object()

OP_COL = "cdc_operation_type"
SEQ_COL = "cdc_change_seq"
TS_COL = "cdc_commit_timestamp"

_OPS = ("INSERT", "UPDATE", "DELETE")


def truncate_to_ms(ts: datetime) -> datetime:
    """The commit timestamp in UTC, truncated (not rounded) to the millisecond."""
    if ts.tzinfo is None:
        raise ValueError(f"commit timestamp {ts!r} is naive; the reference needs tz-aware UTC")
    ts = ts.astimezone(UTC)
    return ts.replace(microsecond=(ts.microsecond // 1000) * 1000)


def data_columns(events: Iterable[Mapping[str, Any]], primary_key: Sequence[str]) -> list[str]:
    """Union of every non-key, non-``cdc_`` column of every event, sorted by name."""
    cols: set[str] = set()
    for event in events:
        for name in event:
            if name not in primary_key and not name.startswith("cdc_"):
                cols.add(name)
    return sorted(cols)


def _same(a: Any, b: Any) -> bool:
    """None-safe equality: None equals None, None never equals a value."""
    if a is None or b is None:
        return a is None and b is None
    return a == b


def _same_image(a: dict[str, Any], b: dict[str, Any], columns: Sequence[str]) -> bool:
    return all(_same(a[c], b[c]) for c in columns)


def _op(event: Mapping[str, Any]) -> str:
    op = str(event[OP_COL]).upper()
    if op not in _OPS:
        raise ValueError(f"unknown {OP_COL} {event[OP_COL]!r} in event {dict(event)!r}")
    return op


def reference_history(
    events: Iterable[Mapping[str, Any]],
    primary_key: Sequence[str],
    untracked: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Fold CDC events into history-mode versions (docs/HISTORY_MODE.md section 3).

    events: dicts with the pk columns, data columns, ``cdc_operation_type`` (any case of
    INSERT/UPDATE/DELETE), ``cdc_change_seq`` (int) and ``cdc_commit_timestamp`` (tz-aware
    datetime, may have microseconds). A data cell equal to ``UNMODIFIED`` keeps the previous
    image's value. Columns missing from an event are null. Data columns are the union of all
    non-pk, non-``cdc_`` keys. DELETE events' data columns are ignored.

    ``untracked``: data columns without history (selective history): an image that differs
    from the live version in these columns only opens no version but replaces the live
    version's image.

    Returns one dict per version: pk columns, every data column, ``_fivetran_start``,
    ``_fivetran_end``, ``_fivetran_active``; sorted by (pk, ``_fivetran_start``).
    """
    primary_key = list(primary_key)
    events = list(events)
    columns = data_columns(events, primary_key)

    # Group by key, counting each (key, seq) once. A re-delivered event must be identical.
    by_key: dict[tuple[Any, ...], dict[int, Mapping[str, Any]]] = {}
    for event in events:
        key = tuple(event[c] for c in primary_key)
        seq = int(event[SEQ_COL])
        seen = by_key.setdefault(key, {})
        if seq in seen:
            if not _same_event(seen[seq], event, columns):
                raise ValueError(
                    f"key {key}: two different events share {SEQ_COL}={seq}: "
                    f"{dict(seen[seq])!r} vs {dict(event)!r}"
                )
            continue
        seen[seq] = event

    out: list[dict[str, Any]] = []
    for key, by_seq in by_key.items():
        out.extend(_fold_key(key, list(by_seq.values()), primary_key, columns, untracked))
    out.sort(key=lambda row: (tuple(row[c] for c in primary_key), row["_fivetran_start"]))
    return out


def _same_event(a: Mapping[str, Any], b: Mapping[str, Any], columns: Sequence[str]) -> bool:
    """Same operation, same commit timestamp, same cells (a missing column counts as null)."""
    if _op(a) != _op(b) or a[TS_COL] != b[TS_COL]:
        return False
    for c in columns:
        va, vb = a.get(c), b.get(c)
        if va is UNMODIFIED or vb is UNMODIFIED:
            if va is not vb:
                return False
        elif not _same(va, vb):
            return False
    return True


def _fold_key(
    key: tuple[Any, ...],
    events: list[Mapping[str, Any]],
    primary_key: list[str],
    columns: list[str],
    untracked: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Walk one key's events, one distinct millisecond at a time."""
    tracked = [c for c in columns if c not in untracked]
    events = sorted(events, key=lambda e: (truncate_to_ms(e[TS_COL]), int(e[SEQ_COL])))

    # Group into distinct milliseconds, keeping (ms, seq) order inside each group.
    by_ms: list[tuple[datetime, list[Mapping[str, Any]]]] = []
    for event in events:
        ms = truncate_to_ms(event[TS_COL])
        if by_ms and by_ms[-1][0] == ms:
            by_ms[-1][1].append(event)
        else:
            by_ms.append((ms, [event]))

    versions: list[dict[str, Any]] = []  # each: {"image", "start", "end", "active"}
    live: dict[str, Any] | None = None  # the live version (also in `versions`), or None
    last_image: dict[str, Any] | None = None  # the key's last image, even if deleted since

    for ms, group in by_ms:
        non_deletes = [e for e in group if _op(e) != "DELETE"]
        last_is_delete = _op(group[-1]) == "DELETE"

        if not non_deletes:
            # Rule 4: only deletes in this millisecond.
            if live is not None:
                live["end"] = ms
                live["active"] = False
                live = None
            continue

        # Rule 1: one image from the non-delete events, applied in seq order.
        image = last_image
        for event in non_deletes:
            new_image: dict[str, Any] = {}
            for c in columns:
                value = event.get(c)
                if value is UNMODIFIED:
                    value = image[c] if image is not None else None
                new_image[c] = value
            image = new_image
        assert image is not None
        last_image = image

        if live is not None and _same_image(image, live["image"], tracked):
            # Rule 2: no new version. Rule 5 (second half): a trailing delete closes it here.
            # Untracked cells (selective history) take their new values in place.
            live["image"] = image
            if last_is_delete:
                live["end"] = ms
                live["active"] = False
                live = None
            continue

        # Rule 3: a new version starts at this millisecond; the live one ends 1 ms before.
        if live is not None:
            live["end"] = ms - ONE_MS
            live["active"] = False
        version = {"image": image, "start": ms, "end": TMAX, "active": True}
        versions.append(version)
        live = version
        if last_is_delete:
            # Rule 5: insert/update followed by a delete in the same ms -> start == end.
            version["end"] = ms
            version["active"] = False
            live = None

    rows = []
    for v in versions:
        row: dict[str, Any] = dict(zip(primary_key, key, strict=True))
        row.update(v["image"])
        row["_fivetran_start"] = v["start"]
        row["_fivetran_end"] = v["end"]
        row["_fivetran_active"] = v["active"]
        rows.append(row)
    return rows


def changed_columns(
    versions: Iterable[Mapping[str, Any]],
    primary_key: Sequence[str],
    untracked: Collection[str] = (),
) -> dict[tuple[Any, ...], list[str] | None]:
    """``_cdc_changed_columns`` as defined, from consecutive versions: per (key, start), the
    tracked data columns (in the rows' column order) whose value differs, None-safe, from the
    key's previous version; None for a key's first version."""
    by_key: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for v in versions:
        by_key.setdefault(tuple(v[k] for k in primary_key), []).append(v)
    out: dict[tuple[Any, ...], list[str] | None] = {}
    for key, rows in by_key.items():
        rows = sorted(rows, key=lambda r: r["_fivetran_start"])
        names = [
            c
            for c in rows[0]
            if c not in primary_key
            and c not in untracked
            and not c.startswith(("_fivetran_", "_cdc_"))
        ]
        previous: Mapping[str, Any] | None = None
        for r in rows:
            out[(*key, r["_fivetran_start"])] = (
                None if previous is None else [c for c in names if not _same(r[c], previous[c])]
            )
            previous = r
    return out


START_COL, END_COL, ACTIVE_COL = "_fivetran_start", "_fivetran_end", "_fivetran_active"


def restated_span(
    before: Sequence[Mapping[str, Any]],
    after: Sequence[Mapping[str, Any]],
    key: Sequence[str],
) -> tuple[datetime, datetime, bool] | None:
    """What a merge restated, from two states of a history table's rows (docs/history-table.md,
    "What a run restated"): the first and last instant at which some key's row image, as an
    as-of read would return it (start <= t <= end), differs; and whether a version that had
    ended was rewritten or removed. None when no image differs at any instant. Times are in
    milliseconds: probed at every start and end of the key's versions and a millisecond after
    each, which sees every stretch between them (an image can only change at one of those)."""
    system = {START_COL, END_COL, ACTIVE_COL, *key}
    names = sorted({c for r in [*before, *after] for c in r if c not in system})

    def image(r: Mapping[str, Any]) -> tuple[str, ...]:
        return tuple(repr(r.get(c)) for c in names)

    def at(rows: Sequence[Mapping[str, Any]], t: datetime) -> list[tuple[str, ...]]:
        return sorted(image(r) for r in rows if r[START_COL] <= t <= r[END_COL])

    def by_key(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], list[Any]]:
        out: dict[tuple[Any, ...], list[Any]] = {}
        for r in rows:
            out.setdefault(tuple(r[k] for k in key), []).append(r)
        return out

    old, new = by_key(before), by_key(after)
    changed: list[datetime] = []
    for k in old.keys() | new.keys():
        rows_old, rows_new = old.get(k, []), new.get(k, [])
        edges = sorted({r[c] for r in [*rows_old, *rows_new] for c in (START_COL, END_COL)})
        probes = [*edges, *(a + ONE_MS for a, b in pairwise(edges) if a + ONE_MS < b)]
        changed += [t for t in probes if at(rows_old, t) != at(rows_new, t)]

    def version(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (tuple(r[k] for k in key), r[START_COL], r[END_COL], r[ACTIVE_COL], image(r))

    kept = {version(r) for r in after}
    closed = any(not r[ACTIVE_COL] and version(r) not in kept for r in before)
    if not changed:
        return None
    return min(changed), max(changed), closed
