"""The primary key a history table was folded under, recorded on the table (docs/HISTORY_MODE.md,
"The key is part of the table").

Every version of the table is a version *of a key*: rows 1-3 of the contract hold per key. A run
that folded new events under another key would put versions of two different keys side by side
in one table, and nothing would say so. So the key is recorded as a table property the first
time the merge commits, and every run, before it writes anything, compares the config's key with
the table's: a different one is refused, naming both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from cdc_platform.lib.columns import ROW_ID
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.storage.table import Table

# The history table's property recording the key its versions are folded under: a JSON list.
PRIMARY_KEY_PROPERTY = "cdc_platform.primary_key"
# A key's property is a short list of names; anything longer was not written by the platform.
MAX_KEY_CHARS = 10_000
# The last rekey_table run: {"from_version": <history version before it>, "pending": <bool>}.
REKEY_PROPERTY = "cdc_platform.rekey"
# The operator jobs that rebuild a table's history from its change log: changing its key
# (``lib.operations.rekey``), and its hashed and blocked columns (``lib.operations.protect``).
REKEY_JOB = "rekey_table"
PROTECT_JOB = "protect_columns"
REBUILD_JOBS = (REKEY_JOB, PROTECT_JOB)


class PrimaryKeyChangedError(Refusal):
    """The config names another primary key than the one the history table was folded under."""


def to_json(primary_key: Sequence[str]) -> str:
    """The key as the table records it: its columns in the config's order."""
    return json.dumps(list(primary_key), ensure_ascii=True)


def recorded_key(table: Table) -> list[str] | None:
    """The key the table says its versions follow; None for a table that predates the property
    (or does not exist yet). A property that is not a list of names (an edit by another tool)
    is refused rather than guessed at."""
    try:
        raw = table.json_property(PRIMARY_KEY_PROPERTY, MAX_KEY_CHARS)
    except ValueError:
        raw = False  # not JSON: refused below
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(isinstance(c, str) for c in raw):
        raise PrimaryKeyChangedError(
            f"{table}: the table property {PRIMARY_KEY_PROPERTY} is not a list of column names;"
            " it was not written by cdc_platform. Nothing was written."
        )
    return raw


@dataclass(frozen=True)
class Rekey:
    """What the table records of its last ``rekey_table`` run (``REKEY_PROPERTY``): the history
    version before it (the old key's rows, readable by time travel) and that key, and whether
    the run is still under way (its first commit names the new key, its last says done)."""

    from_version: int
    pending: bool
    from_key: tuple[str, ...]
    job: str = REKEY_JOB  # the job whose rebuild it is (``REBUILD_JOBS``)

    def to_json(self) -> str:
        return json.dumps(
            {
                "from_version": self.from_version,
                "pending": self.pending,
                "from_key": self.from_key,
                "job": self.job,
            }
        )


def recorded_rekey(table: Table) -> Rekey | None:
    """The table's last rekey (None: never rekeyed); another tool's value is refused."""
    try:
        raw = table.json_property(REKEY_PROPERTY, 2 * MAX_KEY_CHARS)
    except ValueError:
        raw = False
    if raw is None:
        return None
    if (
        not isinstance(raw, dict)
        or sorted(raw) != ["from_key", "from_version", "job", "pending"]
        or raw["job"] not in REBUILD_JOBS
        or type(raw["from_version"]) is not int
        or type(raw["pending"]) is not bool
        or not isinstance(raw["from_key"], list)
        or not raw["from_key"]
        or not all(isinstance(c, str) for c in raw["from_key"])
    ):
        raise PrimaryKeyChangedError(
            f"{table}: the table property {REKEY_PROPERTY} was not written by cdc_platform."
            " Nothing was written."
        )
    return Rekey(raw["from_version"], raw["pending"], tuple(raw["from_key"]), raw["job"])


def same_key(a: Sequence[str], b: Sequence[str]) -> bool:
    """The same columns, in any order (a key's order does not change which rows are one key).
    Letter case counts: landing files are matched to the key's names as written, so ``ID``
    where the table says ``id`` would set every file aside; it is refused here instead."""
    return sorted(a) == sorted(b)


def check_key(history: Table, primary_key: Sequence[str]) -> None:
    """Refuse a run whose config names another key than the history table records, or that
    comes while a ``rekey_table`` run is unfinished (before the run writes anything). A table
    without the property is not refused: the merge records the config's key on its next commit
    (``record_settings``)."""
    recorded = recorded_key(history)
    rekey = recorded_rekey(history)
    if rekey is not None and rekey.pending:
        raise PrimaryKeyChangedError(
            f"{history}: a {rekey.job} run (the history rebuilt under {named(recorded or [])})"
            f" did not finish (the table property {REKEY_PROPERTY}). Nothing was written. Launch"
            f" {rekey.job} for the table again: it rebuilds the history from the change log."
        )
    if recorded is None or same_key(recorded, primary_key):
        return
    raise PrimaryKeyChangedError(
        f"{history}: the config's key is {named(primary_key)}, but the history table's"
        f" versions are folded under {named(recorded)} (its property {PRIMARY_KEY_PROPERTY})."
        f" Nothing was written. Set the config back to {named(recorded)}, or launch the"
        f" {REKEY_JOB} job for the table to rebuild its history under the config's key."
    )


def named(key: Sequence[str]) -> str:
    """A key as the config says it (a keyless table's key is its row id)."""
    return "keyless: true" if list(key) == [ROW_ID] else f"primary_key: {list(key)}"
