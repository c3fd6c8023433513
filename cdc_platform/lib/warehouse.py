"""Where a table's Delta tables live in the warehouse.

``<warehouse_root>/<table>`` is the history table users query. Beside it, under
``<warehouse_root>/_cdc/<table>/``, the platform keeps what it needs to stay correct:
``changelog`` (every valid event ever landed, so late events can be placed and any key
recomputed), ``quarantine`` (files set aside, with the reason) and ``delete_only_keys``
(keys whose every event so far is a delete: they have no row in the history table).
The warehouse root may be a local folder or an object store (``lib.storage``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc_platform.lib.storage import Location, Where


@dataclass(frozen=True)
class TablePaths:
    """The four Delta tables of one table; each a ``Location`` with the warehouse's options."""

    history: Location
    changelog: Location
    quarantine: Location
    delete_only_keys: Location

    @classmethod
    def of(cls, warehouse_root: Where, table: str) -> TablePaths:
        root = Location.of(warehouse_root)
        system = root / "_cdc" / table
        return cls(
            history=root / table,
            changelog=system / "changelog",
            quarantine=system / "quarantine",
            delete_only_keys=system / "delete_only_keys",
        )
