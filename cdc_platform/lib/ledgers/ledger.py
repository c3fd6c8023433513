"""A ledger: a small Delta table of facts the platform keeps about landing files.

The quarantine (``lib.ledgers.quarantine``), the files each partition was applied from
(``lib.ledgers.applied_files``) and the revoked files (``lib.ledgers.revoked_files``) are each a ledger: a few
rows per file, read whole, changed by one commit that replaces, adds or deletes some rows. A
ledger that was never written reads as empty and is created by its first rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location, Where


@dataclass(frozen=True)
class Ledger:
    path: Where
    schema: pa.Schema

    def exists(self) -> bool:
        return delta.exists(self.path)

    def read(self, columns: Sequence[str] | None = None) -> pa.Table:
        """Every row (``columns`` only, if given); none when the ledger was never written."""
        if not self.exists():
            schema = (
                self.schema
                if columns is None
                else pa.schema([self.schema.field(c) for c in columns])
            )
            return schema.empty_table()
        return delta.read_arrow(self.path, columns=columns)

    def rows(self) -> list[dict[str, Any]]:
        return self.read().to_pylist()

    def append(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Add ``rows`` in one commit (creating the ledger if need be)."""
        if rows:
            self._write(rows, mode="append")

    def replace(self, rows: Sequence[Mapping[str, Any]], where: str | None) -> None:
        """Put ``rows`` in place of the rows matching ``where`` (a delta-rs predicate, say
        ``delta.in_predicate``), in one commit. A ledger never written is created with
        ``rows``; ``where`` None replaces nothing in an existing one."""
        if not self.exists():
            self.append(rows)
        elif where is not None:
            self._write(rows, mode="overwrite", predicate=where)

    def delete(self, where: str) -> None:
        """Delete the rows matching ``where``, in one commit."""
        delta.open_table(self.path).delete(where)

    def _write(self, rows: Sequence[Mapping[str, Any]], **options: Any) -> None:
        from deltalake import write_deltalake

        loc = Location.of(self.path)
        if loc.is_local:
            loc.path.mkdir(parents=True, exist_ok=True)
        data = pa.Table.from_pylist(list(rows), schema=self.schema)
        # A column added to a ledger's schema (the applied files' ``etag``) is added to a
        # ledger written before it, its earlier rows null; the protocol stays reader 1 / writer 2.
        write_deltalake(
            loc.uri, data, storage_options=loc.storage_options, schema_mode="merge", **options
        )
