"""Erasing keys for a data subject's request: ``erase_key`` (docs/history-table.md, "Erasing a
key").

Every row and event of the named keys leaves the warehouse's live files, in commits each safe
to crash after (running the job again finishes it):

1. the keys are recorded in the erased-keys ledger, by salted hash only
   (``ledgers.erased_keys``): from then on no append logs an event of theirs, whatever file,
   re-read hour, re-sync or adoption delivers it;
2. their events leave the change log, as an un-apply's do (``revocation.remove_events``, fenced
   on the version it decided on), and the merge recomputes the keys: their history rows and
   delete-only records go;
3. the side tables that named them in the clear are cleaned: the retracted keys the merge has
   caught up with, the forgotten-events ledger's rows of the keys, and quarantine reasons that
   quote one of the given values (withheld);
4. the current table is refreshed from the history.

The replaced files stay readable by time travel until a VACUUM past the retention removes them
(``table_maintenance``). The request's values are never logged or written anywhere but the
commits above; the ledger records the hashes, the reason and the run.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import col
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import changelog, current_table
from cdc_platform.lib.history.merge import (
    MergeResult,
    apply_pending,
    drop_caught_up_retractions,
    table_relative,
)
from cdc_platform.lib.landing.keyring import Keyring, KeyringError
from cdc_platform.lib.landing.pii import hash_column
from cdc_platform.lib.ledgers import erased_keys, quarantine
from cdc_platform.lib.ledgers.erased_keys import ErasedKeys, key_hashes
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.operations.revocation import GONE, remove_events
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Keys one request may name, and the longest reason: a request is a person's keys, not a purge.
MAX_KEYS = 1000
MAX_REASON = 500
# What a quarantine reason that quoted an erased value says instead.
_FILE = "_cdc_tmp_ledger_file"
_HASH = re.compile(r"[0-9a-f]{64}")
WITHHELD = "reason withheld: it quoted a value of an erased key (materialize the hour again)"


class ErasureError(ValueError):
    """The request cannot be carried out as given; nothing was written."""


@dataclass(frozen=True)
class EraseResult:
    key_hashes: tuple[str, ...]  # the request's keys, as the ledger records them
    newly_recorded: int  # 0 on a re-run
    events_removed: int
    keys_found: int  # keys with events in the change log
    changelog_files_rewritten: int
    merge: MergeResult
    forgotten_rows_removed: int
    reasons_withheld: int


def erase(
    spark: SparkSession,
    table: TableConfig,
    paths: TablePaths,
    keys: Sequence[Mapping[str, str]],
    reason: str,
    run_id: str,
    keyring: Keyring | None,
    now: datetime,
) -> EraseResult:
    """Erase ``keys`` (each naming every key column, its value as text) from ``table``."""
    reason = reason.strip()
    if not reason or len(reason) > MAX_REASON:
        raise ErasureError(f"an erasure needs a reason of 1 to {MAX_REASON} characters")
    salt = keyring.hash_salt if keyring is not None else None
    if salt is None:
        raise KeyringError(
            "erasing keys needs the keyring's hash_salt (CDC_KEYRING): the ledger that keeps "
            "them from being logged again records them by salted hash. Nothing was written."
        )
    log = Table.open(paths.changelog)
    if not log.exists:
        raise ErasureError(f"{paths.changelog}: the table has no events yet, nothing to erase")
    typed = typed_keys(log.arrow_schema, table.key, keys, _hashed_keys(table), salt)
    hashes = key_hashes({c: typed.column(c).combine_chunks() for c in table.key}, len(keys), salt)
    new = erased_keys.add(paths.erased_keys, hashes.to_pylist(), typed.schema, reason, run_id, now)
    erased = erased_keys.load(paths.erased_keys, keyring)  # all of them: a re-run finishes
    assert erased is not None
    pk = list(table.key)

    def attempt() -> tuple[int, int, int]:
        log = Table.open(paths.changelog)
        return remove_events(
            spark,
            paths,
            pk,
            log,
            log.files,
            lambda events: erased.flag(events, pk, GONE),
            "cdc_platform.erased_events",
            fence=True,
        )

    (removed, found, rewritten), _ = delta.with_commit_retries(
        attempt, f"change log erasure in {paths.changelog}"
    )
    merge = apply_pending(spark, paths, pk, now, table.history_columns)
    drop_caught_up_retractions(paths)
    forgotten = _scrub_forgotten(spark, paths, pk, typed, salt)
    withheld = _scrub_quarantine(paths, keys, typed)
    if table.current_table and Table.open(paths.current).exists:
        current_table.refresh(spark, paths, pk)
    return EraseResult(
        tuple(hashes.to_pylist()), new, removed, found, rewritten, merge, forgotten, withheld
    )


def _hashed_keys(table: TableConfig) -> set[str]:
    hashed = {c.lower() for c in table.hash_columns or ()}
    return {c for c in table.key if c.lower() in hashed}


def typed_keys(
    schema: pa.Schema,
    key: Sequence[str],
    given: Sequence[Mapping[str, str]],
    hashed: Collection[str],
    salt: bytes,
) -> pa.Table:
    """The request's keys in the change log's types, one row each. A key naming other columns
    than the table's key, or a value that is not of its column's type, is refused, naming the
    key by its position and the column, never the value. A ``hashed`` key column's value is
    its stored hash (64 hex digits), or a string value, hashed as a file's string cell is."""
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
    arrays = {}
    for column in key:
        field = schema.field(column)
        texts = values[column]
        if column in hashed:
            clear = pa.array([None if _HASH.fullmatch(t) else t for t in texts], pa.string())
            hashes = hash_column(clear, salt).to_pylist()
            texts = [t if h is None else h for t, h in zip(texts, hashes, strict=True)]
        arrays[column] = _cast(texts, field)
    return pa.table(arrays)


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


def _scrub_forgotten(
    spark: SparkSession, paths: TablePaths, pk: list[str], typed: pa.Table, salt: bytes
) -> int:
    """Take the keys' rows out of the forgotten-events ledger (they name the key in the clear;
    the erased-keys ledger keeps the events out now). Each file holding one is rewritten as one
    file, so that its removal token stays one per file (``changelog.removal_committed``). A
    ledger keyed on fewer of the columns (a rekey added one since) loses every row of the
    erased key's values in those: more rows than the key's, never fewer."""
    from pyspark.sql import functions as F

    ledger = Table.open(paths.forgotten_events)
    if not ledger.files:
        return 0
    shared = [c for c in pk if c in changelog.ledger_key(ledger, pk)]
    if not shared:
        return 0
    cells = {c: typed.column(c).combine_chunks() for c in shared}
    types = pa.schema([typed.schema.field(c) for c in shared])
    mine = ErasedKeys.of({types: key_hashes(cells, typed.num_rows, salt).to_pylist()}, salt)
    rows = ledger.read(spark).withColumn(
        _FILE, table_relative(F.input_file_name(), ledger.location)
    )
    hits = mine.flag(rows, shared, GONE).filter(col(GONE)).groupBy(_FILE).count().collect()
    if not hits:
        return 0
    names = {r[_FILE] for r in hits}
    holding = [f for f in ledger.files if f.path in names]
    with ledger.committing() as rewrite:
        for f in holding:
            kept = mine.flag(ledger.read(spark, [f]), shared, GONE).filter(~col(GONE))
            rewrite.write(kept.drop(GONE).coalesce(1))
        removed = sum(int(r["count"]) for r in hits)
        rewrite.commit(delta.removes_for(holding), metadata={"cdc_platform.erased_rows": removed})
    return removed


def _scrub_quarantine(
    paths: TablePaths, given: Sequence[Mapping[str, str]], typed: pa.Table
) -> int:
    """Withhold every quarantine reason quoting one of the keys' values (as given, or as the
    column's type prints it): a reason quotes a cell as its file held it."""
    texts = {t for k in given for t in k.values()}
    texts |= {str(v) for c in typed.column_names for v in typed.column(c).to_pylist()}
    texts = {t for t in texts if t.strip()}  # an empty value would match between any words
    # A value as a word of its own: an id 1 is quoted as "1" or "'1'", not inside "row 12".
    quotes = [re.compile(r"(?<![\w.])" + re.escape(t) + r"(?![\w.])") for t in texts]
    rows = Ledger(paths.quarantine, quarantine.SCHEMA).rows()
    quoting = [r for r in rows if any(q.search(r["reason"] or "") for q in quotes)]
    if quoting:
        for r in quoting:
            r["reason"] = WITHHELD
        Ledger(paths.quarantine, quarantine.SCHEMA).replace(
            quoting, delta.in_predicate("file", sorted({r["file"] for r in quoting}))
        )
    return len(quoting)
