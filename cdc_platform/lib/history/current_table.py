"""A table's current table: the active rows of its history table as a plain (SCD1) Delta table.

``<warehouse_root>/<table>_current`` holds one row per live key with the key and data columns
only, for users who want the live table rather than its history. Each refresh reads the history
table's latest snapshot (its live files only, ``read.current``) and replaces the whole current
table in **one Delta commit** that removes every old file, adds the new ones and, when the
history table gained a column, widens the schema, so a reader sees the old content or the
new, never a mix. The commit records which history version it
reflects (commit metadata ``cdc_platform.history_version``). Replaced files stay for time
travel until the table's VACUUM (``lib/operations/maintenance.py``) deletes them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pyarrow as pa

from cdc_platform.lib.columns import ROW_ID, col, cols, is_reserved
from cdc_platform.lib.errors import PlatformError
from cdc_platform.lib.history import reads
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.schema import spark_schema

if TYPE_CHECKING:
    from cdc_platform.lib.history.merge.snapshot import Opener

HISTORY_VERSION = "cdc_platform.history_version"


@dataclass(frozen=True)
class CurrentTableResult:
    rows: int
    version: int
    history_version: int
    files_added: int
    files_removed: int
    attempts: int


DESCRIPTION = "cdc_platform current table (active rows, SCD1)"


class CurrentTableClashError(PlatformError, RuntimeError):
    """The current table's folder holds another table (a name the platform derives collides)."""


def refresh(t: Opener) -> CurrentTableResult:
    """Replace the current table of ``t`` (the table's handle) with the history table's active
    rows; retry if another writer commits to it first (each attempt reads both anew)."""
    result, attempts = delta.with_commit_retries(
        lambda: _refresh_once(t), f"current table {t.paths.current}"
    )
    return replace(result, attempts=attempts)


def _refresh_once(t: Opener) -> CurrentTableResult:
    from pyspark.sql import functions as F

    spark, paths, primary_key = t.spark, t.paths, t.config.key
    history = t.fresh(paths.history)
    if history.version is None:
        raise FileNotFoundError(
            f"history table {paths.history} does not exist yet: materialize it first"
        )
    live_rows = sum(f.num_records or 0 for f in history.files if reads.may_hold(f, None))
    # Key and data columns: every name outside the platform's `_fivetran_`/`_cdc_` spaces,
    # and a keyless table's key, `_fivetran_id`.
    user = pa.schema(
        [f for f in history.arrow_schema if not is_reserved(f.name) or f.name == ROW_ID]
    )
    current = t.fresh(paths.current)
    if not current.exists:
        current = current.ensure(user, DESCRIPTION)
    dt = current.dt
    assert dt is not None
    if dt.metadata().description != DESCRIPTION:
        # Another table's (a discovered `<table>_current`, say): never overwritten, vacuumed.
        raise CurrentTableClashError(
            f"{paths.current} holds a Delta table this platform did not write as the current "
            f"table of {paths.history} ({dt.metadata().description or 'no description'}): it "
            "is not overwritten. Turn current_table off for the table, or move that table away"
        )
    # Columns are only ever added, as in the history table: the table's own, then new ones; but
    # a keyless table's id, once it is keyed again (``rekey_table``): the history has none.
    existing = pa.schema(
        [f for f in current.arrow_schema if f.name != ROW_ID or ROW_ID in user.names]
    )
    # A column the history table widened takes its wider type (the commit below sets it).
    schema = pa.schema(
        [
            *(user.field(f.name) if f.name in user.names else f for f in existing),
            *(f for f in user if f.name not in existing.names),
        ]
    )
    # The version just opened, not "the latest" again: the commit records what it reflects.
    live = reads.Reads.of(history).current(spark)
    types = spark_schema(schema)
    rows = live.select(
        *(
            col(f.name)
            if f.name in user.names
            else F.lit(None).cast(types[f.name].dataType).alias(f.name)
            for f in schema
        )
    )
    n = delta.file_count_for(live_rows)
    pk = cols(list(primary_key))
    shaped = rows.repartitionByRange(n, *pk) if n > 1 else rows.coalesce(1)
    with current.committing() as replace:
        adds = replace.write(shaped.sortWithinPartitions(*pk))
        version = replace.commit(
            schema=schema,
            metadata={HISTORY_VERSION: history.version},
            strict=True,
            overwrite=True,
        )
    return CurrentTableResult(
        rows=sum(delta.num_records(a) for a in adds),
        version=version,
        history_version=history.version,
        files_added=len(adds),
        files_removed=len(current.files),
        attempts=1,
    )
