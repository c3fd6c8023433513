"""The names and types of the CDC, system and internal columns, in one place.

* CDC columns: the three change columns every landing file carries.
* System columns: what the platform adds. ``_fivetran_*`` in the history table, ``_cdc_*``
  in the change log. A source column may not use either prefix (``_cdc_unmodified``, the
  CSV reader's list of unmodified cells, is the one ``_cdc_`` column a decoded file carries).
* Internal columns: the fold's and the merge's working columns. They live under
  ``INTERNAL_PREFIX``, itself under the reserved ``_cdc_`` prefix, so they can never collide
  with a source column, whatever it is called.

``HistoryColumns`` says which data columns keep history (selective history); the config, the
fold and the checks share it.

``quoted`` makes any column name safe to hand to Spark, which otherwise parses dots and
backticks in a name as a struct path or a quoted identifier.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import Column
    from pyspark.sql.types import StructType

# -- CDC columns of a landing file ----------------------------------------------------------------
OP = "cdc_operation_type"
SEQ = "cdc_change_seq"
TS = "cdc_commit_timestamp"
CDC_COLUMNS = (OP, SEQ, TS)
OPERATIONS = ("INSERT", "UPDATE", "DELETE")

# -- system columns the platform adds -------------------------------------------------------------
UNMODIFIED = "_cdc_unmodified"
SOURCE_FILE = "_cdc_source_file"
SOURCE_ROW = "_cdc_source_row"
INGESTED_AT = "_cdc_ingested_at"
CHANGELOG_SYSTEM_COLUMNS = (*CDC_COLUMNS, UNMODIFIED, SOURCE_FILE, SOURCE_ROW, INGESTED_AT)

START = "_fivetran_start"
END = "_fivetran_end"
ACTIVE = "_fivetran_active"
SYNCED = "_fivetran_synced"
HISTORY_SYSTEM_COLUMNS = (START, END, ACTIVE, SYNCED)
# A keyless table's key: the hash of a row's values (``landing.rows.row_id``, HISTORY_MODE
# section 3).
# Not a system column of either list: it is the table's key column, in the change log too.
ROW_ID = "_fivetran_id"
# What the merge derives for each version beyond the contract's columns (extra `_cdc_` system
# columns, which the contract allows): whether a version is its key's latest, when that key's
# last event was (on its latest version), and which columns differ from the key's previous
# version (null on a key's first version).
CURRENT = "_cdc_current"
LAST_EVENT_AT = "_cdc_last_event_at"
CHANGED = "_cdc_changed_columns"
STATE_COLUMNS = (CURRENT, LAST_EVENT_AT, CHANGED)

# -- types -------------------------------------------------------------------------------------
TS_TYPE = pa.timestamp("us", tz="UTC")
UNMODIFIED_TYPE = pa.list_(pa.string())
# The end of a live version (HISTORY_MODE section 2). A commit timestamp at or after TMAX is out
# of range: a version starting or deleted there could not be told apart from a live one.
TMAX = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
TMAX_SQL = "9999-12-31 23:59:59.999"
# The earliest instant Spark, Delta and Python's datetime all represent.
TMIN = datetime(1, 1, 1, tzinfo=UTC)
TMIN_SQL = "0001-01-01 00:00:00"

# -- reserved name spaces -------------------------------------------------------------------------
RESERVED_PREFIXES = ("_fivetran_", "_cdc_")
INTERNAL_PREFIX = "_cdc_tmp_"


def internal(name: str) -> str:
    """The name of an internal working column (never a source column's name)."""
    return INTERNAL_PREFIX + name


def is_reserved(name: str) -> bool:
    """True for names in the platform's name spaces (a source column may not use them)."""
    return name.lower().startswith(RESERVED_PREFIXES)


def quote(name: str) -> str:
    """``name`` as a Spark SQL identifier: in backticks, backticks inside doubled."""
    return "`" + name.replace("`", "``") + "`"


def string_sql(value: str) -> str:
    """``value`` as a Spark SQL string literal that no value can break out of: its UTF-8 bytes
    in hex (quotes, backslashes and NULs are bytes like any other). Raises
    ``UnicodeEncodeError`` for a string that is not valid Unicode (a lone surrogate)."""
    return f"CAST(X'{value.encode('utf-8').hex()}' AS STRING)"


def comparable_sql(expr: str, is_map: bool) -> str:
    """SQL text for a value Spark can compare (``<=>``), group and sort: the value itself, but a
    map as its entries sorted by key (Spark compares no map; two maps with the same entries are
    the same value whatever order a file listed them in)."""
    return f"array_sort(map_entries({expr}))" if is_map else expr


def same_sql(a: str, b: str, is_map: bool = False) -> str:
    """SQL text: ``a`` and ``b`` (expressions of one column's type) equal, two nulls included."""
    return f"{comparable_sql(a, is_map)} <=> {comparable_sql(b, is_map)}"


def map_columns(schema: StructType) -> frozenset[str]:
    """The top-level columns of ``schema`` that are maps (``same_sql`` compares them so)."""
    from pyspark.sql.types import MapType

    return frozenset(f.name for f in schema.fields if isinstance(f.dataType, MapType))


def window_sql(partition_by: Sequence[str], order_by: Sequence[str], frame: str = "") -> str:
    """The text inside ``OVER (...)``, every name quoted (a column name is data)."""
    text = (
        f"PARTITION BY {', '.join(quote(c) for c in partition_by)} "
        f"ORDER BY {', '.join(quote(c) for c in order_by)}"
    )
    return f"{text} {frame}" if frame else text


def col(name: str) -> Column:
    """The column called exactly ``name`` (dots and backticks are part of the name)."""
    from pyspark.sql import functions as F

    return F.col(quote(name))


def cols(names: list[str] | tuple[str, ...]) -> list[Column]:
    return [col(n) for n in names]


def timestamp_lit(t: datetime) -> Column:
    """The time ``t`` (naive means UTC) as a Spark timestamp literal, exact in every year.

    ``F.lit(datetime)`` reaches the JVM as a ``java.sql.Timestamp``, which moves a time
    before the 1582 calendar change by days; microseconds since the epoch move nothing.
    """
    from pyspark.sql import functions as F

    return F.timestamp_micros(F.lit(unix_micros(t)))


def value_lit(value: object) -> Column:
    """Any Python value as a Spark literal, times and dates exact in every year (see
    ``timestamp_lit``; a ``date`` would reach the JVM as a ``java.sql.Date``, shifted too)."""
    from pyspark.sql import functions as F

    if isinstance(value, datetime):
        return timestamp_lit(value)
    if isinstance(value, date):
        return F.lit(value.isoformat()).cast("date")
    return F.lit(value)


def unix_micros(t: datetime) -> int:
    """Microseconds from 1970-01-01 UTC to ``t`` (naive means UTC), exact in every year."""
    aware = t.replace(tzinfo=UTC) if t.tzinfo is None else t
    return (aware - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def from_unix_micros(us: int) -> datetime:
    """A time collected from Spark as ``unix_micros``: a collected timestamp would come back
    naive in the Python process's local zone, whatever the session's."""
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)


# -- selective history: which data columns keep history ------------------------------------------

# The history table's property recording the selective-history setting its versions follow.
HISTORY_COLUMNS_PROPERTY = "cdc_platform.history_columns"


@dataclass(frozen=True)
class HistoryColumns:
    """Which data columns keep history (a table's ``track_history_columns`` or
    ``ignore_history_columns``): a change to a tracked column opens a version; a change to
    untracked columns only updates the live version in place. The default tracks every column.

    Names match case-insensitively (Delta column names are). Columns that appear later are
    tracked under an ignore list and untracked under a track list.
    """

    track: tuple[str, ...] | None = None  # only these; None: every column not ignored
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.track is not None and self.ignore:
            raise ValueError("give track_history_columns or ignore_history_columns, not both")

    @property
    def tracks_everything(self) -> bool:
        return self.track is None and not self.ignore

    def untracked(self, data_columns: Sequence[str]) -> list[str]:
        """The data columns whose changes open no version, in table order."""
        if self.track is not None:
            tracked = {c.lower() for c in self.track}
            return [c for c in data_columns if c.lower() not in tracked]
        ignored = {c.lower() for c in self.ignore}
        return [c for c in data_columns if c.lower() in ignored]

    def unknown(self, data_columns: Sequence[str]) -> list[str]:
        """Listed names that are no data column (a typo would silently untrack everything)."""
        have = {c.lower() for c in data_columns}
        return [c for c in (self.track or self.ignore) if c.lower() not in have]

    def tracked(self, data_columns: Sequence[str]) -> list[str]:
        untracked = set(self.untracked(data_columns))
        return [c for c in data_columns if c not in untracked]

    def to_json(self) -> str:
        """The setting as the history table records it (a table property)."""
        if self.track is not None:
            return json.dumps({"track": sorted(self.track, key=str.lower)})
        return json.dumps({"ignore": sorted(self.ignore, key=str.lower)})

    @classmethod
    def from_json(cls, text: str | None) -> HistoryColumns:
        """The setting a history table was built with (absent: every column tracked)."""
        if not text:
            return cls()
        raw = json.loads(text)
        if "track" in raw:
            return cls(track=tuple(raw["track"]))
        return cls(ignore=tuple(raw.get("ignore", ())))

    @classmethod
    def of_table(cls, dt: DeltaTable) -> HistoryColumns:
        """The setting a history table's versions follow (its table property)."""
        return cls.from_json(dt.metadata().configuration.get(HISTORY_COLUMNS_PROPERTY))

    def same_as(self, other: HistoryColumns) -> bool:
        """The same setting, whatever the names' order and case."""
        return self.to_json().lower() == other.to_json().lower()
