"""Which events made each history version: a lookup into the change log, no extra columns.

A version of a key starts at the millisecond of the events that opened it (contract, rules 1
and 3), and the change log keeps every event with where it came from. So ``(key,
_fivetran_start)`` finds them: the key's logged events whose commit timestamp, truncated to the
millisecond, equals the version's start. In seq order, the non-deletes among them built the
version's image (the last one's values win, cell by cell); a delete among them, last, closed the
version at once (rule 5). Each event carries its landing file (relative to the landing root),
its row in that file (1-based, header not counted), its ``cdc_change_seq`` and
``_cdc_ingested_at``: the ``_fivetran_synced`` of the run that logged it, which that run's
materialization in Dagster records as ``synced_at``.

On a table with selective history (``track_history_columns`` / ``ignore_history_columns``) a
version also takes the untracked cells of the later events it covers, so its events are every
event from its start to its end, inclusive.

Nothing is stored for this: the change log is the record, so provenance never disagrees with it
(``matches_change_log`` checks the table against the same log).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_platform.lib.columns import (
    ACTIVE,
    END,
    INGESTED_AT,
    OP,
    SEQ,
    SOURCE_FILE,
    SOURCE_ROW,
    START,
    TS,
    HistoryColumns,
    col,
    cols,
    internal,
)
from cdc_platform.lib.errors import Refusal

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from cdc_platform.lib.history.merge.snapshot import Opener

EVENTS = "_cdc_events"  # the column of the lookup's result that holds a version's events


class NoHistoryError(Refusal, LookupError):
    """The table has no history (or no change log) yet: there is nothing to trace."""


def version_sources(t: Opener, keys: DataFrame | None = None) -> DataFrame:
    """Every version (primary key, ``_fivetran_start``, ``_fivetran_end``,
    ``_fivetran_active``) with ``_cdc_events``: its opening events (on a selective table, every
    event it covers) in seq order, each a struct
    of ``cdc_change_seq``, ``cdc_operation_type``, ``cdc_commit_timestamp``,
    ``_cdc_source_file``, ``_cdc_source_row`` and ``_cdc_ingested_at``.

    ``keys`` (a DataFrame of primary-key columns) limits the lookup to those keys. Lazy: filter
    or join before collecting on a large table.
    """
    from pyspark.sql import functions as F

    spark, pk = t.spark, list(t.config.key)
    history, log = t.fresh(t.paths.history), t.fresh(t.paths.changelog)  # both as they are now
    if not history.exists or not log.exists:
        raise NoHistoryError(f"no history table at {t.paths.history} yet: materialize it first")
    versions = history.read(spark).select(*cols([*pk, START, END, ACTIVE]))
    events = log.read(spark)
    if keys is not None:
        versions = versions.join(keys.select(*cols(pk)), pk, "left_semi")
        events = events.join(keys.select(*cols(pk)), pk, "left_semi")
    fields = [SEQ, OP, TS, SOURCE_FILE, SOURCE_ROW, INGESTED_AT]
    by_ms = events.select(
        *cols(pk),
        F.date_trunc("millisecond", col(TS)).alias(START),
        F.struct(*cols(fields)).alias(EVENTS),
    )
    assert history.dt is not None  # it exists (checked above)
    if HistoryColumns.of_table(history.dt).tracks_everything:
        grouped = by_ms.groupBy(*cols([*pk, START])).agg(
            F.array_sort(F.collect_list(col(EVENTS))).alias(EVENTS)  # structs sort by seq first
        )
        return versions.join(grouped, [*pk, START], "left")
    # Selective history: untracked cells come from any event the version covers.
    at = internal("event_ms")
    covered = by_ms.withColumnRenamed(START, at)
    on = [versions[k] == covered[k] for k in pk]
    joined = versions.join(
        covered,
        [*on, covered[at] >= versions[START], covered[at] <= versions[END]],
        "left",
    )
    return joined.groupBy(*[versions[c] for c in [*pk, START, END, ACTIVE]]).agg(
        F.array_sort(F.collect_list(covered[EVENTS])).alias(EVENTS)
    )
