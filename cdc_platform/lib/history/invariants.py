"""The SCD2 invariants of docs/HISTORY_MODE.md section 6, as Spark queries over a history table.

Each check returns how many keys fail and a few of them, so an alert can point at real rows.
A check can run over the whole table or only over the keys a materialization touched: those
its merge commit lists (a small run's; a correct merge changes no other key's rows, and copies
the rows it carries byte for byte), else those in the files the commits added or removed (an
added file holds every version of the keys it touched, and the carried rows of other keys too).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import reduce
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import (
    ACTIVE,
    END,
    OP,
    SOURCE_FILE,
    START,
    TS,
    HistoryColumns,
    col,
    cols,
    internal,
)
from cdc_platform.lib.history import joins, table_key
from cdc_platform.lib.history.merge import TOUCHED_KEYS
from cdc_platform.lib.history.reconciliation import (
    NEXT_START,
    any_key_null,
    data_columns_of,
    mismatched_keys,
    with_neighbours,
)
from cdc_platform.lib.history.versions import tmax_literal
from cdc_platform.lib.ledgers import quarantine, revoked_files
from cdc_platform.lib.spark.session import (
    ADAPTIVE,
    BROADCAST_THRESHOLD,
    SHUFFLE_PARTITIONS,
    conf_restored,
    interpreted,
    persisted,
)
from cdc_platform.lib.storage.table import Table
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

SAMPLE_SIZE = 5
MAX_LISTED_FILES = 100  # quarantined file names a no_quarantined_files result lists
ONE_TASK_KEYS = 1_000
# What a check's sample says instead of key values for an encrypted table: its keys are
# decrypted data, and samples reach the UI, logs and alerts.
REDACTED = "redacted (encrypted table)"

ONE_ACTIVE = "one_active_version_per_key"
ACTIVE_IFF_OPEN = "active_iff_open_ended"
START_NOT_AFTER_END = "start_not_after_end"
NO_OVERLAP = "versions_do_not_overlap"
CONTIGUOUS = "closed_versions_are_contiguous"
PK_NOT_NULL = "primary_key_not_null"
UNIQUE_KEY_START = "unique_key_and_start"
NO_QUARANTINE = "no_quarantined_files"
MATCHES_CHANGELOG = "matches_change_log"
NO_REVOKED = "no_revoked_events"

DESCRIPTIONS = {
    ONE_ACTIVE: "At most one version of each key is active.",
    ACTIVE_IFF_OPEN: "A version is active exactly when its _fivetran_end is TMAX.",
    START_NOT_AFTER_END: "_fivetran_start <= _fivetran_end, both set.",
    NO_OVERLAP: "The versions of a key do not overlap in time.",
    CONTIGUOUS: "A closed version ends 1 ms before its successor starts, or at a delete of its key.",
    PK_NOT_NULL: "No primary key column is null.",
    UNIQUE_KEY_START: "(primary key, _fivetran_start) is unique.",
    NO_QUARANTINE: "No landing file of this table is set aside in the quarantine.",
    MATCHES_CHANGELOG: (
        "Each version's start, image, end and active flag agree with the key's events in the "
        "change log, checked without the writer's fold: no version without a non-delete event "
        "at its start, none missing where the image changed or the key came back, no missed "
        "delete, no no-op version. Not caught: which copy of a duplicated cdc_change_seq wins "
        "and how unmodified cells resolve (shared with the writer); _fivetran_synced."
    ),
    NO_REVOKED: "The change log holds no event of a landing file that a user un-applied.",
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
    # no_quarantined_files: every file set aside (the first MAX_LISTED_FILES by name), so the
    # check alert can name each file once, when it first appears.
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scope:
    """The keys a check verifies; ``values``: the few a run's merge commit named (a one-column
    key), held on the driver so that every read is a filter."""

    keys: DataFrame
    values: list[Any] | None = None

    @property
    def listed(self) -> bool:
        return self.values is not None


def touched_keys(
    spark: SparkSession, paths: TablePaths, primary_key: Sequence[str], since_version: int | None
) -> Scope | None:
    """The keys the commits after ``since_version`` changed: those they list (a small run's
    merge), else those in the files the history table gained since (None: no scope, all keys)."""
    from pyspark.sql.types import StructType

    history = Table.open(paths.history)
    if history.dt is None:
        return None
    schema = history.spark_schema
    listed = _listed_keys(history.dt, since_version, list(primary_key))
    if listed is not None and _fit(listed, schema[primary_key[0]].dataType):
        key_schema = StructType([schema[primary_key[0]]])
        keys = spark.createDataFrame([(v,) for v in listed], key_schema)
        return Scope(keys, values=listed)
    return _keys_in_files_since(spark, paths, history, primary_key, since_version)


def _keys_in_files_since(
    spark: SparkSession,
    paths: TablePaths,
    history: Table,
    primary_key: Sequence[str],
    since_version: int | None,
) -> Scope | None:
    """The keys in the files the history table gained or lost after ``since_version`` (a lost
    file's keys: rows another writer removed change no added file); None when no file from
    before is left (a first load, a rebuild, every file removed: the whole-table checks cost
    less than a scope of every key, and see keys the table lost), or when a lost file is gone
    from storage (vacuumed: its keys are unknown)."""
    now = history.files
    old = []
    if since_version is not None and since_version >= 0:
        old = history.at(since_version).files
    before, after = {f.path for f in old}, {f.path for f in now}
    if not before & after:
        return None
    added = [f for f in now if f.path not in before]
    removed = [f for f in old if f.path not in after]
    if removed and not history.stored(removed):
        return None
    changed = added + removed
    keys = history.read(spark, changed).select(*cols(list(primary_key)))
    return Scope(keys.distinct() if changed else keys)


def _listed_keys(dt: DeltaTable, since_version: int | None, pk: list[str]) -> list[Any] | None:
    """The keys the commits after ``since_version`` recomputed, when each of them lists its
    keys (``merge.TOUCHED_KEYS``: a small run's merge); None when one does not (another
    operation, another engine, a large run): then the files added since give the scope."""
    if since_version is None or since_version < 0 or len(pk) != 1:
        return None
    newer = dt.version() - since_version
    if newer <= 0:
        return None
    keys: set[Any] = set()
    seen: set[Any] = set()
    for commit in dt.history(limit=newer):
        seen.add(commit.get("version"))
        try:
            values = json.loads(commit[TOUCHED_KEYS])
        except (KeyError, TypeError, ValueError):
            return None
        if not isinstance(values, list) or not all(joins.is_plain_key(v) for v in values):
            return None
        keys.update(values)
    if seen != set(range(since_version + 1, dt.version() + 1)):
        return None  # a commit without its record (another engine, a cleaned log): unknown
    return sorted(keys, key=lambda v: (str(type(v)), v))


def _fit(values: list[Any], key_type: DataType) -> bool:
    """Whether listed key values are exactly of the key column's type and range (else the
    commit's list is not trusted, and the files give the scope)."""
    from pyspark.sql.types import ByteType, IntegerType, LongType, ShortType, StringType

    bits = {ByteType: 8, ShortType: 16, IntegerType: 32, LongType: 64}.get(type(key_type))
    if bits is not None:
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return all(
            isinstance(v, int) and joins.is_plain_key(v) and low <= v <= high for v in values
        )
    return isinstance(key_type, StringType) and all(isinstance(v, str) for v in values)


def _recorded_or(history: Table, primary_key: Sequence[str]) -> list[str]:
    """The key the table records; the config's for a table from before the property, or one
    whose property another tool wrote (the runs refuse that one, with its reason)."""
    try:
        return table_key.recorded_key(history) or list(primary_key)
    except table_key.PrimaryKeyChangedError:
        return list(primary_key)


def run_checks(
    spark: SparkSession,
    paths: TablePaths,
    primary_key: Sequence[str],
    scope: Scope | None = None,
    *,
    hide_keys: bool = False,
) -> list[CheckOutcome]:
    """Every invariant over the table, or over the keys in ``scope`` only.

    The checks verify the table under the key it records (``table_key``): a config that names
    another key is refused by every run, and the table's versions follow its own key.
    ``hide_keys`` (an encrypted table): a failing check's sample holds ``REDACTED``, never a
    key value; the counts are unchanged."""
    log = Table.open(paths.changelog)  # each opened once, read by every check
    outcomes = [_quarantine_check(paths), _revoked_check(spark, paths, log)]
    history = Table.open(paths.history)
    pk = _recorded_or(history, primary_key)
    if history.dt is None:
        return outcomes + [
            CheckOutcome(n, True, 0, detail="table not created yet")
            for n in CHECK_NAMES
            if n not in (NO_QUARANTINE, NO_REVOKED)
        ]
    dt = history.dt
    table = history.read(spark)
    events = log.read(spark) if log.exists else None
    with (
        conf_restored(spark, ADAPTIVE, BROADCAST_THRESHOLD, SHUFFLE_PARTITIONS),
        ExitStack() as kept,
    ):
        if scope is not None and scope.values is not None:
            table, events = _listed_rows(spark, table, events, pk, scope.values, kept)
        else:
            if scope is not None:
                table = table.join(scope.keys, pk, "left_semi")
            # Every check scans these rows: read the files once, before the checks' query (its
            # stages run side by side and would each compute the same cached partitions).
            table = kept.enter_context(persisted(table))
            table.count()
        failing = _failing_keys(
            pk, table, events, HistoryColumns.of_table(dt), whole_table=scope is None
        )
        outcomes += _evaluate(failing, table, pk, hide_keys)
    order = {n: i for i, n in enumerate(CHECK_NAMES)}
    return sorted(outcomes, key=lambda o: order[o.name])


def _listed_rows(
    spark: SparkSession,
    table: DataFrame,
    events: DataFrame | None,
    pk: list[str],
    values: list[Any],
    kept: ExitStack,
) -> tuple[DataFrame, DataFrame | None]:
    """The table's and the change log's rows of a small run's keys, read once by one Spark job
    (an ``IN`` filter each), for a query that plans every check whole into one more job.

    Adaptive execution and broadcasts would each add jobs of their own. Up to
    ``ONE_TASK_KEYS`` keys, each side is one partition: a key's rows are sorted in one task
    anyway, and a plan over single partitions needs no shuffle before its windows, joins and
    groupings, and it runs ``interpreted``. Called inside ``conf_restored``; both stay cached,
    and the code generation off, until ``kept`` closes.
    """
    from pyspark.sql import functions as F

    spark.conf.set(ADAPTIVE, "false")
    spark.conf.set(BROADCAST_THRESHOLD, "-1")
    where = joins.in_keys(pk, values)
    table = table.filter(where)
    events = events.filter(where) if events is not None else None
    if len(values) <= ONE_TASK_KEYS:
        spark.conf.set(SHUFFLE_PARTITIONS, "1")
        kept.enter_context(interpreted(spark))
        # After the filter, so the files are still scanned in parallel.
        table = table.repartition(1)
        events = events.repartition(1) if events is not None else None
    table = kept.enter_context(persisted(table))
    if events is None:
        table.count()
        return table, None
    events = kept.enter_context(persisted(events))
    table.select(F.lit(1)).union(events.select(F.lit(1))).count()  # one job fills both
    return table, events


@dataclass(frozen=True)
class _Failing:
    """The keys failing one invariant: a query, run with all the others (``_evaluate``)."""

    name: str
    keys: DataFrame
    detail: str = ""


def _evaluate(
    failing: list[_Failing], table: DataFrame, pk: list[str], hide_keys: bool
) -> list[CheckOutcome]:
    """Count every check's failing keys, and the keys checked, in one query; sample the keys of
    the checks that fail (a query each, only then)."""
    from pyspark.sql import functions as F

    tag = internal("check")
    branches = [table.select(*cols(pk), F.lit(-1).alias(tag))]
    branches += [f.keys.select(*cols(pk), F.lit(i).alias(tag)) for i, f in enumerate(failing)]
    tagged = reduce(lambda a, b: a.unionByName(b), branches).distinct()
    counts = {r[tag]: int(r["count"]) for r in tagged.groupBy(tag).count().collect()}
    outcomes = []
    for i, f in enumerate(failing):
        n = counts.get(i, 0)
        sample: list[Any] = []
        if n and hide_keys:
            sample = [REDACTED]
        elif n:
            keys = f.keys.select(*cols(pk)).distinct().limit(SAMPLE_SIZE).collect()
            sample = [_key(r, pk) for r in keys]
        outcomes.append(CheckOutcome(f.name, n == 0, n, sample, counts.get(-1, 0), f.detail))
    return outcomes


def _failing_keys(
    pk: list[str],
    table: DataFrame,
    events: DataFrame | None,
    history_columns: HistoryColumns,
    whole_table: bool,
) -> list[_Failing]:
    """The invariants of the history rows in ``table`` (the whole table or a scope's keys),
    each as the query of its failing keys; ``events``: the change log (None: not created)."""
    from pyspark.sql import functions as F

    # Column objects, or SQL text with every name quoted (``quote``): a key name is data (a
    # backtick in it must not end it).
    any_null = any_key_null(pk)
    keyed = table.filter(~any_null)
    open_ended = F.col(END).eqNullSafe(tmax_literal())
    tracked = history_columns.tracked(data_columns_of(keyed, pk))
    pairs = with_neighbours(keyed, pk, tracked)
    return [
        _Failing(PK_NOT_NULL, table.filter(any_null)),
        _Failing(ONE_ACTIVE, _repeated(keyed.filter(F.col(ACTIVE)), pk)),
        _Failing(
            ACTIVE_IFF_OPEN, keyed.filter(~F.coalesce(F.col(ACTIVE) == open_ended, F.lit(False)))
        ),
        _Failing(
            START_NOT_AFTER_END,
            keyed.filter(~F.coalesce(F.col(START) <= F.col(END), F.lit(False))),
        ),
        _Failing(UNIQUE_KEY_START, _repeated(keyed, [*pk, START])),
        _Failing(NO_OVERLAP, pairs.filter(F.col(NEXT_START) <= F.col(END))),
        _contiguity(pk, pairs, events),
        _Failing(
            MATCHES_CHANGELOG,
            *mismatched_keys(pk, keyed, pairs, events, history_columns, whole_table=whole_table),
        ),
    ]


def _repeated(rows: DataFrame, columns: list[str]) -> DataFrame:
    """The values of ``columns`` that more than one row holds (a working name for the count:
    a key column may be called ``count``)."""
    from pyspark.sql import functions as F

    n = internal("rows")
    return rows.groupBy(*cols(columns)).agg(F.count(F.lit(1)).alias(n)).filter(col(n) > 1)


def _contiguity(pk: list[str], pairs: DataFrame, events: DataFrame | None) -> _Failing:
    """A version that does not hand over to its successor 1 ms later must end at a delete."""
    from pyspark.sql import functions as F

    one_ms = F.expr("INTERVAL 1 MILLISECOND")
    tmax = tmax_literal()
    needs_delete = pairs.filter(
        F.col(END).isNotNull()
        & ~F.col(END).eqNullSafe(tmax)
        & (F.col(NEXT_START).isNull() | ~(F.col(END) == F.col(NEXT_START) - one_ms))
    )
    if events is None:
        return _Failing(CONTIGUOUS, needs_delete)
    deletes = (
        events.filter(F.upper(F.col(OP)) == "DELETE")
        .select(*cols(pk), F.date_trunc("millisecond", F.col(TS)).alias(END))
        .distinct()
    )
    return _Failing(CONTIGUOUS, needs_delete.join(deletes, [*pk, END], "left_anti"))


def _quarantine_check(paths: TablePaths) -> CheckOutcome:
    entries = quarantine.current(paths.quarantine)
    sample = [{"file": e.file, "reason": e.reason} for e in entries[:SAMPLE_SIZE]]
    files = tuple(e.file for e in entries[:MAX_LISTED_FILES])
    return CheckOutcome(NO_QUARANTINE, not entries, len(entries), sample, files=files)


def _revoked_check(spark: SparkSession, paths: TablePaths, log: Table) -> CheckOutcome:
    """Events of revoked files left in the change log, per file. Costs nothing when no file
    was ever revoked; then reads only the log files whose ``_cdc_source_file`` statistics
    admit a revoked name. The history table follows the log: ``matches_change_log`` covers it."""
    from pyspark.sql import functions as F

    names = revoked_files.revoked_names(paths.revoked_files)
    files = [f for f in log.files if revoked_files.may_hold(f, names)] if names else []
    if not files:
        return CheckOutcome(NO_REVOKED, True, 0)
    left = (
        log.read(spark, files)
        .filter(col(SOURCE_FILE).isin(sorted(names)))
        .groupBy(SOURCE_FILE)
        .agg(F.count(F.lit(1)).alias("events"))
        .orderBy(SOURCE_FILE)
        .collect()
    )
    sample = [{"file": r[SOURCE_FILE], "events": int(r["events"])} for r in left[:SAMPLE_SIZE]]
    detail = f"{len(left)} revoked file(s) still have events in the change log" if left else ""
    return CheckOutcome(NO_REVOKED, not left, len(left), sample, detail=detail)


def _key(row: Any, pk: list[str]) -> Any:
    values = [row[c] for c in pk]
    return values[0] if len(values) == 1 else values
