"""The hashed and blocked columns a table was built with, recorded on its change log (the first
table an event reaches), so a config that changes them is refused instead of putting hashed
values beside cleartext (docs/history-table.md, "Hashed and blocked columns").

Changing them means rewriting every copy of the column (the change log, the history, the
current table): a run whose config names other lists is refused, naming both, and the job
``protect_columns`` (``lib.operations.protect``) rewrites the table.
A change log from before the property holds every column in the clear: only a config that
hashes and blocks nothing matches it.

How its hashed cells were made is recorded beside the lists: the fingerprint of the salt
(``pii.SALT_PROPERTY``; a run with another salt is refused before it reads, ``check_salt``: its
cells would hash apart from the history's) and each hashed column's source types
(``HASHED_TYPES_PROPERTY``: the erasure hashes a cleartext in each, as a file's cell of that
type was hashed). Both are written with the change log, and before an append that brings a
type not recorded yet (``record_hashing``); a change log from before them records them at its
next append.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import pyarrow as pa

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.rows.pii import (
    SALT_PROPERTY,
    check_salt,
    hashed_source,
    salt_fingerprint,
    type_from_text,
    type_text,
)
from cdc_platform.lib.storage.table import Table

PROTECTED_COLUMNS_PROPERTY = "cdc_platform.protected_columns"
# The lists a ``protect_columns`` run is bringing the change log to, set before it rewrites the
# log and reset to JSON null once the lists are recorded: while set, every run is refused.
PROTECTING_PROPERTY = "cdc_platform.protecting"
_NONE = {"hash": [], "block": []}
# Each hashed column's source types (lower-case name -> sorted ``pii.type_text``s), JSON.
HASHED_TYPES_PROPERTY = "cdc_platform.hashed_types"


class ProtectedColumnsChangedError(Refusal):
    """The config hashes or blocks other columns than the table was built with."""


def protected_columns(table: TableConfig) -> dict[str, list[str]]:
    """The table's hashed and blocked columns, in one spelling (lower case, sorted)."""
    return {
        "hash": sorted(c.lower() for c in table.hash_columns or ()),
        "block": sorted(c.lower() for c in table.block_columns or ()),
    }


def changelog_properties(
    table: TableConfig,
    salt: bytes | None = None,
    schemas: Iterable[pa.Schema | None] = (),
) -> dict[str, str]:
    """What a new change log records (``Table.ensure``): the lists and, for a table that
    hashes, how (the ``salt``'s fingerprint, the source types of the batch's ``schemas``)."""
    out = {PROTECTED_COLUMNS_PROPERTY: json.dumps(protected_columns(table))}
    if salt is not None and table.hash_columns:
        out[SALT_PROPERTY] = json.dumps(salt_fingerprint(salt))
        out[HASHED_TYPES_PROPERTY] = json.dumps(_as_json(source_types(schemas)))
    return out


def source_types(schemas: Iterable[pa.Schema | None]) -> dict[str, set[pa.DataType]]:
    """The source types of the hashed columns of inspected files' ``schemas`` (as the reader
    marks them, ``pii.hashed_field``), by lower-case column name."""
    out: dict[str, set[pa.DataType]] = {}
    for schema in schemas:
        for field in schema or ():
            source = hashed_source(field)
            if source is not None:
                out.setdefault(field.name.lower(), set()).add(source)
    return out


def hashed_types(changelog: Table) -> dict[str, list[pa.DataType]]:
    """The source types the change log records per hashed column (lower-case name; a column
    missing: none recorded, a log from before the property)."""
    try:
        raw = changelog.json_property(HASHED_TYPES_PROPERTY)
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise ValueError(raw)
        return {str(c): [type_from_text(t) for t in ts] for c, ts in raw.items()}
    except (ValueError, TypeError):
        raise ProtectedColumnsChangedError(
            f"{changelog}: the table property {HASHED_TYPES_PROPERTY} was not written by "
            "cdc_platform. Nothing was written."
        ) from None


def record_hashing(
    log: Table, table: TableConfig, salt: bytes | None, schemas: Iterable[pa.Schema | None]
) -> None:
    """Before an append to an existing change log (``log``, as it is now): the source types
    its batch (``schemas``) brings that the log does not record yet, and the salt's
    fingerprint if the log has none (one from before it), in one metadata commit; none when
    both are recorded."""
    if salt is None or not table.hash_columns or not log.exists:
        return
    recorded = {c: set(ts) for c, ts in hashed_types(log).items()}
    merged = {c: set(ts) for c, ts in recorded.items()}
    for column, types in source_types(schemas).items():
        merged.setdefault(column, set()).update(types)
    changes = {}
    if merged != recorded:
        changes[HASHED_TYPES_PROPERTY] = json.dumps(_as_json(merged))
    if log.json_property(SALT_PROPERTY) is None:
        changes[SALT_PROPERTY] = json.dumps(salt_fingerprint(salt))
    if changes:
        log.set_properties(changes)


def _as_json(types: Mapping[str, Iterable[pa.DataType]]) -> dict[str, list[str]]:
    return {c: sorted({type_text(t) for t in ts}) for c, ts in sorted(types.items())}


def check_hashing_salt(changelog: Table, table: TableConfig, keyring: Keyring | None) -> None:
    """Refuse a run whose keyring's hash_salt is not the one the change log's hashed columns
    were hashed with (``pii.check_salt``), before it reads a file. A run without a salt is
    refused by the reader; a log without a fingerprint records one at its next append."""
    salt = keyring.hash_salt if keyring is not None else None
    hashed = recorded_protected_columns(changelog)["hash"]
    if salt is None or not hashed or not changelog.exists:
        return
    check_salt(
        changelog.json_property(SALT_PROPERTY),
        salt,
        str(changelog),
        f"the table's hashed columns {hashed}",
        "the cells of new files would hash apart from the history's, and a key of a hashed "
        "column would become another key",
    )


def check_protected_columns(changelog: Table, table: TableConfig) -> None:
    """Refuse a run whose config hashes or blocks other columns than the change log records
    (before the run writes anything)."""
    if changelog.dt is None:
        return
    if protecting(changelog) is not None:
        raise ProtectedColumnsChangedError(
            f"{changelog}: a protect_columns run did not finish (the table property"
            f" {PROTECTING_PROPERTY}). Nothing was written. Launch protect_columns for the table"
            " again."
        )
    recorded = recorded_protected_columns(changelog)
    wanted = protected_columns(table)
    if recorded == wanted:
        return
    raise ProtectedColumnsChangedError(
        f"{changelog}: the config hashes {wanted['hash']} and blocks {wanted['block']}, but the"
        f" table was built hashing {recorded['hash']} and blocking {recorded['block']} (its"
        f" property {PROTECTED_COLUMNS_PROPERTY}). Nothing was written. Set hash_columns and"
        " block_columns back, or launch the protect_columns job for the table to rewrite it"
        " with the config's lists."
    )


def recorded_protected_columns(changelog: Table) -> dict[str, list[str]]:
    """The lists the change log records (none hashed or blocked for a log from before)."""
    lists = _lists(changelog, PROTECTED_COLUMNS_PROPERTY)
    return _NONE if lists is None else lists


def protecting(changelog: Table) -> dict[str, list[str]] | None:
    """The lists an unfinished ``protect_columns`` run is bringing the log to (None: none)."""
    return _lists(changelog, PROTECTING_PROPERTY)


def _lists(changelog: Table, name: str) -> dict[str, list[str]] | None:
    try:
        raw = changelog.json_property(name)
    except ValueError:
        raw = False  # not JSON: refused below
    if raw is None:
        return None
    if (
        not isinstance(raw, dict)
        or sorted(raw) != ["block", "hash"]
        or not all(isinstance(v, list) and all(isinstance(c, str) for c in v) for v in raw.values())
    ):
        raise ProtectedColumnsChangedError(
            f"{changelog}: the table property {name} was not written by cdc_platform. Nothing"
            " was written."
        )
    return {"hash": sorted(raw["hash"]), "block": sorted(raw["block"])}
