"""Changing a table's hashed and blocked columns: ``protect_columns`` (docs/history-table.md,
"Hashed and blocked columns").

The lists are recorded on the change log; a run whose config names others is refused
(``protected_columns``). This job brings the table to the config's lists: the change log is
rewritten with each newly hashed column hashed (as a new file's cell would be, salt and typed
bytes) and each newly blocked column gone (a keyless table's ids computed again from the
rows so left, as a new file's are), its property recording the lists, and the history
is then rebuilt from it under the same key (``rekey.rebuild_table``: one overwrite commit,
fenced by a rebuild under way). The current table is refreshed from it. The cleartext stays in
the files those commits replaced, readable by time travel, until a VACUUM older than its
retention removes them (``table_maintenance``, 168 hours by default).

Refused, writing nothing: a column hashed before and not now (its cleartext is gone), a key
column newly hashed (every key would change: configure it hashed from the start), and a run
without the keyring's salt when a column is to be hashed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from cdc_platform.lib.columns import ROW_ID, cols
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import changelog, current_table
from cdc_platform.lib.history.merge import fault_point
from cdc_platform.lib.history.protected_columns import (
    PROTECTED_COLUMNS_PROPERTY,
    PROTECTING_PROPERTY,
    protected_columns,
    protecting,
    recorded_protected_columns,
)
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.table_key import PROTECT_JOB, Rekey, check_key, recorded_rekey
from cdc_platform.lib.landing.decoding.keyring import KeyringError
from cdc_platform.lib.landing.rows.pii import hash_column
from cdc_platform.lib.operations.operation import Request
from cdc_platform.lib.operations.rekey import (
    RekeyResult,
    check_history_columns,
    rebuild_table,
    refuse_erased_keys,
    rewrite_changelog,
    with_row_ids,
)
from cdc_platform.lib.storage.table import Table

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pyspark.sql import DataFrame, SparkSession

# What the change log's rewrite records in its commit, so a run after a crash knows the log
# already follows the lists even before its property says so.
REWRITTEN_TO = "cdc_platform.protected_columns"
# The crash-safety tests' point between the rewrite's commit and the one recording the lists.
AFTER_REWRITE_FAULT = "after_protected_log_rewrite"


class ProtectionError(Refusal):
    """The table cannot be brought to the config's lists; nothing was written."""


@dataclass(frozen=True)
class ProtectRequest(Request):
    """A protect asks nothing but its time: the lists are the config's."""


@dataclass(frozen=True)
class ProtectResult:
    before: dict[str, list[str]]
    after: dict[str, list[str]]
    changed: bool
    rebuild: RekeyResult | None = None

    def summary(self) -> str:
        if not self.changed:
            return "the table already follows its lists"
        return (
            f"rewritten hashing {self.after['hash']} and blocking {self.after['block']} (was "
            f"{self.before['hash']} and {self.before['block']}); the cleartext stays in "
            "replaced files until a VACUUM past the retention"
        )

    def metadata(self) -> dict[str, Any]:
        r = self.rebuild
        return {
            "operation": PROTECT_JOB,
            "hashed_before": self.before["hash"],
            "blocked_before": self.before["block"],
            "hashed": self.after["hash"],
            "blocked": self.after["block"],
            "old_rows_at_version": r.from_version if r else None,
            "delta_version": r.history_version if r else None,
        }

    @property
    def hours(self) -> tuple[datetime, ...]:
        return self.rebuild.hours if self.rebuild else ()


def protect(t: HistoryTable, request: ProtectRequest) -> ProtectResult:
    """Rewrite the table's change log, history and current table for the config's lists."""
    table, log, history = t.config, t.changelog, t.history
    wanted = protected_columns(table)
    if not log.exists:
        return ProtectResult(wanted, wanted, changed=False)  # its first run records them
    recorded = recorded_protected_columns(log)
    state = recorded_rekey(history)
    pending = state is not None and state.pending
    if recorded == wanted and protecting(log) is None and not pending:
        _refresh_current(t)  # a run that stopped before it, if any
        return ProtectResult(recorded, wanted, changed=False)
    salt = _refuse(t, recorded, wanted)
    if state is None or not pending:
        assert history.version is not None or not history.exists
        state = Rekey(history.version or 0, False, tuple(table.key), PROTECT_JOB)
    rewrite = partial(_protected_log, t.spark, table, wanted, salt)
    result = None
    if history.exists:
        result = rebuild_table(t, state, request.now, rewrite)
    else:
        rewrite(log)
    _refresh_current(t.refresh())
    return ProtectResult(recorded, wanted, changed=True, rebuild=result)


def _refresh_current(t: HistoryTable) -> None:
    """The current table from the history as it now is (it holds the old cells until then)."""
    if t.config.current_table and t.table(t.paths.current).exists:
        current_table.refresh(t)


def _refuse(
    t: HistoryTable, recorded: dict[str, list[str]], wanted: dict[str, list[str]]
) -> bytes | None:
    """What stops the change, before anything is written; the salt a newly hashed column
    needs (None: none is)."""
    paths, log, history, table = t.paths, t.changelog, t.history, t.config
    state = recorded_rekey(history)
    if state is not None and state.pending and state.job != PROTECT_JOB:
        raise ProtectionError(
            f"{paths.history}: a {state.job} run did not finish; launch {state.job} for the"
            " table again first. Nothing was written."
        )
    if state is None or not state.pending:
        check_key(history, table.key)  # a key change is rekey_table's
    under_way = protecting(log)
    if under_way is not None and under_way != wanted:
        raise ProtectionError(
            f"{log}: a protect_columns run to hash {under_way['hash']} and block"
            f" {under_way['block']} did not finish: set the config's lists to those and launch"
            " protect_columns again (then change them). Nothing was written."
        )
    unhashed = sorted(set(recorded["hash"]) - set(wanted["hash"]) - set(wanted["block"]))
    if unhashed:
        raise ProtectionError(
            f"{log}: the config no longer hashes {unhashed}, whose cleartext the table never"
            " kept: a hashed column stays hashed (or is blocked). Nothing was written."
        )
    newly = _newly_hashed(log, recorded, wanted)
    blocked = [n for n in log.arrow_schema.names if n.lower() in set(wanted["block"])]
    keys = sorted(c for c in newly if c.lower() in {k.lower() for k in table.key})
    if keys:
        raise ProtectionError(
            f"{log}: the config newly hashes key column(s) {keys}: every key of the table would"
            " change. Nothing was written; a key column is hashed from a table's first run."
        )
    _refuse_forgotten_ledger(t, [*newly, *blocked])
    if table.keyless and (newly or blocked):  # every id is computed again
        refuse_erased_keys(paths, ProtectionError, "rewriting a keyless table's ids")
    check_history_columns(paths, log, table, blocked)
    if not newly:
        return None
    salt = t.keyring.hash_salt if t.keyring is not None else None
    if salt is None:
        raise KeyringError(
            f"{log}: the config newly hashes {newly}, and the keyring has no hash_salt."
            " Nothing was written."
        )
    return salt


def _refuse_forgotten_ledger(t: HistoryTable, changed: list[str]) -> None:
    """The forgotten-events ledger names events by their key and seq (``changelog.forget``): a
    keyless table's ids all change, and a ledger column newly hashed or blocked would keep its
    cleartext and match no event, so forgotten events could be logged again."""
    paths, ledger = t.paths, t.table(t.paths.forgotten_events)
    if not ledger.files:
        return
    named = [c for c in changelog.ledger_key(ledger, t.key) if c in changed]
    if t.config.keyless or named:
        raise ProtectionError(
            f"{paths.forgotten_events}: a hard truncate or a re-sync removed events of this table"
            " for good, and the ledger that keeps them from being logged again names them by"
            f" {named or [ROW_ID]}, which this change rewrites. Nothing was written."
        )


def _newly_hashed(
    log: Table, recorded: dict[str, list[str]], wanted: dict[str, list[str]]
) -> list[str]:
    """The change log's columns the config hashes and the log holds in the clear."""
    hashed = set(wanted["hash"]) - set(recorded["hash"])
    return [n for n in log.arrow_schema.names if n.lower() in hashed]


def _protected_log(
    spark: SparkSession,
    table: TableConfig,
    wanted: dict[str, list[str]],
    salt: bytes | None,
    log: Table,
) -> Table:
    """Step 2 of the rebuild: the change log with the config's lists applied and recorded; as
    it is when it already follows them. The lists under way are set first (``protecting``), so a
    run after a crash finds them, and the rewrite's commit says it happened (never twice)."""
    recorded = recorded_protected_columns(log)
    if recorded == wanted and protecting(log) is None:
        return log
    assert log.dt is not None
    text = json.dumps(wanted)
    if protecting(log) is None:  # every run is refused from here until the lists are recorded
        log.set_properties({PROTECTING_PROPERTY: text})
        log = log.reopened()
        assert log.dt is not None
    if not rewritten_since_under_way(log, text):
        blocked = [n for n in log.arrow_schema.names if n.lower() in set(wanted["block"])]
        hashed = _newly_hashed(log, recorded, wanted)
        schema = pa.schema(
            [
                f.with_type(pa.string()) if f.name in hashed else f
                for f in log.arrow_schema
                if f.name not in blocked
            ]
        )
        events = _apply(log.read(spark).drop(*blocked), schema, hashed, salt)
        if ROW_ID in schema.names:  # a keyless table's ids: of the image as a new file's is
            rest = pa.schema([f for f in schema if f.name != ROW_ID])
            events = with_row_ids(events.drop(ROW_ID), rest)
        log = rewrite_changelog(log, events, schema, table.key, {REWRITTEN_TO: text})
        fault_point(AFTER_REWRITE_FAULT)
    log.set_properties({PROTECTED_COLUMNS_PROPERTY: text, PROTECTING_PROPERTY: "null"})
    return log.reopened()


def rewritten_since_under_way(log: Table, text: str) -> bool:
    """Whether a commit since the one that set the lists under way (``PROTECTING_PROPERTY``)
    rewrote the log to them (``REWRITTEN_TO``). Every commit since is read, not the latest
    alone: a VACUUM or any other tool may have committed after the rewrite, and hashing the
    log again would store hash(hash(x)). Read newest first, in growing pages."""
    assert log.dt is not None
    limit = _HISTORY_PAGE
    while True:
        entries = log.dt.history(limit=limit)
        for entry in entries:
            if entry.get(REWRITTEN_TO) == text:
                return True
            if _sets_under_way(entry):
                return False
        if len(entries) < limit:
            break
        limit *= 4
    raise ProtectionError(
        f"{log}: the commit that set {PROTECTING_PROPERTY} is no longer in the change log's"
        " history (its log entries were cleaned up), so whether the rewrite happened cannot be"
        " told: a second rewrite would hash hashed cells. Nothing was written; restore the"
        " change log from a backup taken before the protect_columns run, then launch it again."
    )


# Commits read per page of ``rewritten_since_under_way`` (few follow the lists under way).
_HISTORY_PAGE = 16


def _sets_under_way(entry: dict) -> bool:
    """A commit that set ``PROTECTING_PROPERTY`` to lists (delta-rs and Spark record the
    properties a SET TBLPROPERTIES set as a JSON object in its parameters)."""
    if entry.get("operation") != "SET TBLPROPERTIES":
        return False
    raw = (entry.get("operationParameters") or {}).get("properties")
    try:
        props = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return False
    value = props.get(PROTECTING_PROPERTY) if isinstance(props, dict) else None
    return isinstance(value, str) and value != "null"


def _apply(
    events: DataFrame, schema: pa.Schema, hashed: list[str], salt: bytes | None
) -> DataFrame:
    """``events`` with the ``hashed`` columns hashed as the reader hashes a file's
    (``pii.hash_column``), in a Spark task."""
    from pyspark.sql.pandas.types import from_arrow_schema

    if not hashed:
        return events
    assert salt is not None
    positions = {schema.get_field_index(n) for n in hashed}

    def hash_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            arrays = [
                hash_column(batch.column(i), salt) if i in positions else batch.column(i)
                for i in range(batch.num_columns)
            ]
            yield pa.RecordBatch.from_arrays(arrays, schema=schema)

    source = events.select(*cols(schema.names))
    return source.mapInArrow(hash_batches, from_arrow_schema(schema))
