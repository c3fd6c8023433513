"""``matches_change_log``: a history table's versions verified against its change log, without
the writer's fold (docs/HISTORY_MODE.md section 6), and what the other invariants share with
it: each version beside its successor's start and its changed columns (``with_neighbours``),
a table's data columns, and the rows with a null key column."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from typing import TYPE_CHECKING

from cdc_platform.lib.columns import (
    ACTIVE,
    CHANGED,
    CURRENT,
    END,
    LAST_EVENT_AT,
    OP,
    SEQ,
    START,
    STATE_COLUMNS,
    SYNCED,
    TMAX_SQL,
    TS,
    UNMODIFIED,
    HistoryColumns,
    col,
    cols,
    internal,
    map_columns,
    quote,
    same_sql,
    string_sql,
    window_sql,
)
from cdc_platform.lib.history.versions import (
    RUNNING,
    dedupe_events,
    resolved_cell_sql,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def any_key_null(pk: list[str]) -> Column:
    return reduce(lambda a, b: a | b, [col(c).isNull() for c in pk])


NEXT_START = internal("next_start")
EXPECTED_CHANGED = internal("expected_changed")


def data_columns_of(table: DataFrame, pk: list[str]) -> list[str]:
    return [
        c
        for c in table.columns
        if c not in pk and c not in (START, END, ACTIVE, SYNCED, *STATE_COLUMNS)
    ]


def with_neighbours(table: DataFrame, pk: list[str], tracked: Sequence[str]) -> DataFrame:
    """Each version with its successor's start (None: the key's latest) and, when the table has
    ``_cdc_changed_columns``, the tracked columns that differ from its predecessor's (null
    on a key's first version): one sort of the rows by key and start, for every check that
    compares a version with its neighbours."""
    from pyspark.sql import functions as F

    by_start = window_sql(pk, [START])
    maps = map_columns(table.schema)
    neighbours = [F.expr(f"lead({quote(START)}) OVER ({by_start})").alias(NEXT_START)]
    if CHANGED in table.columns:
        first = F.expr(f"lag({quote(START)}) OVER ({by_start})").isNull()
        differing = [
            F.expr(
                f"CASE WHEN NOT ({same_sql(quote(c), f'lag({quote(c)}) OVER ({by_start})', c in maps)}) "
                f"THEN {string_sql(c)} END"
            )
            for c in tracked
        ]
        names = (
            F.filter(F.array(*differing), lambda n: n.isNotNull())
            if differing
            else F.array().cast("array<string>")
        )
        neighbours.append(F.when(~first, names).alias(EXPECTED_CHANGED))
    return table.select("*", *neighbours)


def mismatched_keys(
    pk: list[str],
    table: DataFrame,
    neighbours: DataFrame,
    events: DataFrame | None,
    history_columns: HistoryColumns,
    whole_table: bool = False,
) -> tuple[DataFrame, str]:
    """The keys whose versions disagree with the change log, and why when that is not per key
    (``matches_change_log``): the table against its change log, without the writer's fold
    (``history.build_versions``).

    The writer *derives* versions from events; this *verifies* the table's versions against the
    events, on one timeline per key that interleaves versions (at their start) and the key's
    event milliseconds ("steps"), with window functions only (linear in the key's rows). With
    each step's image (the image of its last non-delete event), a key fails when:

    1. a version starts at a millisecond without a non-delete event (spurious or shifted
       version; a key that has no events at all);
    2. after a step whose last event is not a delete, the version covering it (the latest one
       starting at or before it) is missing, ends before the step, or holds another image
       (a missing version, a wrong image, a lost key, an update applied to the wrong version);
    3. after a step that ends with a delete, the covering version still runs past it (a missed
       delete); if the step also had an image, that version must end exactly there and hold
       it (rule 5);
    4. a version follows one that handed over 1 ms before it (no delete in between) with the
       same image (a no-op version: duplicates and no-op updates make no history);
    5. a version's end or active flag differs from what its successor and the key's deletes
       imply (the next delete at or after its start, else the next version's start - 1 ms,
       else TMAX; active exactly when TMAX).

    With selective history, "image" in 2 and 4 means the tracked columns; a version's untracked
    columns must hold the image of the last step it covers (they are updated in place).

    Shared with the writer, so not caught: counting each (key, cdc_change_seq) once
    (``history.dedupe_events``: which copy of a seq wins) and resolving unmodified cells to the
    key's latest modified value before the event (rule 1). Never compared: _fivetran_synced.
    Over the whole table the keys are the change log's, so a key the table lost is caught too.
    """

    if events is None:
        return table, ""
    data_columns = data_columns_of(table, pk)
    missing = [c for c in data_columns if c not in events.columns]
    if missing:
        return table, f"columns {missing} are not in the change log"
    tracked = history_columns.tracked(data_columns)
    untracked = history_columns.untracked(data_columns)
    maps = map_columns(table.schema)
    if whole_table:  # every keyed event: a key the table lost is caught too
        keyed_events = events.filter(~any_key_null(pk))
    else:
        keyed_events = events.join(table.select(*cols(pk)).distinct(), pk, "left_semi")
    steps = _steps(dedupe_events(keyed_events, pk), pk, data_columns)
    timeline = _timeline(pk, table, steps, data_columns)
    step_fails = _step_fails(tracked, untracked, maps)
    version_fails = _version_fails(tracked, maps)
    failing = timeline.filter(f"({step_fails}) OR ({version_fails})").select(*cols(pk))
    if CURRENT in table.columns:
        failing = failing.unionByName(_state_mismatches(neighbours, events, pk))
    return failing, ""


# The timeline's working names: its instant, what a row is (0 a version, 1 a step) and each.
_T, _KIND, _VER, _STEP = "_cdc_tmp_t", "_cdc_tmp_kind", "_cdc_tmp_version", "_cdc_tmp_step"
_COV, _HAS_IMAGE, _ENDS_DELETED = "_cdc_tmp_covering", f"{_STEP}.has_image", f"{_STEP}.ends_deleted"
_TMAX = f"CAST('{TMAX_SQL}' AS TIMESTAMP)"


def _timeline(
    pk: list[str], table: DataFrame, steps: DataFrame, data_columns: list[str]
) -> DataFrame:
    """One timeline per key: its versions (at their start) and its event milliseconds
    (steps), with what each row needs to be judged, by window functions only. SQL text (names
    quoted, working names plain): a few JVM calls for what Column objects made hundreds of."""
    image = ", ".join(f"{quote(c)} AS {quote(c)}" for c in data_columns) or "true AS _"
    versions = table.selectExpr(
        *[quote(k) for k in pk],
        f"{quote(START)} AS {_T}",
        f"0 AS {_KIND}",
        f"named_struct('start', {quote(START)}, 'end', {quote(END)}, "
        f"'active', {quote(ACTIVE)}, 'img', struct({image})) AS {_VER}",
    )
    timeline = versions.unionByName(
        steps.selectExpr(
            *[quote(k) for k in pk],
            f"_cdc_tmp_ms AS {_T}",
            f"1 AS {_KIND}",
            "named_struct('has_image', _cdc_tmp_has_image, 'ends_deleted', "
            f"_cdc_tmp_ends_deleted, 'img', _cdc_tmp_img) AS {_STEP}",
        ),
        allowMissingColumns=True,
    )
    over = window_sql(pk, [_T, _KIND])
    rest = "ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING"
    deleted_at = f"CASE WHEN {_STEP}.ends_deleted THEN {_T} END"
    return timeline.selectExpr(
        "*",
        f"last({_VER}, true) OVER ({over} {RUNNING}) AS {_COV}",
        f"last({_VER}, true) OVER ({over} ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) "
        "AS _cdc_tmp_previous",
        f"first({deleted_at}, true) OVER "
        f"({over} ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS _cdc_tmp_next_delete",
        f"first({_VER}.`start`, true) OVER ({over} {rest}) AS _cdc_tmp_next_start",
        f"last({deleted_at}, true) OVER ({over} {RUNNING}) AS _cdc_tmp_last_delete",
        f"first(CASE WHEN {_STEP}.has_image THEN {_T} END, true) OVER ({over} {rest}) "
        "AS _cdc_tmp_next_image",
    )


def _step_fails(tracked: list[str], untracked: list[str], maps: frozenset[str]) -> str:
    """Rules 2 and 3 (and the untracked cells): a step the covering version does not hold."""
    cov, has_image, ends_deleted = _COV, _HAS_IMAGE, _ENDS_DELETED
    same = _same_image(f"{cov}.img", f"{_STEP}.img", tracked, maps)
    # A version may end in the millisecond it covers (its successor starts 1 ms later).
    fails = f"""{_KIND} = 1 AND (
        ({has_image} AND NOT {ends_deleted}
            AND ({cov} IS NULL OR NOT coalesce({cov}.`end` >= {_T}, false) OR NOT {same}))
        OR ({has_image} AND {ends_deleted}
            AND ({cov} IS NULL OR NOT coalesce({cov}.`end` = {_T}, false) OR NOT {same}))
        OR (NOT {has_image} AND coalesce({cov}.`end` > {_T}, false)))"""
    if not untracked:
        return fails
    # The last step with an image before the next version: its untracked cells are the
    # covering version's (every earlier one was overwritten in place).
    same_untracked = _same_image(f"{cov}.img", f"{_STEP}.img", untracked, maps)
    return f"""({fails}) OR ({_KIND} = 1 AND {has_image}
        AND (_cdc_tmp_next_image IS NULL
            OR coalesce(_cdc_tmp_next_image >= _cdc_tmp_next_start, false))
        AND ({cov} IS NULL OR NOT {same_untracked}))"""


def _version_fails(tracked: list[str], maps: frozenset[str]) -> str:
    """Rules 1, 4 and 5: a version no event starts, a no-op version, a wrong end or flag."""
    one_ms_before = f"{_T} - INTERVAL 1 MILLISECOND"
    expected_end = f"""(CASE
        WHEN _cdc_tmp_next_delete IS NOT NULL AND (_cdc_tmp_next_start IS NULL
            OR _cdc_tmp_next_delete < _cdc_tmp_next_start) THEN _cdc_tmp_next_delete
        WHEN _cdc_tmp_next_start IS NOT NULL THEN _cdc_tmp_next_start - INTERVAL 1 MILLISECOND
        ELSE {_TMAX} END)"""
    # Steps sort after the versions of their millisecond: the first step with an image after a
    # version is at its start exactly when a non-delete event is there.
    return f"""{_KIND} = 0 AND (
        NOT coalesce(_cdc_tmp_next_image = {_T}, false)
        OR (_cdc_tmp_previous IS NOT NULL
            AND coalesce(_cdc_tmp_previous.`end` = {one_ms_before}, false)
            AND NOT coalesce(_cdc_tmp_last_delete = {one_ms_before}, false)
            AND {_same_image("_cdc_tmp_previous.img", f"{_VER}.img", tracked, maps)})
        OR NOT ({_VER}.`end` <=> {expected_end})
        OR NOT ({_VER}.active <=> ({expected_end} = {_TMAX})))"""


def _steps(events: DataFrame, pk: list[str], data_columns: list[str]) -> DataFrame:
    """One row per (key, event millisecond): whether it had a non-delete event, whether its
    last event is a delete, and the image of its last non-delete event (unmodified cells
    resolved to the key's latest modified value before it)."""
    from pyspark.sql import functions as F

    ev = events.select(
        *cols(pk),
        *[col(c) for c in data_columns],
        F.col(SEQ).alias("_cdc_tmp_seq"),
        F.date_trunc("millisecond", F.col(TS)).alias("_cdc_tmp_ms"),
        (F.upper(F.col(OP)) == "DELETE").alias("_cdc_tmp_del"),
        F.coalesce(F.col(UNMODIFIED), F.array().cast("array<string>")).alias("_cdc_tmp_unmod"),
    )
    so_far = window_sql(pk, ["_cdc_tmp_ms", "_cdc_tmp_seq"], RUNNING)
    cells = [
        F.expr(resolved_cell_sql(c, "_cdc_tmp_del", "_cdc_tmp_unmod", so_far)).alias(c)
        for c in data_columns
    ]
    ev = ev.select(
        *cols(pk),
        "_cdc_tmp_seq",
        "_cdc_tmp_ms",
        "_cdc_tmp_del",
        _image(cells).alias("_cdc_tmp_img"),
    )
    # Working names only beside the key columns (a key column may be called ``ms`` or ``img``).
    return ev.groupBy(*cols(pk), "_cdc_tmp_ms").agg(
        F.max(~F.col("_cdc_tmp_del")).alias("_cdc_tmp_has_image"),
        F.max_by("_cdc_tmp_del", "_cdc_tmp_seq").alias("_cdc_tmp_ends_deleted"),
        F.max_by("_cdc_tmp_img", F.when(~F.col("_cdc_tmp_del"), F.col("_cdc_tmp_seq"))).alias(
            "_cdc_tmp_img"
        ),
    )


def _image(cells: list[Column]) -> Column:
    """A struct of the data cells (a constant one for a table with key columns only)."""
    from pyspark.sql import functions as F

    return F.struct(*cells) if cells else F.struct(F.lit(True).alias("_"))


def _same_image(a: str, b: str, data_columns: Sequence[str], maps: frozenset[str]) -> str:
    """SQL text: both images (expressions of working columns) present and equal column by
    column, NULL-safe (``same_sql``: ``maps`` by their sorted entries); never null."""
    same = [f"{a} IS NOT NULL", f"{b} IS NOT NULL"]
    same += [same_sql(f"{a}.{quote(c)}", f"{b}.{quote(c)}", c in maps) for c in data_columns]
    return f"coalesce({' AND '.join(same)}, false)"


def _state_mismatches(neighbours: DataFrame, events: DataFrame, pk: list[str]) -> DataFrame:
    """Keys whose state columns (which the merge's fast path trusts) break their definition:
    a key's latest version, and only it, is current and carries the millisecond of the key's
    last event; every other version has no last-event time; a version's changed columns are
    the tracked data columns that differ from the key's previous version (null on its
    first). ``neighbours``: the versions with ``with_neighbours``'s columns."""
    from pyspark.sql import functions as F

    last = events.groupBy(*cols(pk)).agg(
        F.max(F.date_trunc("millisecond", col(TS))).alias(internal("last_event"))
    )
    latest = col(NEXT_START).isNull()
    rows = neighbours.join(last, pk, "left")
    expected_last = F.when(latest, col(internal("last_event")))
    wrong = ~col(CURRENT).eqNullSafe(latest) | ~col(LAST_EVENT_AT).eqNullSafe(expected_last)
    if EXPECTED_CHANGED in neighbours.columns:
        wrong = wrong | ~col(CHANGED).eqNullSafe(col(EXPECTED_CHANGED))
    return rows.filter(wrong).select(*cols(pk))
