"""The keys a data subject's request erased (``erase_key``; docs/history-table.md, "Erasing a
key"): never logged again, whatever file or operation delivers them.

One row per erased key, in ``<warehouse_root>/_cdc/<table>/erased_keys``, holding no value of
it: its hash, keyed by the keyring's ``hash_salt`` (an HMAC-SHA-256 of the key's
``_fivetran_id`` encoding), so that the ledger does not say which key it was to anyone
without the salt, even for a key space small enough to try every value. A table with
erased keys is therefore read only with the salt: without it, nothing is read (an erased key
could come back).

The ledger records the fingerprint of the salt its hashes were made with (the table property
``pii.SALT_PROPERTY``, an HMAC of a fixed label, never the salt), from its creation on: a run
whose keyring holds another salt (regenerated, restored from another backup) would recognise
no erased key, so it is refused before it reads (``load``). A ledger from before the
fingerprint records the keyring's salt at its next write (``add``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from cdc_platform.lib.columns import cols
from cdc_platform.lib.landing.decoding.keyring import Keyring, KeyringError
from cdc_platform.lib.landing.rows.pii import SALT_PROPERTY, check_salt, salt_fingerprint
from cdc_platform.lib.landing.rows.row_id import row_ids
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where
from cdc_platform.lib.storage.table import Table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SCHEMA = pa.schema(
    [
        pa.field("key_hash", pa.string()),
        # The key columns' types it was hashed in (an Arrow schema, IPC, base64): a key column
        # widened since (``schema.widest``) is cast back to them before it is hashed.
        pa.field("key_types", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("erased_at", pa.timestamp("us", tz="UTC")),
    ]
)
# The column ``ErasedKeys.found`` collects.
_FOUND = "_cdc_erased_key_hash"


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
    """The erased keys' hashes, by the key types they were hashed in, and the salt they are
    keyed with. Picklable: Spark ships it to the tasks, as it ships a reader's keys (inside the
    task closure, never in conf or logs)."""

    groups: tuple[tuple[pa.Schema, pa.Array], ...]  # key types, and the hashes in them
    salt: bytes

    @classmethod
    def of(cls, hashes: Mapping[pa.Schema, Collection[str]], salt: bytes) -> ErasedKeys:
        return cls(
            tuple((types, pa.array(sorted(h), pa.string())) for types, h in hashes.items()), salt
        )

    def __repr__(self) -> str:
        return f"ErasedKeys({sum(len(h) for _, h in self.groups)} key(s))"

    def matches(self, batch: pa.RecordBatch, key: Sequence[str]) -> pa.Array:
        """True for each row of ``batch`` whose key is erased: its key cells, in the types the
        erasure hashed them in, hash to a recorded hash."""
        hit = pa.array([False] * batch.num_rows, pa.bool_())
        for types, hashes in self.groups:
            cells = {c: _as_type(batch.column(c), types.field(c).type) for c in key}
            found = pc.is_in(key_hashes(cells, batch.num_rows, self.salt), value_set=hashes)  # pyright: ignore[reportAttributeAccessIssue]
            hit = pc.or_(hit, found)  # pyright: ignore[reportAttributeAccessIssue]
        return hit

    def which(self, batch: pa.RecordBatch, key: Sequence[str]) -> pa.Array:
        """Each row's recorded hash where its key is erased (``matches``), else null."""
        out = pa.nulls(batch.num_rows, pa.string())
        for types, hashes in self.groups:
            cells = {c: _as_type(batch.column(c), types.field(c).type) for c in key}
            mine = key_hashes(cells, batch.num_rows, self.salt)
            out = pc.if_else(pc.is_in(mine, value_set=hashes), mine, out)  # pyright: ignore[reportAttributeAccessIssue]
        return out

    def found(self, events: DataFrame, key: Sequence[str]) -> set[str]:
        """The recorded hashes some row of ``events`` has (one Spark job; hashes come back,
        never a value)."""
        from pyspark.sql.types import StringType, StructField, StructType

        pk = list(key)

        def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for batch in batches:
                yield pa.RecordBatch.from_arrays([self.which(batch, pk)], names=[_FOUND])

        out = StructType([StructField(_FOUND, StringType(), True)])
        hits = events.select(*cols(pk)).mapInArrow(run, out).dropna().distinct().collect()
        return {r[0] for r in hits}

    def drop(self, events: DataFrame, key: Sequence[str]) -> DataFrame:
        """``events`` without the rows of an erased key, in a Spark task."""
        return _map(events, key, self, keep=True)

    def flag(self, events: DataFrame, key: Sequence[str], name: str) -> DataFrame:
        """``events`` with a boolean column ``name``: true where the key is erased."""
        return _map(events, key, self, keep=False, name=name)


def _as_type(column: pa.Array, t: pa.DataType) -> pa.Array:
    """``column`` in type ``t``, as the erasure saw its key: a widened key column (a string
    now, a timestamp, a wider decimal) cast back; a value that does not cast is no erased key."""
    if column.type == t:
        return column
    try:
        return pc.cast(column, t)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    out = []
    for i in range(len(column)):
        try:
            out.append(pc.cast(column.slice(i, 1), t)[0].as_py())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            out.append(None)
    return pa.array(out, t)


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
    rows = ledger.read(["key_hash", "key_types"]).to_pylist()
    if not rows:
        return None
    by_types: dict[str, set[str]] = {}
    for r in rows:
        by_types.setdefault(r["key_types"], set()).add(r["key_hash"])
    salt = keyring.hash_salt if keyring is not None else None
    if salt is None:
        raise KeyringError(
            f"{path}: keys of this table were erased, and the keyring (CDC_KEYRING) has no "
            "hash_salt to recognise them: nothing is read without it"
        )
    _pin_salt(path, salt)  # a ledger from before the fingerprint: pinned now
    return ErasedKeys.of({_schema(t): h for t, h in by_types.items()}, salt)


def check_ledger_salt(path: Where, salt: bytes) -> Table:
    """Refuse ``salt`` if the ledger's hashes were made with another (``pii.check_salt``);
    the ledger as opened for it (one without a log when there is none yet)."""
    ledger = Table.open(path)
    check_salt(
        ledger.json_property(SALT_PROPERTY),
        salt,
        str(path),
        "the table's erased keys",
        "they would match no key, and a late file, a re-read hour, a re-sync or an adoption "
        "would log them again",
    )
    return ledger


def _schema(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def loader(path: Where, keyring: Keyring | None) -> Callable[[], ErasedKeys | None]:
    """``load``, asked again on each commit attempt of an append (as the revoked files are)."""
    return lambda: load(path, keyring)


def add(
    path: Where,
    hashes: Sequence[str],
    key_types: pa.Schema,
    reason: str,
    run_id: str,
    at: datetime,
    salt: bytes,
) -> int:
    """Record the key hashes (of keys in ``key_types``, made with ``salt``) not recorded yet,
    in one commit; returns how many were new. The salt's fingerprint is recorded first: with
    the ledger, or on a ledger from before it (refused if another salt's is recorded)."""
    _pin_salt(path, salt)
    types = base64.b64encode(key_types.serialize().to_pybytes()).decode("ascii")
    ledger = Ledger(path, SCHEMA)
    known = set(ledger.read(["key_hash"]).column(0).to_pylist()) if ledger.exists() else set()
    new = sorted(set(hashes) - known)
    ledger.append(
        [
            {"key_hash": h, "key_types": types, "reason": reason, "run_id": run_id, "erased_at": at}
            for h in new
        ]
    )
    return len(new)


def _pin_salt(path: Where, salt: bytes) -> None:
    """Refuse ``salt`` if another's fingerprint is recorded; otherwise record its fingerprint
    where none is: the ledger created empty with it, or a ledger from before it given it."""
    ledger = check_ledger_salt(path, salt)
    if ledger.json_property(SALT_PROPERTY) is not None:
        return
    value = json.dumps(salt_fingerprint(salt))
    if not ledger.exists:
        delta.ensure_table(path, SCHEMA, "cdc_platform erased keys", None, {SALT_PROPERTY: value})
    else:
        ledger.set_properties({SALT_PROPERTY: value})
