"""Where a table's Delta tables live in the warehouse.

``<warehouse_root>/<table>`` is the history table users query. Beside it, under
``<warehouse_root>/_cdc/<table>/``, the platform keeps what it needs to stay correct:
``changelog`` (every valid event ever landed, so late events can be placed and any key
recomputed), ``quarantine`` (files set aside, with the reason), ``delete_only_keys``
(keys whose every event so far is a delete: they have no row in the history table),
``revoked_files`` (landing files a user un-applied: never applied again unless re-admitted),
``retracted_keys`` (keys whose events an un-apply removed, until the merge recomputed them)
``forgotten_events`` (the events a hard truncate or a re-sync removed: never logged again)
and ``erased_keys`` (the keys a data subject's request erased, by salted hash: never logged again).
The warehouse root may be a local folder or an object store (``lib.storage.stores``).

``<warehouse_root>/<table>_current`` is the table's optional current table (``current_table:
true`` in the config): the active rows only, one per live key, with the key and data columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc_platform.lib.storage.stores import Location, Where


@dataclass(frozen=True)
class TablePaths:
    """The Delta tables of one table; each a ``Location`` with the warehouse's options."""

    history: Location
    changelog: Location
    quarantine: Location
    delete_only_keys: Location
    revoked_files: Location
    retracted_keys: Location
    forgotten_events: Location
    erased_keys: Location
    current: Location

    @classmethod
    def of(cls, warehouse_root: Where, table: str) -> TablePaths:
        root = Location.of(warehouse_root)
        system = root / "_cdc" / table
        return cls(
            history=root / table,
            changelog=system / "changelog",
            quarantine=system / "quarantine",
            delete_only_keys=system / "delete_only_keys",
            revoked_files=system / "revoked_files",
            retracted_keys=system / "retracted_keys",
            forgotten_events=system / "forgotten_events",
            erased_keys=system / "erased_keys",
            current=root / current_table_name(table),
        )


def current_table_name(table: str) -> str:
    """The name of a table's current table: its folder in the warehouse and its asset key."""
    return f"{table}_current"
