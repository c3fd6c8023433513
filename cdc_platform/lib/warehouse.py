"""Where a table's Delta tables live in the warehouse.

``<warehouse_root>/<table>`` is the history table users query. Beside it, under
``<warehouse_root>/_cdc/<table>/``, the platform keeps what it needs to stay correct:
``changelog`` (every valid event ever landed, so late events can be placed and any key
recomputed), ``quarantine`` (files set aside, with the reason) and ``delete_only_keys``
(keys whose every event so far is a delete: they have no row in the history table).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TablePaths:
    history: Path
    changelog: Path
    quarantine: Path
    delete_only_keys: Path

    @classmethod
    def of(cls, warehouse_root: Path, table: str) -> TablePaths:
        root = Path(warehouse_root)
        system = root / "_cdc" / table
        return cls(
            history=root / table,
            changelog=system / "changelog",
            quarantine=system / "quarantine",
            delete_only_keys=system / "delete_only_keys",
        )
