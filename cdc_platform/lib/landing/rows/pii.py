"""Columns a source should never have exported: hashed or blocked as each file is read, before
any value reaches the change log, a table, a reason or a log (a table's ``hash_columns`` and
``block_columns``; docs/history-table.md, "Hashed and blocked columns").

A hashed cell is the SHA-256, in hex, of the keyring's salt followed by the value in the typed
byte form ``_fivetran_id`` uses (``row_id.value_encoder``): equal values hash equal across
tables, so equality joins still work, and without the salt, which the warehouse never holds, a
guessed value cannot be checked against it.

A hashed cell depends on the salt and on its source type (an integer ``42`` and a string
``"42"`` hash apart), so both are recorded where the hashed values go: the salt by its
fingerprint (``salt_fingerprint``, never the salt), the source type on the column's field as a
file is inspected (``hashed_field``) and then with the change log's hashed-column list
(``history.protected_columns``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

import pyarrow as pa

from cdc_platform.lib.landing.decoding.keyring import KeyringError
from cdc_platform.lib.landing.rows.row_id import python_values, value_encoder

__all__ = [
    "SALT_PROPERTY",
    "SaltChangedError",
    "hash_column",
    "hashed_field",
    "hashed_source",
    "salt_fingerprint",
    "type_from_text",
    "type_text",
]

# What the salt's fingerprint is the HMAC of: a fixed label, so that the fingerprint says which
# salt it was (compared with the keyring's) and nothing of the salt itself.
_FINGERPRINT_LABEL = b"cdc_platform hash_salt fingerprint v1"
# The table property holding the fingerprint of the salt a table's hashes were made with (the
# erased-keys ledger's, the change log's for its hashed columns), as JSON text.
SALT_PROPERTY = "cdc_platform.hash_salt_fingerprint"
# The field metadata naming a hashed column's source type (``type_text``).
HASHED_FROM = b"cdc_platform.hashed_from"


class SaltChangedError(KeyringError):
    """The keyring's hash_salt is not the one a table's hashes were recorded under."""


def hash_column(values: pa.Array, salt: bytes) -> pa.Array:
    """Each non-null value salted and hashed; a null stays null."""
    encode = value_encoder(values.type)
    return pa.array(
        [
            None if v is None else hashlib.sha256(salt + encode(v)).hexdigest()
            for v in python_values(values)
        ],
        pa.string(),
    )


def salt_fingerprint(salt: bytes) -> str:
    """The salt's fingerprint: HMAC-SHA-256 of a fixed label under the salt, hex. Recorded
    beside what the salt hashed (erased keys, hashed columns), so a run whose keyring holds
    another salt is refused instead of matching nothing (docs/SECURITY.md)."""
    return hmac.new(salt, _FINGERPRINT_LABEL, hashlib.sha256).hexdigest()


def type_text(t: pa.DataType) -> str:
    """An Arrow type as text that ``type_from_text`` reads back exactly (an IPC schema)."""
    return base64.b64encode(pa.schema([pa.field("t", t)]).serialize().to_pybytes()).decode()


def type_from_text(text: str) -> pa.DataType:
    """The type ``type_text`` wrote; ValueError for text it did not write."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True))).field(0).type
    except (ValueError, pa.ArrowException, IndexError, KeyError):
        raise ValueError("not a type cdc_platform recorded") from None


def hashed_field(name: str, source: pa.DataType) -> pa.Field:
    """A hashed column's field (text), naming the type its values were hashed in."""
    return pa.field(name, pa.string(), metadata={HASHED_FROM: type_text(source)})


def hashed_source(field: pa.Field) -> pa.DataType | None:
    """The source type ``hashed_field`` recorded on ``field`` (None: none recorded)."""
    text = (field.metadata or {}).get(HASHED_FROM)
    return None if text is None else type_from_text(text.decode("ascii"))


def check_salt(recorded: object, salt: bytes, where: str, what: str, risk: str) -> None:
    """Refuse ``salt`` unless its fingerprint is the ``recorded`` one (None: nothing recorded
    yet, a table from before the fingerprint: accepted, and recorded by its next write).
    ``what`` the salt hashed, and the ``risk`` of going on with another salt."""
    if recorded is None or recorded == salt_fingerprint(salt):
        return
    raise SaltChangedError(
        f"{where}: the keyring's hash_salt (CDC_KEYRING) differs from the one {what} were "
        f"recorded under (the table property {SALT_PROPERTY} holds that salt's fingerprint): "
        f"{risk}. Nothing was read or written. Put the earlier hash_salt back in the keyring "
        '(docs/operating.md, "A changed hash salt").'
    )
