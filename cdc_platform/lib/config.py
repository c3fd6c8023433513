"""The platform's config file: which tables exist and how their landing files look.

The file is YAML, named by the env var ``CDC_PLATFORM_CONFIG`` (default: ``cdc_platform.yaml``
at the repo root). Parsing is strict: an unknown key, a missing primary key or a bad date is
an error naming the table and the field, so a typo never silently changes behaviour.

``warehouse_root`` may be an object store (``s3://bucket/prefix``, ``gs://``, ``abfss://``) with
``warehouse_storage_options`` for delta-rs (``lib.storage.stores``); a secret among them must be an
environment reference, ``{env: NAME}``, so it is never in the file. ``landing_root`` is a local or
mounted folder: the sensors and readers list and open landing files on a file system.

An optional ``discover:`` template (``{primary_key: [...], start: ...}``) gives every table
folder of the landing zone that ``tables:`` does not list an asset of its own (see
``lib.landing.discovery``); with it, ``tables:`` may be empty or absent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from cdc_platform.lib.columns import CDC_COLUMNS, is_reserved
from cdc_platform.lib.history.versions import TRACK_ALL, HistoryColumns
from cdc_platform.lib.landing.codecs import DEFAULT_MAX_BYTES
from cdc_platform.lib.landing.formats import FORMATS as LANDING_FORMATS
from cdc_platform.lib.operations.source_roots import checked_root, overlaps
from cdc_platform.lib.storage.stores import OBJECT_STORE_SCHEMES, EnvRef, Location, OptionValue
from cdc_platform.lib.storage.warehouse import current_table_name

CONFIG_ENV_VAR = "CDC_PLATFORM_CONFIG"
DEFAULT_GROUP = "cdc_history"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG_PATH = REPO_ROOT / "cdc_platform.yaml"

PARTITION_FORMAT = "%Y-%m-%d-%H:%M"
# The landing formats, the default first (``landing.formats``: one module per format).
FORMATS = tuple(LANDING_FORMATS)
COMPRESSIONS = ("none", "zstd")
ENCRYPTIONS = ("none", "aes-256-cbc")
WIDEN_TYPES = ("data", "never", "all")
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
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Storage options whose name says they hold a secret: only as {env: NAME}, never in the file.
_SECRET_OPTION_RE = re.compile(r"secret|password|sas|(^|_)token$|(^|_)key$|key_base64$")


class ConfigError(ValueError):
    """The config file is invalid; the message names the table and the field."""


@dataclass(frozen=True)
class TableConfig:
    """One destination table and how its landing files are encoded."""

    name: str
    primary_key: tuple[str, ...]
    start: datetime
    format: str = "parquet"
    compression: str = "none"
    encryption: str = "none"
    null_string: str | None = None
    unmodified_string: str | None = None
    columns: dict[str, str] = field(default_factory=dict)
    lookback_hours: int = 6
    full_sweep_minutes: int = 60
    sensor_interval_seconds: int = 60
    # Also keep `<table>_current`: the active rows only (SCD1), refreshed after each
    # materialization of the history table (an optional second asset).
    current_table: bool = False
    # Selective history: which data columns open a new version when they change
    # (``track_history_columns`` / ``ignore_history_columns``); default every column.
    history_columns: HistoryColumns = TRACK_ALL
    # Which columns a landing file may widen for good (``WIDEN_TYPES``): ``data`` (the
    # default) its data columns, never a primary-key column; ``all`` key columns too;
    # ``never`` none. A file that needs a widening not allowed is set aside, saying so.
    widen_types: str = "data"
    # The Dagster asset group of the table's assets (the asset graph shows one box per group
    # until opened: at hundreds of tables, group them by source system or domain).
    group: str = DEFAULT_GROUP
    # A landing file whose plaintext (decrypted, decompressed; a Parquet file's uncompressed
    # row groups) is larger is set aside: a decompression bomb costs a task about twice this much.
    max_file_bytes: int = DEFAULT_MAX_BYTES
    # The source's expected delivery cadence: without a materialization for this many hours the
    # table is late (WARN), for twice as many stale (FAIL), in Dagster's freshness (None: no
    # expectation; discovered tables get ``DEFAULT_DELIVERY_HOURS``).
    expected_delivery_hours: int | None = None
    # Landing sensor: an hour requested and not yet applied is requested again after this long,
    # doubling with each retry up to an hour (``lib.fleet.sensor_cursor.reconcile``).
    retry_backoff_seconds: int = 300
    # An hour landed and still not applied after this many minutes is alerted, once
    # (``defs.source_alerts``; the retries go on meanwhile).
    unapplied_alert_minutes: int = 60

    @property
    def start_partition_key(self) -> str:
        return self.start.strftime(PARTITION_FORMAT)

    def may_widen(self, column: str) -> bool:
        """Whether a file may widen ``column``'s type in the change log and the tables."""
        if self.widen_types == "all":
            return True
        return self.widen_types == "data" and column not in self.primary_key

    @property
    def is_encoded(self) -> bool:
        """True when files are decoded into memory before their format reads them (decrypted,
        decompressed, or a format not read in place: CSV); False: plain Parquet."""
        in_place = LANDING_FORMATS[self.format].reads_in_place
        return not in_place or self.compression != "none" or self.encryption != "none"


# A discovered table's expected delivery cadence (hours) unless the template says otherwise.
DEFAULT_DELIVERY_HOURS = 24


@dataclass(frozen=True)
class DiscoverTemplate:
    """``discover:``: what an unlisted table folder gets (everything else is the default)."""

    primary_key: tuple[str, ...]
    start: datetime
    expected_delivery_hours: int = DEFAULT_DELIVERY_HOURS

    @property
    def start_partition_key(self) -> str:
        return self.start.strftime(PARTITION_FORMAT)


@dataclass(frozen=True)
class PlatformConfig:
    """The whole config file, with paths already resolved against the file's folder."""

    landing_root: Path
    warehouse_root: Location
    tables: tuple[TableConfig, ...]
    check_schedule: str = "0 3 * * *"
    maintenance_schedule: str = "30 4 * * *"
    # A table's daily maintenance starts within this many minutes after maintenance_schedule,
    # at a place derived from its name (``lib.fleet.schedule_spread``).
    schedule_window_minutes: int = 120
    source: Path | None = None
    # Unlisted table folders get assets from this template (``lib.landing.discovery``); None: they are
    # only reported by the ``cdc_new_tables`` sensor.
    discover: DiscoverTemplate | None = None
    # The folders a re-sync snapshot, and the folders or object-store prefixes an adoption
    # source, may be read from (``lib.operations.source_roots``); none: those jobs refuse every run.
    snapshot_roots: tuple[Location, ...] = ()
    adoption_roots: tuple[Location, ...] = ()
    # "per_table": a landing sensor per table, a run per table and hour range. "fleet": one
    # landing sensor for every table, and runs applying one hour range for up to
    # ``tables_per_run`` tables each, each table its own step and commit (``defs.fleet``), and
    # one maintenance schedule for every table (``defs.maintenance``).
    landing_sensor: str = "per_table"
    tables_per_run: int = 1

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"no table named {name!r} in {self.source}")


_TABLE_FIELDS = {
    "name",
    "primary_key",
    "start",
    "format",
    "compression",
    "encryption",
    "null_string",
    "unmodified_string",
    "columns",
    "lookback_hours",
    "full_sweep_minutes",
    "sensor_interval_seconds",
    "current_table",
    "track_history_columns",
    "ignore_history_columns",
    "widen_types",
    "group",
    "max_file_bytes",
    "retry_backoff_seconds",
    "unapplied_alert_minutes",
    "expected_delivery_hours",
}
_TOP_FIELDS = {
    "landing_root",
    "warehouse_root",
    "warehouse_storage_options",
    "tables",
    "check_schedule",
    "maintenance_schedule",
    "schedule_window_minutes",
    "discover",
    "snapshot_roots",
    "adoption_roots",
    "landing_sensor",
    "tables_per_run",
}
_DISCOVER_FIELDS = {"primary_key", "start", "expected_delivery_hours"}


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV_VAR) or DEFAULT_CONFIG_PATH)


def load_config(path: str | Path | None = None) -> PlatformConfig:
    """Read and validate the config file (``CDC_PLATFORM_CONFIG`` when no path is given)."""
    path = Path(path) if path is not None else config_path()
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (set {CONFIG_ENV_VAR})")
    with path.open() as fh:
        raw = yaml.safe_load(fh)
    return parse_config(raw, base_dir=path.resolve().parent, source=path)


def parse_config(raw: Any, base_dir: Path, source: Path | None = None) -> PlatformConfig:
    where = str(source or "config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    unknown = sorted(set(raw) - _TOP_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_TOP_FIELDS)}")
    discover = _parse_discover(raw["discover"], where) if "discover" in raw else None
    # With a discover: template, tables: may be left out.
    for key in ("landing_root", "warehouse_root", *(("tables",) if discover is None else ())):
        if key not in raw:
            raise ConfigError(f"{where}: missing required key '{key}'")
    tables_raw = raw.get("tables")
    if discover is not None and tables_raw is None:
        tables_raw = []  # `tables:` absent or empty: every table is discovered
    if not isinstance(tables_raw, list) or (not tables_raw and discover is None):
        raise ConfigError(
            f"{where}: 'tables' must be a non-empty list (or give a 'discover' template)"
            if discover is None
            else f"{where}: 'tables' must be a list"
        )
    tables = tuple(_parse_table(t, i, where) for i, t in enumerate(tables_raw))
    names = [t.name.lower() for t in tables]
    dupes = sorted({t.name for t in tables if names.count(t.name.lower()) > 1})
    if dupes:
        # case-insensitive: on such file systems 'Orders' and 'orders' are one folder
        raise ConfigError(f"{where}: table name(s) defined twice: {dupes}")
    for t in tables:
        if t.current_table and current_table_name(t.name).lower() in names:
            # one folder and one asset key for two tables
            raise ConfigError(
                f"{where}: table '{t.name}', field 'current_table': its current table "
                f"'{current_table_name(t.name)}' has the name of another table"
            )
    schedule = _cron(raw, "check_schedule", "0 3 * * *", where)
    maintenance = _cron(raw, "maintenance_schedule", "30 4 * * *", where)
    landing_root = _landing_root(raw["landing_root"], base_dir, where)
    warehouse_root = parse_location(
        raw["warehouse_root"],
        raw.get("warehouse_storage_options"),
        base_dir,
        where,
        "warehouse_root",
    )
    if warehouse_root.is_local:
        _check_roots_apart(landing_root, warehouse_root.path, where)
    roots = (checked_root(landing_root, "landing_root"), checked_root(warehouse_root, "root"))
    return PlatformConfig(
        landing_root=landing_root,
        warehouse_root=warehouse_root,
        tables=tables,
        check_schedule=schedule,
        maintenance_schedule=maintenance,
        schedule_window_minutes=_window(raw.get("schedule_window_minutes", 120), where),
        source=source,
        discover=discover,
        snapshot_roots=_source_roots(raw, "snapshot_roots", base_dir, where, roots, local=True),
        adoption_roots=_source_roots(raw, "adoption_roots", base_dir, where, roots, local=False),
        **_landing_sensor(raw, where),
    )


LANDING_SENSORS = ("per_table", "fleet")
MAX_TABLES_PER_RUN = 100


def _landing_sensor(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """``landing_sensor`` and ``tables_per_run``: several tables in one run need the one
    sensor that sees them all."""
    mode = raw.get("landing_sensor", "per_table")
    if mode not in LANDING_SENSORS:
        raise ConfigError(
            f"{where}: field 'landing_sensor': {mode!r} must be one of {list(LANDING_SENSORS)}"
        )
    per_run = raw.get("tables_per_run", 1)
    if not isinstance(per_run, int) or isinstance(per_run, bool):
        per_run = 0
    if not 1 <= per_run <= MAX_TABLES_PER_RUN:
        raise ConfigError(
            f"{where}: field 'tables_per_run': {raw.get('tables_per_run')!r} must be a number "
            f"of tables from 1 to {MAX_TABLES_PER_RUN}"
        )
    if per_run > 1 and mode != "fleet":
        raise ConfigError(
            f"{where}: field 'tables_per_run': {per_run} tables in one run need "
            "'landing_sensor: fleet' (one sensor sees every table's new hours)"
        )
    return {"landing_sensor": mode, "tables_per_run": per_run}


def _source_roots(
    raw: dict[str, Any],
    key: str,
    base_dir: Path,
    where: str,
    platform_roots: tuple[Location, ...],
    local: bool,
) -> tuple[Location, ...]:
    """``snapshot_roots`` (local folders) or ``adoption_roots`` (folders or object-store
    prefixes): resolved, and none overlapping the landing or warehouse root."""
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: field '{key}' must be a list of folders")
    out = []
    for item in value:
        if local and _is_object_store(item):
            raise ConfigError(
                f"{where}: field '{key}': {item} is an object store; a snapshot is"
                " read from a local or mounted folder"
            )
        try:
            root = checked_root(
                item if "://" in item else _resolve(item, base_dir, where, key),
                f"'{key}' entry",
                source=True,
            )
        except ValueError as exc:
            raise ConfigError(f"{where}: field '{key}': {exc}") from None
        for platform_root in platform_roots:
            if overlaps(root, platform_root):
                raise ConfigError(
                    f"{where}: field '{key}': {root} overlaps {platform_root}: the landing and"
                    " warehouse roots are never a source"
                )
        out.append(root)
    return tuple(out)


def _parse_discover(raw: Any, where: str) -> DiscoverTemplate:
    """The ``discover:`` template: a primary key and a start, validated as a table's are."""

    def fail(field_name: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: discover, field '{field_name}': {why}")

    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: field 'discover' must be a mapping such as "
            '{primary_key: [id], start: "2024-01-01-00:00"}'
        )
    unknown = sorted(set(raw) - _DISCOVER_FIELDS)
    if unknown:
        raise fail(unknown[0], f"unknown key(s) {unknown}; allowed: {sorted(_DISCOVER_FIELDS)}")
    hours = raw.get("expected_delivery_hours", DEFAULT_DELIVERY_HOURS)
    if not isinstance(hours, int) or isinstance(hours, bool) or hours <= 0:
        raise fail("expected_delivery_hours", f"{hours!r} must be a positive integer")
    return DiscoverTemplate(
        primary_key=tuple(_primary_key(raw.get("primary_key"), fail)),
        start=_start(raw.get("start"), fail),
        expected_delivery_hours=hours,
    )


def _window(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 24 * 60:
        raise ConfigError(
            f"{where}: field 'schedule_window_minutes': {value!r} must be a number of minutes "
            "from 1 to 1440"
        )
    return value


def _cron(raw: dict[str, Any], key: str, default: str, where: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or len(value.split()) != 5:
        raise ConfigError(f"{where}: field '{key}' must be a 5-field cron string")
    return value


def _resolve(value: Any, base_dir: Path, where: str, key: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: field '{key}' must be a non-empty path string")
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base_dir / p).resolve()


def _is_object_store(value: Any) -> bool:
    return isinstance(value, str) and value.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES


def _landing_root(value: Any, base_dir: Path, where: str) -> Path:
    """The landing root: a local or mounted folder (a plain path or ``file://``)."""
    if _is_object_store(value):
        raise ConfigError(
            f"{where}: field 'landing_root': {value} is an object store; landing files must be"
            " on a local or mounted file system (the sensors list hour folders and compare file"
            " modification times there): mount the bucket or copy its files to a folder"
        )
    if isinstance(value, str) and "://" in value:  # file:///..., or an unsupported scheme
        try:
            return Location.of(value).path
        except ValueError as exc:
            raise ConfigError(f"{where}: field 'landing_root': {exc}") from None
    return _resolve(value, base_dir, where, "landing_root")


def parse_location(value: Any, options: Any, base_dir: Path, where: str, key: str) -> Location:
    """A root from the config: a path (relative to ``base_dir``), a ``file://`` URI or an
    object-store URI, with its storage options (only for an object store)."""
    if isinstance(value, str) and "://" in value:
        try:
            location = Location.of(value)  # a supported scheme, and a bucket
        except ValueError as exc:
            raise ConfigError(f"{where}: field '{key}': {exc}") from None
    else:
        location = Location.of(_resolve(value, base_dir, where, key))
    options_key = key.removesuffix("_root") + "_storage_options"
    if not location.is_local:
        return Location(location.uri, parse_storage_options(options, where, options_key))
    if options is not None:
        raise ConfigError(
            f"{where}: field '{options_key}': storage options are for an object-store {key}"
            f" ({', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)}), not a local folder"
        )
    return location


def parse_storage_options(raw: Any, where: str, key: str) -> dict[str, OptionValue]:
    """delta-rs storage options: names to strings (numbers and booleans are written as
    delta-rs expects them) or ``{env: NAME}``; a secret only as ``{env: NAME}``."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: field '{key}' must be a mapping of option name to value")
    options: dict[str, OptionValue] = {}
    seen: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: field '{key}': option names must be strings")
        if name.lower() in seen:
            raise ConfigError(
                f"{where}: field '{key}': '{seen[name.lower()]}' and '{name}' are one option"
            )
        seen[name.lower()] = name
        if isinstance(value, dict):
            env = value.get("env")
            if set(value) != {"env"} or not isinstance(env, str) or not env:
                raise ConfigError(
                    f"{where}: field '{key}', option '{name}': a reference is {{env: NAME}}"
                )
            options[name] = EnvRef(env)
        elif _SECRET_OPTION_RE.search(name.lower()):
            # The value itself is never echoed: it is a secret.
            raise ConfigError(
                f"{where}: field '{key}', option '{name}' holds a secret: give it as"
                " {env: NAME} (an environment variable), not in the file"
            )
        elif isinstance(value, bool):
            options[name] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            options[name] = str(value)
        else:
            raise ConfigError(
                f"{where}: field '{key}', option '{name}': a string, number, boolean or"
                " {env: NAME}"
            )
    return options


def _check_roots_apart(landing_root: Path, warehouse_root: Path, where: str) -> None:
    """The roots must not overlap: a VACUUM of a table would see landing files as its own
    stray files, and a landing folder would see the platform's files as data."""
    landing, warehouse = landing_root.resolve(), warehouse_root.resolve()
    if landing == warehouse:
        raise ConfigError(f"{where}: field 'warehouse_root': the same folder as landing_root")
    if landing in warehouse.parents:
        raise ConfigError(
            f"{where}: field 'warehouse_root': {warehouse} is inside landing_root {landing}"
        )
    if warehouse in landing.parents:
        raise ConfigError(
            f"{where}: field 'landing_root': {landing} is inside warehouse_root {warehouse}"
        )


def _parse_table(raw: Any, index: int, where: str) -> TableConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: tables[{index}] must be a mapping")
    name = raw.get("name")
    label = f"table '{name}'" if isinstance(name, str) else f"tables[{index}]"

    def fail(field_name: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: {label}, field '{field_name}': {why}")

    unknown = sorted(set(raw) - _TABLE_FIELDS)
    if unknown:
        raise fail(unknown[0], f"unknown key(s) {unknown}; allowed: {sorted(_TABLE_FIELDS)}")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise fail("name", "required; letters, digits and underscores, not starting with a digit")
    if name.startswith("_"):
        # '_cdc' holds every table's change log and quarantine, and readers skip '_' folders
        raise fail("name", "must not start with '_' (reserved for the platform's own folders)")

    pk = _primary_key(raw.get("primary_key"), fail)
    start = _start(raw.get("start"), fail)

    def choice(key: str, allowed: tuple[str, ...]) -> str:
        value = str(raw.get(key, allowed[0])).lower()
        if value not in allowed:
            raise fail(key, f"{raw.get(key)!r} is not one of {list(allowed)}")
        return value

    def optional_str(key: str) -> str | None:
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise fail(key, "must be a string")
        return value

    def boolean(key: str) -> bool:
        value = raw.get(key, False)
        if not isinstance(value, bool):
            raise fail(key, f"{value!r} must be true or false")
        return value

    def positive_int(key: str, default: int) -> int:
        value = raw.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise fail(key, f"{value!r} must be a positive integer")
        return value

    columns_raw = raw.get("columns", {}) or {}
    if not isinstance(columns_raw, dict):
        raise fail("columns", "must be a mapping of column name to type")
    columns: dict[str, str] = {}
    for col, typ in columns_raw.items():
        typ_s = str(typ).strip().lower()
        if typ_s not in CSV_TYPES and not _DECIMAL_RE.match(typ_s):
            raise fail(
                "columns",
                f"column {col!r} has unknown type {typ!r}; use one of {list(CSV_TYPES)} or decimal(p,s)",
            )
        columns[str(col)] = typ_s

    fmt = choice("format", FORMATS)
    null_string = optional_str("null_string")
    unmodified_string = optional_str("unmodified_string")
    if null_string is not None and null_string == unmodified_string:
        raise fail("unmodified_string", "must differ from null_string")
    problem = LANDING_FORMATS[fmt].config_problem(pk, columns)
    if problem:
        raise fail("columns", problem)

    backoff = positive_int("retry_backoff_seconds", 300)
    alert_minutes = positive_int("unapplied_alert_minutes", 60)
    if alert_minutes * 60 <= 2 * backoff:
        # An hour is first looked at again after one backoff: a healthy table would alert.
        raise fail(
            "unapplied_alert_minutes",
            f"{alert_minutes} min must be longer than twice retry_backoff_seconds ({backoff} s)",
        )

    return TableConfig(
        name=name,
        primary_key=tuple(pk),
        start=start,
        format=fmt,
        compression=choice("compression", COMPRESSIONS),
        encryption=choice("encryption", ENCRYPTIONS),
        null_string=null_string,
        unmodified_string=unmodified_string,
        columns=columns,
        lookback_hours=positive_int("lookback_hours", 6),
        full_sweep_minutes=positive_int("full_sweep_minutes", 60),
        sensor_interval_seconds=positive_int("sensor_interval_seconds", 60),
        current_table=boolean("current_table"),
        history_columns=_history_columns(raw, pk, fail),
        widen_types=choice("widen_types", WIDEN_TYPES),
        group=_group(raw.get("group", DEFAULT_GROUP), fail),
        max_file_bytes=positive_int("max_file_bytes", DEFAULT_MAX_BYTES),
        retry_backoff_seconds=backoff,
        unapplied_alert_minutes=alert_minutes,
        expected_delivery_hours=(
            positive_int("expected_delivery_hours", 1)
            if raw.get("expected_delivery_hours") is not None
            else None
        ),
    )


def _group(value: object, fail: Callable[[str, str], ConfigError]) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value) or len(value) > 100:
        raise fail("group", "letters, digits and underscores, not starting with a digit")
    return value


def _history_columns(
    raw: dict[str, Any], pk: list[str], fail: Callable[[str, str], ConfigError]
) -> HistoryColumns:
    """``track_history_columns`` (only these keep history) or ``ignore_history_columns`` (these
    do not): a list of data column names, never a key column, never both lists."""
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("track_history_columns", "ignore_history_columns"):
        if key not in raw:
            continue
        value = raw[key]
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
            raise fail(key, "must be a list of column names")
        if not value:
            raise fail(key, "must name at least one column (leave it out to track every column)")
        if len({c.lower() for c in value}) != len(value):
            raise fail(key, "lists a column twice (names are case-insensitive in Delta)")
        in_key = [c for c in value if c.lower() in {k.lower() for k in pk}]
        if in_key:
            raise fail(key, f"primary key column(s) {in_key} always identify the version")
        system = [c for c in value if c.lower() in CDC_COLUMNS or is_reserved(c)]
        if system:
            raise fail(key, f"system column(s) {system} are not data columns")
        lists[key] = tuple(value)
    if len(lists) == 2:
        raise fail(
            "ignore_history_columns",
            "give track_history_columns or ignore_history_columns, not both",
        )
    if "track_history_columns" in lists:
        return HistoryColumns(track=lists["track_history_columns"])
    return HistoryColumns(ignore=lists.get("ignore_history_columns", ()))


def _primary_key(pk: Any, fail: Callable[[str, str], ConfigError]) -> list[str]:
    """A table's (or the discover template's) primary key: a non-empty list of column names."""
    if isinstance(pk, str):
        pk = [pk]
    if not pk or not isinstance(pk, list) or not all(isinstance(c, str) and c for c in pk):
        raise fail("primary_key", "required; a non-empty list of column names")
    # Any other name works, dots and backticks included: every Spark reference is quoted.
    if len({c.lower() for c in pk}) != len(pk):
        raise fail("primary_key", "lists a column twice (names are case-insensitive in Delta)")
    bad_pk = [c for c in pk if c.lower() in CDC_COLUMNS or c.lower().startswith("cdc_")]
    bad_pk += [c for c in pk if is_reserved(c)]
    if bad_pk:
        raise fail("primary_key", f"system column(s) {bad_pk} cannot be part of the key")
    unprintable = [c for c in pk if not c.isprintable()]
    if unprintable:
        raise fail("primary_key", f"column name(s) {unprintable} contain control characters")
    return pk


def _start(start_raw: Any, fail: Callable[[str, str], ConfigError]) -> datetime:
    """The first hourly partition, ``YYYY-MM-DD-HH:00`` (UTC)."""
    if start_raw is None:
        raise fail("start", "required; the first hourly partition as 'YYYY-MM-DD-HH:MM'")
    try:
        start = datetime.strptime(str(start_raw), PARTITION_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        raise fail("start", f"{start_raw!r} is not a date of the form 'YYYY-MM-DD-HH:00'") from None
    if start.minute != 0:
        raise fail("start", f"{start_raw!r} must be on the hour")
    return start
