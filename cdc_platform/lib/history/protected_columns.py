"""The hashed and blocked columns a table was built with, recorded on its change log (the first
table an event reaches), so a config that changes them is refused instead of putting hashed
values beside cleartext (docs/history-table.md, "Hashed and blocked columns").

Changing them means rewriting every copy of the column (the change log, the history, the
current table): a run whose config names other lists is refused, naming both, and the job
``protect_columns`` (``lib.operations.protection``) rewrites the table.
A change log from before the property holds every column in the clear: only a config that
hashes and blocks nothing matches it.
"""

from __future__ import annotations

import json

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.storage.table import Table

PROTECTED_COLUMNS_PROPERTY = "cdc_platform.protected_columns"
# The lists a ``protect_columns`` run is bringing the change log to, set before it rewrites the
# log and reset to JSON null once the lists are recorded: while set, every run is refused.
PROTECTING_PROPERTY = "cdc_platform.protecting"
_NONE = {"hash": [], "block": []}


class ProtectedColumnsChangedError(ValueError):
    """The config hashes or blocks other columns than the table was built with."""


def protected_columns(table: TableConfig) -> dict[str, list[str]]:
    """The table's hashed and blocked columns, in one spelling (lower case, sorted)."""
    return {
        "hash": sorted(c.lower() for c in table.hash_columns or ()),
        "block": sorted(c.lower() for c in table.block_columns or ()),
    }


def changelog_properties(table: TableConfig) -> dict[str, str]:
    """What a new change log records (``Table.ensure``)."""
    return {PROTECTED_COLUMNS_PROPERTY: json.dumps(protected_columns(table))}


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
