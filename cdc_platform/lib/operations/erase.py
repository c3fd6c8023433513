"""Erasing keys for a data subject's request: ``erase_key`` (docs/history-table.md, "Erasing a
key").

Every row and event of the named keys leaves the warehouse's live files, in commits each safe
to crash after (running the job again finishes it):

1. the keys are recorded in the erased-keys ledger, by salted hash only
   (``ledgers.erased_keys``): from then on no append logs an event of theirs, whatever file,
   re-read hour, re-sync or adoption delivers it;
2. their events leave the change log, as an un-apply's do (``HistoryTable.change``'s ``remove``, fenced
   on the version it decided on), and the merge recomputes the keys: their history rows and
   delete-only records go;
3. the side tables that named them in the clear are cleaned: the retracted keys the merge has
   caught up with, the forgotten-events ledger's rows of the keys, and every quarantine reason
   (withheld: a reason written before the erasure may quote any cell of the key's file rows,
   and from the first erasure on the reader quotes none);
4. the current table is refreshed from the history; one left behind once ``current_table``
   was turned off loses the keys' rows and keeps the others.

A request is checked before anything is written: the keyring's salt must be the one the
table's erased keys and hashed columns were recorded under, and each key must have events in
the change log (or be erased already), unless the request allows it to be absent
(``allow_absent``: a key that may arrive later). A hashed key column's value is tried as the
stored hash (64 hex digits) and as a cleartext hashed in each source type the change log
records for the column (``protected_columns.hashed_types``), every candidate being erased.

The replaced files stay readable by time travel until a VACUUM past the retention removes them
(``table_maintenance``). The request's values are never logged or written anywhere but the
commits above; the ledger records the hashes, the reason and the run.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import col
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import changelog, current_table
from cdc_platform.lib.history.merge import (
    MergeResult,
    drop_caught_up_retractions,
    table_relative,
)
from cdc_platform.lib.history.protected_columns import check_hashing_salt, hashed_types
from cdc_platform.lib.history.removal import GONE
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.decoding.keyring import KeyringError
from cdc_platform.lib.landing.rows.pii import hash_column
from cdc_platform.lib.ledgers import erased_keys, quarantine
from cdc_platform.lib.ledgers.erased_keys import ErasedKeys, key_hashes
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.operations.operation import Request
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths, current_table_name

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ERASE = "erase_key"
# Keys one request may name, and the longest reason: a request is a person's keys, not a purge.
MAX_KEYS = 1000
MAX_REASON = 500
# What a quarantine reason that quoted an erased value says instead.
_FILE = "_cdc_tmp_ledger_file"
_HASH = re.compile(r"[0-9a-f]{64}")
WITHHELD = (
    "reason withheld: it may have quoted a value of an erased key (materialize the hour again)"
)
# A hashed key column whose source types the change log does not record (a log from before
# the record): its cleartext is tried in each of these, where it casts.
UNRECORDED_TYPES = (
    pa.string(),
    pa.int64(),
    pa.float64(),
    pa.bool_(),
    pa.date32(),
    pa.timestamp("us", tz="UTC"),
)
# Keys an error names by position at most (a request holds up to MAX_KEYS).
_NAMED = 20


class ErasureError(Refusal):
    """The request cannot be carried out as given; nothing was written."""


@dataclass(frozen=True)
class EraseRequest(Request):
    """The keys to erase (each naming every key column, its value as text), why, the run
    that asks, and whether a key with no event may be recorded all the same."""

    keys: tuple[Mapping[str, str], ...]
    reason: str
    run_id: str
    allow_absent: bool = False


@dataclass(frozen=True)
class EraseResult:
    # The request's keys as the ledger records them: one per way a key was read (a hashed key
    # column's value as its stored hash, or hashed in each source type).
    key_hashes: tuple[str, ...]
    keys_asked: int
    newly_recorded: int  # 0 on a re-run
    events_removed: int
    keys_found: int  # keys with events in the change log
    changelog_files_rewritten: int
    merge: MergeResult
    forgotten_rows_removed: int
    reasons_withheld: int
    changed: bool = True
    hours: tuple[datetime, ...] = ()  # an erasure names no hour: reported as an observation

    def summary(self) -> str:
        return (
            f"erased {self.keys_asked} key(s) ({self.keys_found} with events): "
            f"{self.events_removed} event(s) removed; the replaced files stay until a VACUUM "
            "past the retention"
        )

    def metadata(self) -> dict[str, Any]:
        return {
            "operation": ERASE,
            "key_hashes": list(self.key_hashes),
            "keys_newly_recorded": self.newly_recorded,
            "keys_found": self.keys_found,
            "events_removed": self.events_removed,
            "changelog_files_rewritten": self.changelog_files_rewritten,
            "forgotten_rows_removed": self.forgotten_rows_removed,
            "quarantine_reasons_withheld": self.reasons_withheld,
            **self.merge.metadata(),
        }


def erase(t: HistoryTable, request: EraseRequest) -> EraseResult:
    """Erase the request's keys from the table; a key without events fails the request,
    unless ``allow_absent``."""
    reason = request.reason.strip()
    if not reason or len(reason) > MAX_REASON:
        raise ErasureError(f"an erasure needs a reason of 1 to {MAX_REASON} characters")
    salt = t.keyring.hash_salt if t.keyring is not None else None
    if salt is None:
        raise KeyringError(
            "erasing keys needs the keyring's hash_salt (CDC_KEYRING): the ledger that keeps "
            "them from being logged again records them by salted hash. Nothing was written."
        )
    paths, log = t.paths, t.changelog
    if not log.exists:
        raise ErasureError(f"{paths.changelog}: the table has no events yet, nothing to erase")
    erased_keys.check_ledger_salt(paths.erased_keys, salt)  # another salt: nothing written
    check_hashing_salt(log, t.config, t.keyring)
    pk = t.key
    cands = typed_keys(log, t.config.key, request.keys, _hashed_keys(t.config), salt)
    typed = cands.keys
    hashes = key_hashes({c: typed.column(c).combine_chunks() for c in pk}, typed.num_rows, salt)
    _check_found(t, cands, hashes.to_pylist(), salt, request.allow_absent)
    new = erased_keys.add(
        paths.erased_keys,
        hashes.to_pylist(),
        typed.schema,
        reason,
        request.run_id,
        request.now,
        salt,
    )
    erased = erased_keys.load(paths.erased_keys, t.keyring)  # all of them: a re-run finishes
    assert erased is not None
    removal, merge = t.change(
        request.now,
        lambda c: c.remove(
            lambda events: erased.flag(events, pk, GONE), "cdc_platform.erased_events", fence=True
        ),
        "erasure",
        catch_up=False,
    )
    drop_caught_up_retractions(t.fresh(paths.retracted_keys), t.fresh(paths.history))
    forgotten = _scrub_forgotten(t, typed, salt)
    withheld = _scrub_quarantine(paths)
    _scrub_current(t, typed, salt)
    return EraseResult(
        tuple(hashes.to_pylist()),
        len(request.keys),
        new,
        removal.events,
        removal.keys,
        removal.files_rewritten,
        merge,
        forgotten,
        withheld,
    )


def _scrub_current(t: HistoryTable, typed: pa.Table, salt: bytes) -> None:
    """The current table refreshed from the history; one left behind once ``current_table``
    was turned off (still readable) loses the keys' rows."""
    current = t.table(t.paths.current)
    if t.config.current_table and current.exists:
        current_table.refresh(t)
    elif current.exists and not _is_a_history_table(t.paths, t.name):
        _scrub_rows(t.spark, current, t.key, _erasing(typed, t.key, salt))


def _is_a_history_table(paths: TablePaths, name: str) -> bool:
    """Whether ``<table>_current`` is another table's history (one named so, with a change log
    of its own): never this table's to rewrite."""
    other = TablePaths.of(paths.current.parent, current_table_name(name))
    return delta.exists(other.changelog)


def _hashed_keys(table: TableConfig) -> set[str]:
    hashed = {c.lower() for c in table.hash_columns or ()}
    return {c for c in table.key if c.lower() in hashed}


@dataclass(frozen=True)
class Candidates:
    """The keys a request names, in the change log's types: one row per way of reading it (a
    hashed key column's value as its stored hash, or hashed in each source type), and which
    of the request's keys (0-based) each row reads."""

    keys: pa.Table
    given: tuple[int, ...]


def typed_keys(
    log: Table,
    key: Sequence[str],
    given: Sequence[Mapping[str, str]],
    hashed: Collection[str],
    salt: bytes,
) -> Candidates:
    """The request's keys in the change log's types. A key naming other columns than the
    table's key, or a value that is not of its column's type, is refused, naming the key by
    its position and the column, never the value. A ``hashed`` key column's value is read
    every way it can be (``_hash_options``): each way is a candidate row."""
    if not given or len(given) > MAX_KEYS:
        raise ErasureError(f"name 1 to {MAX_KEYS} keys to erase (got {len(given)})")
    by_lower = {c.lower(): c for c in key}
    values: dict[str, list[str]] = {c: [] for c in key}
    for i, k in enumerate(given, 1):
        named = {n.lower(): v for n, v in k.items()}
        if len(named) != len(k) or set(named) != set(by_lower):
            raise ErasureError(
                f"key {i} names {sorted(k)[:10]}: a key names each of the table's key columns "
                f"{list(key)} once"
            )
        for lower, column in by_lower.items():
            values[column].append(named[lower])
    schema, recorded = log.arrow_schema, hashed_types(log)
    options: dict[str, list[list[str]]] = {}
    for column in key:
        texts = values[column]
        if column in hashed:
            types = recorded.get(column.lower()) or list(UNRECORDED_TYPES)
            options[column] = [
                _hash_options(t, types, salt, i, column) for i, t in enumerate(texts)
            ]
        else:
            _cast(texts, schema.field(column))  # refused here, naming the key, if one is not
            options[column] = [[t] for t in texts]
    rows: dict[str, list[str]] = {c: [] for c in key}
    owner: list[int] = []
    for i in range(len(given)):
        for combo in itertools.product(*(options[c][i] for c in key)):
            owner.append(i)
            for column, text in zip(key, combo, strict=True):
                rows[column].append(text)
    arrays = {c: _cast(rows[c], schema.field(c)) for c in key}
    return Candidates(pa.table(arrays), tuple(owner))


def _hash_options(
    text: str, types: Sequence[pa.DataType], salt: bytes, i: int, column: str
) -> list[str]:
    """The hashes a hashed key column's ``text`` may stand for: itself, if it has a stored
    hash's form (64 hex digits), and its hash as a file's cell of each of ``types`` is hashed
    (``pii.hash_column`` of the value cast to the type), where it casts. Both are kept for an
    ambiguous text (a cleartext of 64 hex digits): a stored hash's cleartext is unknown."""
    out = {text} if _HASH.fullmatch(text) else set()
    for t in types:
        try:
            value = pc.cast(pa.array([text], pa.string()), t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
        out.add(hash_column(value, salt)[0].as_py())
    if not out:
        raise ErasureError(
            f"key {i + 1}: the value given for {column!r} is neither a stored hash (64 hex "
            f"digits) nor a value of a type the column was hashed from ({', '.join(map(str, types))});"
            " the value is not quoted"
        )
    return sorted(out)


def _cast(texts: list[str], field: pa.Field) -> pa.Array:
    """The texts as values of ``field``'s type (a time with its zone: ``...Z``)."""
    try:
        return pc.cast(pa.array(texts, pa.string()), field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    for i, text in enumerate(texts, 1):  # which one: Arrow's message would quote the value
        try:
            pc.cast(pa.array([text], pa.string()), field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise ErasureError(
                f"key {i}: the value given for {field.name!r} is not a {field.type} (times "
                "need a zone, like 2024-01-02T03:04:05Z); the value is not quoted"
            ) from None
    raise ErasureError(f"the values given for {field.name!r} are not of type {field.type}")


def _check_found(
    t: HistoryTable, cands: Candidates, hashes: Sequence[str], salt: bytes, allow_absent: bool
) -> None:
    """Refuse the request, before anything is written, if one of its keys has no event in
    the change log and was not erased before (a re-run finishes a request), unless
    ``allow_absent``: a key that matches nothing is most often a value given in another form
    than the table holds, and reporting success would erase nothing."""
    if allow_absent:
        return
    paths, log = t.paths, t.changelog
    known = set(
        Ledger(paths.erased_keys, erased_keys.SCHEMA).read(["key_hash"]).column(0).to_pylist()
    )
    mine = ErasedKeys.of({cands.keys.schema: set(hashes) - known}, salt)
    present = mine.found(log.read(t.spark), t.key) if log.files else set()
    hit = {i for i, h in zip(cands.given, hashes, strict=True) if h in present or h in known}
    absent = [i + 1 for i in sorted(set(cands.given) - hit)]
    if absent:
        shown = ", ".join(map(str, absent[:_NAMED])) + (" ..." if len(absent) > _NAMED else "")
        raise ErasureError(
            f"key(s) {shown} of the request have no event in the change log {paths.changelog}"
            " (a hashed key column's value was tried as its stored hash and as a cleartext of "
            "each type the column was hashed from): nothing was erased. Check the values, or "
            "set allow_absent: true to record them as erased all the same (a key that may "
            "arrive later)"
        )


def _erasing(typed: pa.Table, shared: Sequence[str], salt: bytes) -> ErasedKeys:
    """The request's keys (on the ``shared`` columns) as ``ErasedKeys``, to find their rows
    in a side table keyed on them."""
    cells = {c: typed.column(c).combine_chunks() for c in shared}
    types = pa.schema([typed.schema.field(c) for c in shared])
    return ErasedKeys.of({types: key_hashes(cells, typed.num_rows, salt).to_pylist()}, salt)


def _scrub_forgotten(t: HistoryTable, typed: pa.Table, salt: bytes) -> int:
    """Take the keys' rows out of the forgotten-events ledger (they name the key in the clear;
    the erased-keys ledger keeps the events out now). A ledger keyed on fewer of the columns
    (a rekey added one since) loses every row of the erased key's values in those: more rows
    than the key's, never fewer."""
    ledger = t.table(t.paths.forgotten_events)
    if not ledger.files:
        return 0
    shared = [c for c in t.key if c in changelog.ledger_key(ledger, t.key)]
    if not shared:
        return 0
    return _scrub_rows(t.spark, ledger, shared, _erasing(typed, shared, salt))


def _scrub_rows(spark: SparkSession, table: Table, key: list[str], mine: ErasedKeys) -> int:
    """Rewrite the files of ``table`` holding rows of ``mine`` (on columns ``key``) without
    them, in one commit; returns how many rows went. Each file is rewritten as one file, so
    that a forgotten-events file's removal token stays one per file
    (``changelog.removal_committed``)."""
    from pyspark.sql import functions as F

    if not table.files:
        return 0
    rows = table.read(spark).withColumn(_FILE, table_relative(F.input_file_name(), table.location))
    hits = mine.flag(rows, key, GONE).filter(col(GONE)).groupBy(_FILE).count().collect()
    if not hits:
        return 0
    names = {r[_FILE] for r in hits}
    holding = [f for f in table.files if f.path in names]
    with table.committing() as rewrite:
        for f in holding:
            kept = mine.flag(table.read(spark, [f]), key, GONE).filter(~col(GONE))
            rewrite.write(kept.drop(GONE).coalesce(1))
        removed = sum(int(r["count"]) for r in hits)
        rewrite.commit(delta.removes_for(holding), metadata={"cdc_platform.erased_rows": removed})
    return removed


def _scrub_quarantine(paths: TablePaths) -> int:
    """Withhold every quarantine reason not withheld yet: one written before the erasure may
    quote any cell of a file row of an erased key (its key's or another column's, whole or cut
    short), and the file is not read again here to tell. From the first erasure on, the
    reader quotes no cell (``pipeline``: ``hide_values``), so a reason materialized again is
    safe to keep."""
    rows = Ledger(paths.quarantine, quarantine.SCHEMA).rows()
    quoting = [r for r in rows if r["reason"] != WITHHELD]
    if quoting:
        for r in quoting:
            r["reason"] = WITHHELD
        Ledger(paths.quarantine, quarantine.SCHEMA).replace(
            quoting, delta.in_predicate("file", sorted({r["file"] for r in quoting}))
        )
    return len(quoting)
