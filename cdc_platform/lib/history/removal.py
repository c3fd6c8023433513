"""What taking events out of the change log marks them with (``GONE``), and the marks an
operator's removal uses (``Change.remove`` in ``lib.history.table`` does the removal)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import col, cols, internal
from cdc_platform.lib.storage.table import Table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# The column a removal (``Change.remove``) sets on each change-log event: true if it goes.
GONE = internal("gone")


def fenced(log: Table, fence: bool, metadata_key: str) -> None:
    """Nothing to remove: commit an empty version if asked to fence off racing appends."""
    if fence:
        with log.committing() as empty:
            empty.commit(metadata={metadata_key: 0}, strict=True)


def marked_by(keys: DataFrame, primary_key: Sequence[str]) -> Callable[[DataFrame], DataFrame]:
    """A ``mark`` flagging every event of ``keys`` (the key columns and ``GONE``, decided
    beforehand: a flag from the event alone, as ``Change.remove`` needs)."""
    from pyspark.sql import functions as F

    pk = list(primary_key)

    def mark(events: DataFrame) -> DataFrame:
        return events.join(keys, pk, "left").select(
            *cols(events.columns), F.coalesce(col(GONE), F.lit(False)).alias(GONE)
        )

    return mark
