"""The config as pydantic dataclasses: one field per key of the file, with its type, default and
description, so the parser, ``docs/configuration.md`` and the JSON Schema for editors are one
definition (``config_reference`` renders the last two).

Dataclasses rather than ``BaseModel``: the platform builds tables in code
(``dataclasses.replace(table, ...)``, positional ``PlatformConfig(landing, warehouse, tables)``)
and ships them to Spark tasks, and a pydantic dataclass validates every one of those as it does
the file. Rules between keys are ``model_validator``s that report the key to change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass
from pydantic.json_schema import SkipJsonSchema

from cdc_platform.lib.columns import ROW_ID, HistoryColumns
from cdc_platform.lib.config.fields import (
    KEY_REQUIRED,
    PARTITION_FORMAT,
    AdoptionRoots,
    Boolean,
    ColumnList,
    Compression,
    Cron,
    CsvColumns,
    Encryption,
    FieldProblem,
    GroupName,
    LandingRoot,
    LandingSensor,
    Minutes,
    OptionalPrimaryKey,
    OptionalString,
    PositiveInt,
    RootLocation,
    SnapshotRoots,
    Start,
    StorageOptions,
    TableName,
    TablesPerRun,
    WidenTypes,
)
from cdc_platform.lib.landing.decoding.codecs import DEFAULT_MAX_BYTES
from cdc_platform.lib.landing.decoding.formats import FORMATS
from cdc_platform.lib.storage.roots import checked_root, overlaps
from cdc_platform.lib.storage.stores import OBJECT_STORE_SCHEMES, Location, OptionValue
from cdc_platform.lib.storage.warehouse import current_table_name

DEFAULT_GROUP = "cdc_history"
# A discovered table's expected delivery cadence (hours) unless the template says otherwise.
DEFAULT_DELIVERY_HOURS = 24

# A refused value is never shown in pydantic's own message: it may be a secret.
_STRICT = ConfigDict(extra="forbid", arbitrary_types_allowed=True, hide_input_in_errors=True)


def _format(value: object) -> str:
    """A landing format of the registry (``landing.decoding.formats``), whatever its case."""
    name = str(value).lower()
    if name not in FORMATS:
        raise ValueError(f"{value!r} is not one of {list(FORMATS)}")
    return name


LandingFormatName = Annotated[str, BeforeValidator(_format)]


@dataclass(frozen=True, config=_STRICT)
class TableConfig:
    """One destination table and how its landing files are encoded."""

    name: TableName = Field(
        description="The table: its landing folder, asset and warehouse folder. Letters, "
        "digits and `_`, not starting with a digit or `_`."
    )
    primary_key: OptionalPrimaryKey = Field(
        default=None,
        kw_only=True,
        description="The key columns (a single name is a one-column list). Recorded on the "
        "history table by its first run: a config naming other columns is then refused.",
    )
    keyless: Boolean = Field(
        default=False,
        kw_only=True,
        description="A table without a primary key: each distinct row image is keyed by "
        "`_fivetran_id`, a hash of its values, instead (HISTORY_MODE section 3). Never with "
        "`primary_key`, `unmodified_string` or the history-column lists; its column types "
        "never widen.",
    )
    start: Start = Field(description="The first hourly partition (UTC).")
    format: LandingFormatName = Field(
        default="parquet",
        description="How landing files are written: "
        + "; ".join(f"`{f.name}`, {f.summary}" for f in FORMATS.values())
        + " (one module each in `lib/landing/decoding/formats/`).",
        json_schema_extra={"enum": list(FORMATS)},
    )
    compression: Compression = Field(
        default="none", description="ZSTD-compressed landing files (Fivetran's batch-file format)."
    )
    encryption: Encryption = Field(
        default="none",
        description="AES-256-CBC-encrypted landing files; the keys come from the keyring "
        "(`CDC_KEYRING`).",
    )
    null_string: OptionalString = Field(
        default=None, description="CSV: the cell value that means NULL."
    )
    unmodified_string: OptionalString = Field(
        default=None, description='CSV: the cell value that means "column unchanged".'
    )
    columns: CsvColumns = Field(
        default_factory=dict,
        description="CSV: the type of every column, the key included (Spark SQL names, or "
        "`decimal(p,s)`).",
    )
    lookback_hours: PositiveInt = Field(
        default=6, description="Landing sensor: hours re-checked for new files each tick."
    )
    full_sweep_minutes: PositiveInt = Field(
        default=60,
        description="Landing sensor: how often every hour folder is re-checked (for very late "
        "files).",
    )
    sensor_interval_seconds: PositiveInt = Field(
        default=60, description="Landing sensor: seconds between ticks."
    )
    current_table: Boolean = Field(
        default=False,
        description="Also keep `<table>_current`: one row per live key (SCD1), refreshed after "
        "each run.",
    )
    track_history_columns: ColumnList = Field(
        default=None,
        description="Only changes to these data columns open a new version (never with "
        "`ignore_history_columns`).",
    )
    ignore_history_columns: ColumnList = Field(
        default=None,
        description="Changes to these data columns alone open no version (never with "
        "`track_history_columns`).",
    )
    hash_columns: ColumnList = Field(
        default=None,
        description="Data or key columns stored as the salted SHA-256 of their value (hex): "
        "equal values stay equal, so joins work; the salt is the keyring's `hash_salt` and "
        "never reaches the warehouse. Recorded by the table's first run; the `protect_columns` "
        "job rewrites a table for a changed list.",
    )
    block_columns: ColumnList = Field(
        default=None,
        description="Columns dropped as each file is read: never in the change log, the "
        "tables, a quarantine reason or metadata (never a key column). Recorded by the table's "
        "first run; the `protect_columns` job rewrites a table for a changed list.",
    )
    widen_types: WidenTypes = Field(
        default="data",
        description="Which column types a landing file may widen for good: `data` columns only, "
        "`all` (key columns too) or `never`; a file needing a widening not allowed is set aside.",
    )
    group: GroupName = Field(
        default=DEFAULT_GROUP,
        description="The Dagster asset group of the table's assets: the asset graph shows a "
        "group as one box, so hundreds of tables stay navigable when grouped by source or domain.",
    )
    max_file_bytes: PositiveInt = Field(
        default=DEFAULT_MAX_BYTES,
        description="A landing file whose plaintext (decrypted and decompressed; for Parquet, "
        "what its rows decode to, counted batch by batch as they are read) is larger is set "
        "aside, decoding stopped there: a decompression bomb costs a reading task about twice "
        "this much memory at most.",
    )
    expected_delivery_hours: PositiveInt | None = Field(
        default=None,
        description="The source's expected delivery cadence: no new data for this many hours "
        "makes the table late (WARN) in Dagster's freshness, twice as many stale (FAIL). Unset: "
        "no expectation (a `discover:` template's tables: 24).",
    )
    retry_backoff_seconds: PositiveInt = Field(
        default=300,
        description="Landing sensor: an hour requested but not applied yet (its run failed or "
        "died) is requested again after this many seconds, doubling with each retry up to an "
        "hour, until the applied-files ledger shows its files read.",
    )
    unapplied_alert_minutes: PositiveInt = Field(
        default=60,
        description="An hour requested and still not applied this many minutes later (its runs "
        "failed, or wait in the queue) is alerted once, `hours_unapplied`, and `hours_applied` "
        "once no requested hour is left unapplied; more than twice `retry_backoff_seconds`.",
    )

    @model_validator(mode="after")
    def _keys_agree(self) -> TableConfig:
        if self.null_string is not None and self.null_string == self.unmodified_string:
            raise FieldProblem("must differ from null_string", "unmodified_string")
        self._check_key()
        problem = FORMATS[self.format].config_problem(self.file_key, self.columns)
        if problem:
            raise FieldProblem(problem, "columns")
        if self.unapplied_alert_minutes * 60 <= 2 * self.retry_backoff_seconds:
            # An hour is first looked at again after one backoff: a healthy table would alert.
            raise FieldProblem(
                f"{self.unapplied_alert_minutes} min must be longer than twice "
                f"retry_backoff_seconds ({self.retry_backoff_seconds} s)",
                "unapplied_alert_minutes",
            )
        self._check_history_columns()
        self._check_protected_columns()
        return self

    def _check_protected_columns(self) -> None:
        """A column is hashed or blocked, not both; a key column is never blocked."""
        hashed = {c.lower() for c in self.hash_columns or ()}
        both = [c for c in self.block_columns or () if c.lower() in hashed]
        if both:
            raise FieldProblem(f"column(s) {both} are hashed too: give each once", "block_columns")
        history = {c.lower() for c in self.track_history_columns or ()}
        history |= {c.lower() for c in self.ignore_history_columns or ()}
        listed = [c for c in self.block_columns or () if c.lower() in history]
        if listed:
            raise FieldProblem(
                f"column(s) {listed} are in a history-column list, but never stored",
                "block_columns",
            )
        key = {c.lower() for c in self.file_key}
        in_key = [c for c in self.block_columns or () if c.lower() in key]
        if in_key:
            raise FieldProblem(
                f"primary key column(s) {in_key} cannot be blocked (hash them instead)",
                "block_columns",
            )

    def _check_key(self) -> None:
        """A key or ``keyless``, one of them; a keyless table's id needs every cell of every
        row (HISTORY_MODE section 3), so no unmodified cells and no selective history."""
        if self.primary_key is None and not self.keyless:
            raise FieldProblem(KEY_REQUIRED, "primary_key")
        if not self.keyless:
            return
        if self.primary_key is not None:
            raise FieldProblem("give primary_key or keyless: true, not both", "keyless")
        if self.unmodified_string is not None:
            raise FieldProblem(
                "a keyless table's rows are identified by all their values: a row with "
                "unmodified cells has no id",
                "unmodified_string",
            )
        for key in ("track_history_columns", "ignore_history_columns"):
            if getattr(self, key) is not None:
                raise FieldProblem(
                    "a keyless table's row is a new id whenever any column changes", key
                )
        if self.widen_types == "all":
            raise FieldProblem(
                "a keyless table's types never widen: a widened value would hash to another id",
                "widen_types",
            )

    @property
    def key(self) -> tuple[str, ...]:
        """The history table's key columns: the configured key, or ``_fivetran_id``."""
        return (ROW_ID,) if self.keyless else tuple(self.primary_key or ())

    @property
    def file_key(self) -> tuple[str, ...]:
        """The key columns every landing file must carry (none for a keyless table: its id is
        computed from the row)."""
        return () if self.keyless else self.key

    def _check_history_columns(self) -> None:
        """Never a key column, never both lists (``history_columns``)."""
        if self.track_history_columns is not None and self.ignore_history_columns is not None:
            raise FieldProblem(
                "give track_history_columns or ignore_history_columns, not both",
                "ignore_history_columns",
            )
        for key in ("track_history_columns", "ignore_history_columns"):
            key_columns = {k.lower() for k in self.key}
            in_key = [c for c in getattr(self, key) or () if c.lower() in key_columns]
            if in_key:
                raise FieldProblem(
                    f"primary key column(s) {in_key} always identify the version", key
                )

    @property
    def start_partition_key(self) -> str:
        return self.start.strftime(PARTITION_FORMAT)

    @property
    def history_columns(self) -> HistoryColumns:
        """Which data columns open a new version when they change (default: every one)."""
        if self.track_history_columns is not None:
            return HistoryColumns(track=self.track_history_columns)
        return HistoryColumns(ignore=self.ignore_history_columns or ())

    def may_widen(self, column: str) -> bool:
        """Whether a file may widen ``column``'s type in the change log and the tables."""
        if self.keyless:  # a widened value would hash to another id
            return False
        if self.widen_types == "all":
            return True
        return self.widen_types == "data" and column not in self.key

    @property
    def protects_columns(self) -> bool:
        """True when some column is hashed or blocked as files are read (``landing.rows.pii``)."""
        return bool(self.hash_columns or self.block_columns)

    @property
    def needs_keyring(self) -> bool:
        """True when reading the table's files takes the keyring: keys, or the hash salt."""
        return self.encryption != "none" or bool(self.hash_columns)

    @property
    def is_encoded(self) -> bool:
        """True when files are decoded into memory before their format reads them (decrypted,
        decompressed, or a format not read in place: CSV); False: plain Parquet."""
        in_place = FORMATS[self.format].reads_in_place
        return not in_place or self.compression != "none" or self.encryption != "none"


@dataclass(frozen=True, config=_STRICT)
class DiscoverTemplate:
    """``discover:``: what an unlisted table folder gets (everything else is the default)."""

    primary_key: OptionalPrimaryKey = Field(
        default=None, description="Every discovered table's primary key (or `keyless: true`)."
    )
    start: Start = Field(kw_only=True, description="Every discovered table's first partition.")
    keyless: Boolean = Field(
        default=False,
        kw_only=True,
        description="Every discovered table is keyless (`_fivetran_id`), instead of `primary_key`.",
    )
    expected_delivery_hours: PositiveInt = Field(
        default=DEFAULT_DELIVERY_HOURS,
        description="Every discovered table's expected delivery cadence (freshness).",
    )

    @property
    def start_partition_key(self) -> str:
        return self.start.strftime(PARTITION_FORMAT)

    @model_validator(mode="after")
    def _one_key(self) -> DiscoverTemplate:
        """A key or ``keyless``, one of them, as a listed table's."""
        if self.primary_key is None and not self.keyless:
            raise FieldProblem(KEY_REQUIRED, "primary_key")
        if self.primary_key is not None and self.keyless:
            raise FieldProblem("give primary_key or keyless: true, not both", "keyless")
        return self


@dataclass(frozen=True, config=_STRICT)
class PlatformConfig:
    """The whole config file, with paths already resolved against the file's folder."""

    landing_root: LandingRoot = Field(
        description="The landing zone: `<landing_root>/<table>/year=YYYY/month=MM/day=DD/"
        "hour=HH/<file>`. A local or mounted folder (or `file://`), relative to the config "
        "file's folder, or an S3 prefix `s3://bucket/prefix` (`s3a://`; any S3-compatible "
        "store through `aws_endpoint_url`). Never the warehouse root, inside it or around it."
    )
    warehouse_root: RootLocation = Field(
        description="Where the history tables are written: a folder, `file://`, `s3://` "
        "(`s3a://`), `gs://` or `abfss://`. Never the landing root, inside it or around it."
    )
    tables: tuple[TableConfig, ...] = Field(
        default=(),
        description="The tables (keys below). May be empty or left out when `discover:` is given.",
    )
    check_schedule: Cron = Field(
        default="0 3 * * *",
        description="When the `cdc_full_table_checks` job runs every invariant check over "
        "every table.",
    )
    maintenance_schedule: Cron = Field(
        default="30 4 * * *",
        description="When each table's maintenance (compaction, then VACUUM) runs; a plain "
        "daily time is spread per table over `schedule_window_minutes`.",
    )
    schedule_window_minutes: Minutes = Field(
        default=120,
        description="Each table's maintenance starts this many minutes after "
        "`maintenance_schedule` at most, at a place derived from its name, so a fleet does not "
        "start at one minute.",
    )
    source: SkipJsonSchema[Path | None] = Field(
        default=None, description="The file this config was read from (not a key of the file)."
    )
    discover: DiscoverTemplate | None = Field(
        default=None,
        description="A template giving every unlisted plain-Parquet landing folder an asset "
        "(keys below); without it such folders are only reported by the `cdc_new_tables` sensor.",
    )
    snapshot_roots: SnapshotRoots = Field(
        default=(),
        description="The only folders `resync_table` may read a snapshot from (relative: to "
        "the config file); none: it refuses every run.",
    )
    adoption_roots: AdoptionRoots = Field(
        default=(),
        description="The only folders or object-store prefixes `adopt_table` may read a source "
        "from; none: it refuses every run.",
    )
    landing_sensor: LandingSensor = Field(
        default="per_table",
        description="`per_table`: a landing sensor per table, each hour range of a table its "
        "own run. `fleet`: one landing sensor for every table (a fleet idles at one tick a "
        "minute, not one per table) whose runs apply one hour range for up to `tables_per_run` "
        "tables, and one maintenance schedule, `cdc_maintenance_schedule`, starting each table "
        "at its spread minute.",
    )
    tables_per_run: TablesPerRun = Field(
        default=1,
        description="With `landing_sensor: fleet`: how many tables one run applies (the same "
        "hour range, each table its own step and commit; a failing table fails only its step).",
    )
    warehouse_storage_options: StorageOptions = Field(
        default=None,
        repr=False,
        description="delta-rs storage options for an object-store `warehouse_root`, passed on "
        "as they are; a value may be `{env: NAME}`, and a secret (`*secret*`, `*_key`, "
        "`*_token`, ...) must be. Read into `warehouse_root`.",
    )

    landing_storage_options: StorageOptions = Field(
        default=None,
        repr=False,
        description="For an `s3://` `landing_root`: the same options, with the same names and "
        "`{env: NAME}` rule, as `warehouse_storage_options` (`aws_access_key_id`, "
        "`aws_secret_access_key`, `aws_session_token`, `aws_region`, `aws_endpoint_url`, "
        "`aws_virtual_hosted_style_request`). Without them the AWS SDK's own chain is used "
        "(environment, profile, instance role). Read into `landing_root`.",
    )

    @model_validator(mode="after")
    def _keys_agree(self) -> PlatformConfig:
        self._attach_storage_options()
        self._attach_landing_options()
        self._check_table_names()
        if self.warehouse_root.is_local and isinstance(self.landing_root, Path):
            self._check_roots_apart()
        elif isinstance(self.landing_root, Location) and overlaps(
            self.landing_root, self.warehouse_root
        ):
            raise FieldProblem(
                f"{self.landing_root} and warehouse_root {self.warehouse_root} overlap",
                "landing_root",
            )
        self._check_source_roots()
        if self.tables_per_run > 1 and self.landing_sensor != "fleet":
            raise FieldProblem(
                f"{self.tables_per_run} tables in one run need 'landing_sensor: fleet' (one "
                "sensor sees every table's new hours)",
                "tables_per_run",
            )
        return self

    def _attach_storage_options(self) -> None:
        """The options travel with the root (``Location``): every delta-rs call gets them."""
        options, carried = self.warehouse_storage_options, dict(self.warehouse_root.options)
        if options is None:
            return
        if self.warehouse_root.is_local:
            raise FieldProblem(
                "storage options are for an object-store warehouse_root ("
                + ", ".join(s + "://" for s in OBJECT_STORE_SCHEMES)
                + "), not a local folder",
                "warehouse_storage_options",
            )
        if options == carried:
            return
        if carried:
            raise FieldProblem(
                "warehouse_root carries other storage options: give them once",
                "warehouse_storage_options",
            )
        self._attach(options, "warehouse_root")

    def _attach_landing_options(self) -> None:
        """The landing options travel with its root, as the warehouse's do."""
        options = self.landing_storage_options
        if options is None:
            return
        if not isinstance(self.landing_root, Location):
            raise FieldProblem(
                "storage options are for an s3:// landing_root, not a local folder",
                "landing_storage_options",
            )
        self._attach(options, "landing_root")

    def _attach(self, options: dict[str, OptionValue], key: str) -> None:
        """The root at ``key`` as a Location carrying ``options`` (set in place: the model is
        still in validation)."""
        object.__setattr__(self, key, Location(getattr(self, key).uri, options))

    def _check_table_names(self) -> None:
        names = [t.name.lower() for t in self.tables]
        dupes = sorted({t.name for t in self.tables if names.count(t.name.lower()) > 1})
        if dupes:
            # case-insensitive: on such file systems 'Orders' and 'orders' are one folder
            raise FieldProblem(f"table name(s) defined twice: {dupes}", "")
        for t in self.tables:
            if t.current_table and current_table_name(t.name).lower() in names:
                # one folder and one asset key for two tables
                raise FieldProblem(
                    f"table '{t.name}', field 'current_table': its current table "
                    f"'{current_table_name(t.name)}' has the name of another table",
                    "",
                )

    def _check_roots_apart(self) -> None:
        """The roots must not overlap: a VACUUM of a table would see landing files as its own
        stray files, and a landing folder would see the platform's files as data."""
        assert isinstance(self.landing_root, Path)  # a local landing root: the caller's check
        landing, warehouse = self.landing_root.resolve(), self.warehouse_root.path.resolve()
        if landing == warehouse:
            raise FieldProblem("the same folder as landing_root", "warehouse_root")
        if landing in warehouse.parents:
            raise FieldProblem(f"{warehouse} is inside landing_root {landing}", "warehouse_root")
        if warehouse in landing.parents:
            raise FieldProblem(f"{landing} is inside warehouse_root {warehouse}", "landing_root")

    def _check_source_roots(self) -> None:
        """The landing and warehouse roots are never a source an operator job reads."""
        platform = (
            checked_root(self.landing_root, "landing_root"),
            checked_root(self.warehouse_root, "root"),  # symbolic links resolved
        )
        for key in ("snapshot_roots", "adoption_roots"):
            for root in getattr(self, key):
                for platform_root in platform:
                    if overlaps(root, platform_root):
                        raise FieldProblem(
                            f"{root} overlaps {platform_root}: the landing and warehouse roots"
                            " are never a source",
                            key,
                        )

    @property
    def landing_path(self) -> Path:
        """The landing folder, for what only a folder has (the demo's generator, tests); a
        bucket has none (the error names it)."""
        if not isinstance(self.landing_root, Path):
            raise ValueError(f"landing_root {self.landing_root} is a bucket, not a folder")
        return self.landing_root

    def table(self, name: str) -> TableConfig:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(f"no table named {name!r} in {self.source}")
