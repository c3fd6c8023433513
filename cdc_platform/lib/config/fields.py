"""The value types of the config file's keys: each a pydantic ``Annotated`` type whose validator
says, in words, what a wrong value should have been.

The validators run before pydantic's own (``BeforeValidator``), so a value is never coerced in a
way the config's reader did not write (``"5"`` is not 5, ``true`` is not 1); the types after them
give the JSON Schema its shape. A validator that needs the config file's folder reads it from the
validation context (``loading.parse_config`` passes it); built in code, a relative path stays
relative to the working folder.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationInfo, WithJsonSchema

from cdc_platform.lib.columns import CDC_COLUMNS, is_reserved
from cdc_platform.lib.storage.roots import checked_root
from cdc_platform.lib.storage.stores import OBJECT_STORE_SCHEMES, EnvRef, Location, OptionValue

PARTITION_FORMAT = "%Y-%m-%d-%H:%M"
COMPRESSIONS = ("none", "zstd")
ENCRYPTIONS = ("none", "aes-256-cbc")
WIDEN_TYPES = ("data", "never", "all")
LANDING_SENSORS = ("per_table", "fleet")
MAX_TABLES_PER_RUN = 100
# Column types a CSV table may declare (Spark SQL type names).
CSV_TYPES = (
    "string",
    "long",
    "int",
    "short",
    "double",
    "float",
    "boolean",
    "timestamp",
    "date",
    "binary",
)
_DECIMAL_RE = re.compile(r"^decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)$")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Storage options whose name says they hold a secret: only as {env: NAME}, never in the file.
_SECRET_OPTION_RE = re.compile(r"secret|password|sas|(^|_)token$|(^|_)key$|key_base64$")


class FieldProblem(ValueError):
    """A value refused, naming the key it belongs to when that is not where it was found (a
    rule between two keys is reported on the one to change; ``""``: the message names it)."""

    def __init__(self, why: str, field: str | None = None) -> None:
        super().__init__(why)
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{value!r} must be a positive integer")
    return value


def _between(low: int, high: int, unit: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not _is_int(value) or not low <= value <= high:
            raise ValueError(f"{value!r} must be a number of {unit} from {low} to {high}")
        return value

    return check


def _one_of(allowed: tuple[str, ...], fold_case: bool = True) -> Callable[[Any], str]:
    """A choice; a table's encoding choices whatever their case (``ZSTD`` is ``zstd``)."""

    def check(value: Any) -> str:
        text = str(value).lower() if fold_case else value
        if text not in allowed:
            raise ValueError(f"{value!r} is not one of {list(allowed)}")
        return text

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} must be true or false")
    return value


def _optional_string(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _table_name(value: Any) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ValueError("required; letters, digits and underscores, not starting with a digit")
    if value.startswith("_"):
        # '_cdc' holds every table's change log and quarantine, and readers skip '_' folders
        raise ValueError("must not start with '_' (reserved for the platform's own folders)")
    return value


def _group(value: Any) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value) or len(value) > 100:
        raise ValueError("letters, digits and underscores, not starting with a digit")
    return value


KEY_REQUIRED = "required; a non-empty list of column names (a table without a key: `keyless: true`)"


def _optional_primary_key(value: Any) -> tuple[str, ...] | None:
    """A key, or None for a table whose config says ``keyless: true`` (the table checks)."""
    return None if value is None else _primary_key(value)


def _primary_key(value: Any) -> tuple[str, ...]:
    """A non-empty list of column names (a single name is a one-column list); any name works,
    dots and backticks included: every Spark reference is quoted."""
    pk = [value] if isinstance(value, str) else value
    if not pk or not isinstance(pk, list | tuple) or not all(isinstance(c, str) and c for c in pk):
        raise ValueError(KEY_REQUIRED)
    if len({c.lower() for c in pk}) != len(pk):
        raise ValueError("lists a column twice (names are case-insensitive in Delta)")
    system = [c for c in pk if c.lower() in CDC_COLUMNS or c.lower().startswith("cdc_")]
    system += [c for c in pk if is_reserved(c)]
    if system:
        raise ValueError(f"system column(s) {system} cannot be part of the key")
    unprintable = [c for c in pk if not c.isprintable()]
    if unprintable:
        raise ValueError(f"column name(s) {unprintable} contain control characters")
    return tuple(pk)


def _column_list(value: Any) -> tuple[str, ...] | None:
    """A ``track_history_columns`` / ``ignore_history_columns`` list (the key is checked by the
    table, which knows its primary key)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(c, str) and c for c in value):
        raise ValueError("must be a list of column names")
    if not value:
        raise ValueError("must name at least one column (leave it out to track every column)")
    if len({c.lower() for c in value}) != len(value):
        raise ValueError("lists a column twice (names are case-insensitive in Delta)")
    system = [c for c in value if c.lower() in CDC_COLUMNS or is_reserved(c)]
    if system:
        raise ValueError(f"system column(s) {system} are not data columns")
    return tuple(value)


def _start(value: Any) -> datetime:
    """The first hourly partition, ``YYYY-MM-DD-HH:00`` (UTC); a datetime when built in code
    (or written as a YAML timestamp), on the hour in UTC."""
    if isinstance(value, datetime):
        start = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        if (start.minute, start.second, start.microsecond) != (0, 0, 0):
            raise ValueError(f"{value} must be on the hour (UTC)")
        return start
    if value is None:
        raise ValueError("required; the first hourly partition as 'YYYY-MM-DD-HH:MM'")
    try:
        start = datetime.strptime(str(value), PARTITION_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise ValueError(f"{value!r} is not a date of the form 'YYYY-MM-DD-HH:00'") from None
    if start.minute != 0:
        raise ValueError(f"{value!r} must be on the hour")
    return start


def _columns(value: Any) -> dict[str, str]:
    """CSV column types: Spark SQL names from ``CSV_TYPES`` or ``decimal(p,s)``."""
    if not isinstance(value or {}, dict):
        raise ValueError("must be a mapping of column name to type")
    columns: dict[str, str] = {}
    for column, typ in (value or {}).items():
        if is_reserved(str(column)):  # every file would be set aside as using a reserved name
            raise ValueError(
                f"column {column!r} uses a reserved system prefix (_fivetran_, _cdc_); a keyless"
                " table's _fivetran_id is computed, never read"
            )
        name = str(typ).strip().lower()
        if name not in CSV_TYPES and not _DECIMAL_RE.match(name):
            raise ValueError(
                f"column {column!r} has unknown type {typ!r}; use one of {list(CSV_TYPES)}"
                " or decimal(p,s)"
            )
        columns[str(column)] = name
    return columns


def _cron(value: Any) -> str:
    if not isinstance(value, str) or len(value.split()) != 5:
        raise ValueError("must be a 5-field cron string")
    return value


def is_object_store(value: Any) -> bool:
    return isinstance(value, str) and value.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES


def _base_dir(info: ValidationInfo) -> Path:
    return Path((info.context or {}).get("base_dir", "."))


def _path(value: Any, info: ValidationInfo) -> Path:
    """A folder from the file: relative to the file's folder."""
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty path string")
    path = Path(value).expanduser()
    return path if path.is_absolute() else (_base_dir(info) / path).resolve()


def _landing_root(value: Any, info: ValidationInfo) -> Path | Location:
    """A local or mounted folder (a plain path or ``file://``), or an S3 prefix
    (``s3://bucket/prefix``, ``s3a://`` alike) without ``.``/``..`` segments."""
    if isinstance(value, Location):
        return value if not value.is_local else value.path
    if is_object_store(value):
        location = checked_root(Location.of(value), "root")
        if location.scheme != "s3":
            raise ValueError(
                f"{value}: a landing zone on an object store is read through S3's API; "
                "gs:// and abfss:// are not supported for landing_root (for Google Cloud "
                "Storage, use s3://<bucket> with aws_endpoint_url: "
                "https://storage.googleapis.com and HMAC keys in landing_storage_options)"
            )
        return location
    if isinstance(value, str) and "://" in value:  # file:///..., or an unsupported scheme
        return Location.of(value).path
    return _path(value, info)


def _location(value: Any, info: ValidationInfo) -> Location:
    """A path (relative to the file's folder), a ``file://`` URI or an object-store URI."""
    if isinstance(value, Location):
        return value
    if isinstance(value, str) and "://" in value:
        # a supported scheme, a bucket, and no '.' or '..' segment
        return checked_root(Location.of(value), "root")
    return Location.of(_path(value, info))


def _source_roots(local: bool) -> Callable[[Any, ValidationInfo], tuple[Location, ...]]:
    """``snapshot_roots`` (folders or S3 prefixes) or ``adoption_roots`` (folders or
    object-store prefixes), each confined as ``storage.roots`` confines a source."""

    def check(value: Any, info: ValidationInfo) -> tuple[Location, ...]:
        if value is None:
            return ()
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, Location) or (isinstance(v, str) and v) for v in value
        ):
            raise ValueError("must be a list of folders")
        roots = []
        for item in value:
            if local and is_object_store(item) and not str(item).lower().startswith("s3"):
                raise ValueError(f"{item}: a snapshot is read from a folder or an s3:// prefix")
            where = item if isinstance(item, Location) or "://" in item else _path(item, info)
            roots.append(checked_root(where, "entry", source=True))
        return tuple(roots)

    return check


def _storage_options(value: Any) -> dict[str, OptionValue] | None:
    """delta-rs storage options: names to strings (numbers and booleans are written as delta-rs
    expects them) or ``{env: NAME}``; a secret only as ``{env: NAME}``, never echoed."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be a mapping of option name to value")
    options: dict[str, OptionValue] = {}
    seen: dict[str, str] = {}
    for name, option in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError("option names must be strings")
        if name.lower() in seen:
            raise ValueError(f"'{seen[name.lower()]}' and '{name}' are one option")
        seen[name.lower()] = name
        options[name] = _storage_option(name, option)
    return options


def _storage_option(name: str, value: Any) -> OptionValue:
    if isinstance(value, EnvRef):
        return value
    if isinstance(value, dict):
        env = value.get("env")
        if set(value) != {"env"} or not isinstance(env, str) or not env:
            raise ValueError(f"option '{name}': a reference is {{env: NAME}}")
        return EnvRef(env)
    if _SECRET_OPTION_RE.search(name.lower()):
        raise ValueError(
            f"option '{name}' holds a secret: give it as {{env: NAME}} (an environment"
            " variable), not in the file"
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"option '{name}': a string, number, boolean or {{env: NAME}}")


def _string(**schema: Any) -> WithJsonSchema:
    """A string in the JSON Schema; its ``format`` (the reference's type column reads it) is one
    of ours where JSON Schema has none: validators ignore a format they do not know."""
    return WithJsonSchema({"type": "string", **schema})


_NAME_SCHEMA = {"pattern": NAME_RE.pattern, "maxLength": 100}
_COLUMN = {"type": "string", "format": "column", "minLength": 1}
_COLUMN_LIST = {"type": "array", "items": _COLUMN, "minItems": 1}
_ENV_REF = {
    "type": "object",
    "properties": {"env": {"type": "string", "minLength": 1}},
    "required": ["env"],
    "additionalProperties": False,
}


def _integer(low: int, high: int | None = None) -> WithJsonSchema:
    bounds = {"minimum": low} if high is None else {"minimum": low, "maximum": high}
    return WithJsonSchema({"type": "integer", **bounds})


PositiveInt = Annotated[int, BeforeValidator(_positive), _integer(1)]
Minutes = Annotated[int, BeforeValidator(_between(1, 24 * 60, "minutes")), _integer(1, 24 * 60)]
TablesPerRun = Annotated[
    int,
    BeforeValidator(_between(1, MAX_TABLES_PER_RUN, "tables")),
    _integer(1, MAX_TABLES_PER_RUN),
]
Boolean = Annotated[bool, BeforeValidator(_boolean)]
OptionalString = Annotated[str | None, BeforeValidator(_optional_string)]
TableName = Annotated[
    str, BeforeValidator(_table_name), _string(format="name", pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
]
GroupName = Annotated[str, BeforeValidator(_group), _string(format="name", **_NAME_SCHEMA)]
OptionalPrimaryKey = Annotated[
    tuple[str, ...] | None,
    BeforeValidator(_optional_primary_key),
    WithJsonSchema({"anyOf": [_COLUMN, _COLUMN_LIST]}),
]
ColumnList = Annotated[
    tuple[str, ...] | None, BeforeValidator(_column_list), WithJsonSchema(_COLUMN_LIST)
]
Start = Annotated[
    datetime,
    BeforeValidator(_start),
    _string(format="hour", pattern=r"^\d{4}-\d{2}-\d{2}-\d{2}:00$", examples=["2024-01-01-00:00"]),
]


def _enum(allowed: tuple[str, ...]) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "enum": list(allowed)})


# Choices: ``str`` to the type checker, an ``enum`` to the JSON Schema.
Compression = Annotated[str, BeforeValidator(_one_of(COMPRESSIONS)), _enum(COMPRESSIONS)]
Encryption = Annotated[str, BeforeValidator(_one_of(ENCRYPTIONS)), _enum(ENCRYPTIONS)]
WidenTypes = Annotated[str, BeforeValidator(_one_of(WIDEN_TYPES)), _enum(WIDEN_TYPES)]
LandingSensor = Annotated[
    str, BeforeValidator(_one_of(LANDING_SENSORS, fold_case=False)), _enum(LANDING_SENSORS)
]
CsvColumns = Annotated[
    dict[str, str],
    BeforeValidator(_columns),
    WithJsonSchema(
        {
            "type": "object",
            "additionalProperties": {
                "anyOf": [
                    {"enum": list(CSV_TYPES)},
                    {
                        "type": "string",
                        "format": "decimal",
                        "pattern": r"^decimal\(\s*\d+\s*,\s*\d+\s*\)$",
                    },
                ]
            },
        }
    ),
]
Cron = Annotated[str, BeforeValidator(_cron), _string(format="cron", pattern=r"^\S+( \S+){4}$")]
LandingRoot = Annotated[
    Path | Location, BeforeValidator(_landing_root), _string(format="uri-reference", minLength=1)
]
RootLocation = Annotated[
    Location, BeforeValidator(_location), _string(format="uri-reference", minLength=1)
]
StorageOptions = Annotated[
    dict[str, OptionValue] | None,
    BeforeValidator(_storage_options),
    WithJsonSchema(
        {
            "type": "object",
            "additionalProperties": {
                "anyOf": [{"type": ["string", "number", "boolean"]}, _ENV_REF]
            },
        }
    ),
]
_ROOTS_SCHEMA = WithJsonSchema(
    {"type": "array", "items": {"type": "string", "format": "uri-reference", "minLength": 1}}
)
SnapshotRoots = Annotated[
    tuple[Location, ...], BeforeValidator(_source_roots(local=True)), _ROOTS_SCHEMA
]
AdoptionRoots = Annotated[
    tuple[Location, ...], BeforeValidator(_source_roots(local=False)), _ROOTS_SCHEMA
]
