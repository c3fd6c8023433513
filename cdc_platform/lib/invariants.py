"""The SCD2 invariants of HISTORY_MODE.md section 5, as Spark queries over a history table.

Each check returns how many keys fail and a few of them, so an alert can point at real rows.
A check can run over the whole table or only over the keys a materialization touched (any
file the commit added holds every version of the keys it touched, so that scope is exact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_platform.lib import changelog, delta, quarantine
from cdc_platform.lib.columns import (
    ACTIVE,
    CURRENT,
    END,
    LAST_EVENT_AT,
    OP,
    START,
    STATE_COLUMNS,
    SYNCED,
    TS,
    col,
    cols,
    internal,
)
from cdc_platform.lib.history import build_versions, tmax_literal
from cdc_platform.lib.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SAMPLE_SIZE = 5

ONE_ACTIVE = "one_active_version_per_key"
ACTIVE_IFF_OPEN = "active_iff_open_ended"
START_NOT_AFTER_END = "start_not_after_end"
NO_OVERLAP = "versions_do_not_overlap"
CONTIGUOUS = "closed_versions_are_contiguous"
PK_NOT_NULL = "primary_key_not_null"
UNIQUE_KEY_START = "unique_key_and_start"
NO_QUARANTINE = "no_quarantined_files"
MATCHES_CHANGELOG = "matches_change_log"

DESCRIPTIONS = {
    ONE_ACTIVE: "At most one version of each key is active.",
    ACTIVE_IFF_OPEN: "A version is active exactly when its _fivetran_end is TMAX.",
    START_NOT_AFTER_END: "_fivetran_start <= _fivetran_end, both set.",
    NO_OVERLAP: "The versions of a key do not overlap in time.",
    CONTIGUOUS: "A closed version ends 1 ms before its successor starts, or at a delete of its key.",
    PK_NOT_NULL: "No primary key column is null.",
    UNIQUE_KEY_START: "(primary key, _fivetran_start) is unique.",
    NO_QUARANTINE: "No landing file of this table is set aside in the quarantine.",
    MATCHES_CHANGELOG: "The table equals what the change log implies, for the keys checked.",
}
CHECK_NAMES = tuple(DESCRIPTIONS)


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    failing: int
    sample: list[Any] = field(default_factory=list)
    checked_keys: int | None = None
    detail: str = ""


def touched_keys(
    spark: SparkSession, paths: TablePaths, primary_key: Sequence[str], since_version: int | None
) -> DataFrame | None:
    """Keys in files the history table gained after ``since_version`` (None: no scope, all keys)."""
    if not delta.exists(paths.history):
        return None
    dt = delta.open_table(paths.history)
    now = delta.snapshot_files(dt)
    before: set[str] = set()
    if since_version is not None and since_version >= 0:
        before = {
            f.path
            for f in delta.snapshot_files(delta.open_table(paths.history, version=since_version))
        }
    added = [f for f in now if f.path not in before]
    schema = changelog.spark_schema(delta.table_arrow_schema(dt))
    if not added:
        return spark.createDataFrame([], schema).select(*primary_key)
    return (
        spark.read.schema(schema)
        .parquet(*delta.absolute_paths(paths.history, added))
        .select(*primary_key)
        .distinct()
    )


def run_checks(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    scope: DataFrame | None = None,
) -> list[CheckOutcome]:
    """Every invariant over the table, or over the keys in ``scope`` only."""
    from pyspark.sql import functions as F

    pk = list(primary_key)
    outcomes = [_quarantine_check(paths)]
    if not delta.exists(paths.history):
        return outcomes + [
            CheckOutcome(n, True, 0, detail="table not created yet")
            for n in CHECK_NAMES
            if n != NO_QUARANTINE
        ]
    dt = delta.open_table(paths.history)
    schema = changelog.spark_schema(delta.table_arrow_schema(dt))
    files = delta.snapshot_files(dt)
    table = (
        spark.read.schema(schema).parquet(*delta.absolute_paths(paths.history, files))
        if files
        else spark.createDataFrame([], schema)
    )
    if scope is not None:
        table = table.join(scope, pk, "left_semi")
    checked = table.select(*pk).distinct().count()

    def outcome(name: str, failing_rows: DataFrame, detail: str = "") -> CheckOutcome:
        keys = failing_rows.select(*pk).distinct()
        n = keys.count()
        sample = [_key(r, pk) for r in keys.limit(SAMPLE_SIZE).collect()] if n else []
        return CheckOutcome(name, n == 0, n, sample, checked, detail)

    tmax = tmax_literal()
    outcomes.append(outcome(PK_NOT_NULL, table.filter(" OR ".join(f"`{c}` IS NULL" for c in pk))))
    keyed = table.filter(" AND ".join(f"`{c}` IS NOT NULL" for c in pk))
    outcomes.append(
        outcome(ONE_ACTIVE, keyed.filter(F.col(ACTIVE)).groupBy(*pk).count().filter("count > 1"))
    )
    open_ended = F.col(END).eqNullSafe(tmax)
    outcomes.append(
        outcome(
            ACTIVE_IFF_OPEN, keyed.filter(~F.coalesce(F.col(ACTIVE) == open_ended, F.lit(False)))
        )
    )
    outcomes.append(
        outcome(
            START_NOT_AFTER_END, keyed.filter(~F.coalesce(F.col(START) <= F.col(END), F.lit(False)))
        )
    )
    outcomes.append(
        outcome(UNIQUE_KEY_START, keyed.groupBy(*pk, START).count().filter("count > 1"))
    )

    pairs = _consecutive_pairs(keyed, pk)
    outcomes.append(outcome(NO_OVERLAP, pairs.filter(F.col("_next_start") <= F.col(END))))
    outcomes.append(_contiguity(spark, paths, pk, keyed, pairs, outcome))
    outcomes.append(_reconciliation(spark, paths, pk, keyed, outcome, whole_table=scope is None))
    order = {n: i for i, n in enumerate(CHECK_NAMES)}
    return sorted(outcomes, key=lambda o: order[o.name])


def _consecutive_pairs(table: DataFrame, pk: list[str]) -> DataFrame:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(*pk).orderBy(START)
    return table.withColumn("_next_start", F.lead(START).over(w))


def _contiguity(
    spark: SparkSession,
    paths: TablePaths,
    pk: list[str],
    table: DataFrame,
    pairs: DataFrame,
    outcome: Callable[..., CheckOutcome],
) -> CheckOutcome:
    """A version that does not hand over to its successor 1 ms later must end at a delete."""
    from pyspark.sql import functions as F

    one_ms = F.expr("INTERVAL 1 MILLISECOND")
    tmax = tmax_literal()
    needs_delete = pairs.filter(
        F.col(END).isNotNull()
        & ~F.col(END).eqNullSafe(tmax)
        & (F.col("_next_start").isNull() | ~(F.col(END) == F.col("_next_start") - one_ms))
    )
    events = changelog.read(spark, paths.changelog)
    if events is None:
        return outcome(CONTIGUOUS, needs_delete)
    deletes = (
        events.filter(F.upper(F.col(OP)) == "DELETE")
        .select(*pk, F.date_trunc("millisecond", F.col(TS)).alias(END))
        .distinct()
    )
    return outcome(CONTIGUOUS, needs_delete.join(deletes, [*pk, END], "left_anti"))


def _reconciliation(
    spark: SparkSession,
    paths: TablePaths,
    pk: list[str],
    table: DataFrame,
    outcome: Callable[..., CheckOutcome],
    whole_table: bool = False,
) -> CheckOutcome:
    """Recompute the checked keys from the change log; any difference (but synced) fails.

    Over the whole table the keys are the change log's, so a key the table lost is caught too.
    """
    events = changelog.read(spark, paths.changelog)
    if events is None:
        return outcome(MATCHES_CHANGELOG, table)
    columns = [c for c in table.columns if c != SYNCED]
    data_columns = [
        c for c in columns if c not in pk and c not in (START, END, ACTIVE, *STATE_COLUMNS)
    ]
    keys = (events if whole_table else table).select(*pk).distinct()
    missing = [c for c in data_columns if c not in events.columns]
    if missing:
        return outcome(MATCHES_CHANGELOG, table, f"columns {missing} are not in the change log")
    keyed_events = events.join(keys, pk, "left_semi")
    expected = _with_expected_state(
        build_versions(keyed_events, pk, data_columns), keyed_events, pk
    ).select(*cols(columns))
    actual = table.select(*columns)
    diff = expected.exceptAll(actual).unionByName(actual.exceptAll(expected))
    return outcome(MATCHES_CHANGELOG, diff)


def _with_expected_state(versions: DataFrame, events: DataFrame, pk: list[str]) -> DataFrame:
    """The state columns the merge's fast path relies on, from their definition: a key's
    latest version is current and carries the millisecond of the key's last event."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    last = events.groupBy(*cols(pk)).agg(
        F.max(F.date_trunc("millisecond", col(TS))).alias(internal("last_event"))
    )
    by_start = Window.partitionBy(*cols(pk)).orderBy(col(START).desc())
    return (
        versions.withColumn(CURRENT, F.row_number().over(by_start) == 1)
        .join(last, pk, "left")
        .withColumn(LAST_EVENT_AT, F.when(col(CURRENT), col(internal("last_event"))))
        .drop(internal("last_event"))
    )


def _quarantine_check(paths: TablePaths) -> CheckOutcome:
    entries = quarantine.current(paths.quarantine)
    sample = [{"file": e.file, "reason": e.reason} for e in entries[:SAMPLE_SIZE]]
    return CheckOutcome(NO_QUARANTINE, not entries, len(entries), sample)


def _key(row: Any, pk: list[str]) -> Any:
    values = [row[c] for c in pk]
    return values[0] if len(values) == 1 else values
