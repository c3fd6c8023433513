"""The keys a data subject's request erased (``erase_key``; docs/history-table.md, "Erasing a
key"): never logged again, whatever file or operation delivers them.

One row per erased key, in ``<warehouse_root>/_cdc/<table>/erased_keys``, holding no value of
it: its hash, keyed by the keyring's ``hash_salt`` (an HMAC-SHA-256 of the key's
``_fivetran_id`` encoding), so that the ledger does not say which key it was to anyone
without the salt, even for a key space small enough to try every value. A table with
erased keys is therefore read only with the salt: without it, nothing is read (an erased key
could come back).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.landing.keyring import Keyring, KeyringError
from cdc_platform.lib.landing.row_id import row_ids
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.storage.stores import Where

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SCHEMA = pa.schema(
    [
        pa.field("key_hash", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("erased_at", pa.timestamp("us", tz="UTC")),
    ]
)


def key_hashes(key: Mapping[str, pa.Array], rows: int, salt: bytes) -> pa.Array:
    """Each row's key hash: HMAC-SHA-256 (``salt``) of the key cells' ``_fivetran_id``, hex.

    A decimal is hashed by its value, not its scale (``1.50`` and ``1.5`` are one key), so a key
    column whose scale widens later still matches the hashes recorded before."""
    canonical = {name: _canonical(column) for name, column in key.items()}
    return pa.array(
        [
            hmac.new(salt, i.encode("ascii"), hashlib.sha256).hexdigest()
            for i in row_ids(canonical, rows).to_pylist()
        ],
        pa.string(),
    )


def _canonical(column: pa.Array) -> pa.Array:
    if not pa.types.is_decimal(column.type):
        return column
    values: list[Decimal | None] = column.to_pylist()
    return pa.array(
        [None if v is None else format(v.normalize(), "f") for v in values], pa.string()
    )


@dataclass(frozen=True)
class ErasedKeys:
    """The erased keys' hashes and the salt they are keyed with. Picklable: Spark ships it to
    the tasks, as it ships a reader's keys (inside the task closure, never in conf or logs)."""

    hashes: frozenset[str]
    salt: bytes

    def __repr__(self) -> str:
        return f"ErasedKeys({len(self.hashes)} key(s))"

    def matches(self, batch: pa.RecordBatch, key: Sequence[str]) -> pa.Array:
        """True for each row of ``batch`` whose key is erased."""
        hashes = key_hashes({c: batch.column(c) for c in key}, batch.num_rows, self.salt)
        return pc.is_in(hashes, value_set=pa.array(sorted(self.hashes), pa.string()))  # pyright: ignore[reportAttributeAccessIssue]

    def drop(self, events: DataFrame, key: Sequence[str]) -> DataFrame:
        """``events`` without the rows of an erased key, in a Spark task."""
        return _map(events, key, self, keep=True)

    def flag(self, events: DataFrame, key: Sequence[str], name: str) -> DataFrame:
        """``events`` with a boolean column ``name``: true where the key is erased."""
        return _map(events, key, self, keep=False, name=name)


def _map(
    events: DataFrame, key: Sequence[str], erased: ErasedKeys, keep: bool, name: str = ""
) -> DataFrame:
    from pyspark.sql.types import BooleanType, StructField, StructType

    pk = list(key)
    out = (
        events.schema
        if keep
        else StructType([*events.schema.fields, StructField(name, BooleanType(), False)])
    )

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            hit = erased.matches(batch, pk)
            if keep:
                yield batch.filter(pc.invert(hit))  # pyright: ignore[reportAttributeAccessIssue]
            else:
                yield pa.RecordBatch.from_arrays(
                    [*batch.columns, hit], names=[*batch.schema.names, name]
                )

    return events.mapInArrow(run, out)


def recorded(path: Where) -> bool:
    """Whether any key of the table was ever erased (its reads then need the salt)."""
    return Ledger(path, SCHEMA).exists()


def load(path: Where, keyring: Keyring | None) -> ErasedKeys | None:
    """The table's erased keys (None: none ever were). Raises KeyringError when some were and
    the keyring has no ``hash_salt``: a read without it could log an erased key again."""
    ledger = Ledger(path, SCHEMA)
    if not ledger.exists():
        return None
    hashes = frozenset(h for h in ledger.read(["key_hash"]).column(0).to_pylist() if h)
    if not hashes:
        return None
    salt = keyring.hash_salt if keyring is not None else None
    if salt is None:
        raise KeyringError(
            f"{path}: keys of this table were erased, and the keyring (CDC_KEYRING) has no "
            "hash_salt to recognise them: nothing is read without it"
        )
    return ErasedKeys(hashes, salt)


def loader(path: Where, keyring: Keyring | None) -> Callable[[], ErasedKeys | None]:
    """``load``, asked again on each commit attempt of an append (as the revoked files are)."""
    return lambda: load(path, keyring)


def add(path: Where, hashes: Sequence[str], reason: str, run_id: str, at: datetime) -> int:
    """Record the key hashes not recorded yet, in one commit; returns how many were new."""
    ledger = Ledger(path, SCHEMA)
    known = set(ledger.read(["key_hash"]).column(0).to_pylist()) if ledger.exists() else set()
    new = sorted(set(hashes) - known)
    ledger.append(
        [{"key_hash": h, "reason": reason, "run_id": run_id, "erased_at": at} for h in new]
    )
    return len(new)
