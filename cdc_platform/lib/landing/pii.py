"""Columns a source should never have exported: hashed or blocked as each file is read, before
any value reaches the change log, a table, a reason or a log (a table's ``hash_columns`` and
``block_columns``; docs/history-table.md, "Hashed and blocked columns").

A hashed cell is the SHA-256, in hex, of the keyring's salt followed by the value in the typed
byte form ``_fivetran_id`` uses (``row_id.value_encoder``): equal values hash equal across
tables, so equality joins still work, and without the salt, which the warehouse never holds, a
guessed value cannot be checked against it.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from cdc_platform.lib.landing.row_id import python_values, value_encoder

__all__ = ["hash_column"]


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
