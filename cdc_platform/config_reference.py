"""The configuration reference page (``docs/configuration.md``), generated from the code.

``python -m cdc_platform.config_reference --write`` writes the page; ``--check`` exits 1 when
the committed page differs (``cdc_platform_tests/test_docs.py`` fails the same way). Nothing
here is typed twice where the code already says it:

* the platform config's keys are ``lib.config``'s own sets of allowed keys, its defaults are
  read off a minimal config parsed by ``lib.config.parse_config`` and its choices are the
  module's constants; only the one-line descriptions live here (a key without one, or a
  description of a key the parser no longer allows, is an error);
* resources and jobs come from the code location itself: ``build_definitions`` over a
  one-table config, each job's ops and the ``dg.Config`` class each op takes, each resource's
  ``ConfigurableResource`` class; types, defaults and descriptions are the pydantic fields'.

The platform part imports no Dagster; the resource and job part imports it when it runs.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from cdc_platform.lib import config as cfg
from cdc_platform.lib.history.versions import HistoryColumns
from cdc_platform.lib.landing.formats import FORMATS

PAGE = cfg.REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m cdc_platform.config_reference --write"
# The table name the reference's code location is built with; per-table names show it as <table>.
EXAMPLE_TABLE = "example_table"

_MINIMAL_TABLE = {"name": EXAMPLE_TABLE, "primary_key": ["id"], "start": "2024-01-01-00:00"}

# (type, description) of every key lib.config allows. The type of a key with fixed choices is
# taken from lib.config's constants instead (see _TABLE_CHOICES).
TOP_KEYS: dict[str, tuple[str, str]] = {
    "landing_root": (
        "path",
        "The landing zone: `<landing_root>/<table>/year=YYYY/month=MM/day=DD/hour=HH/<file>`. "
        "A local or mounted folder (or `file://`); relative to the config file's folder.",
    ),
    "warehouse_root": (
        "path or URI",
        "Where the history tables are written: a folder, `file://`, `s3://` (`s3a://`), "
        "`gs://` or `abfss://`. Never the landing root, inside it or around it.",
    ),
    "warehouse_storage_options": (
        "mapping",
        "delta-rs storage options for an object-store `warehouse_root`, passed on as they are; "
        "a value may be `{env: NAME}`, and a secret (`*secret*`, `*_key`, `*_token`, ...) must be.",
    ),
    "tables": (
        "list of tables",
        "The tables (keys below). May be empty or left out when `discover:` is given.",
    ),
    "check_schedule": (
        "cron (UTC)",
        "When the `cdc_full_table_checks` job runs every invariant check over every table.",
    ),
    "maintenance_schedule": (
        "cron (UTC)",
        "When each table's maintenance (compaction, then VACUUM) runs; a plain daily time is "
        "spread per table over `schedule_window_minutes`.",
    ),
    "schedule_window_minutes": (
        "minutes (1-1440)",
        "Each table's maintenance starts this many minutes after `maintenance_schedule` at most, "
        "at a place derived from its name, so a fleet does not start at one minute.",
    ),
    "landing_sensor": (
        "`per_table` or `fleet`",
        "`per_table`: a landing sensor per table, each hour range of a table its own run. "
        "`fleet`: one landing sensor for every table (a fleet idles at one tick a minute, not "
        "one per table) whose runs apply one hour range for up to `tables_per_run` tables, "
        "and one maintenance schedule, `cdc_maintenance_schedule`, starting each table at its "
        "spread minute.",
    ),
    "tables_per_run": (
        "tables (1-100)",
        "With `landing_sensor: fleet`: how many tables one run applies (the same hour range, "
        "each table its own step and commit; a failing table fails only its step).",
    ),
    "discover": (
        "mapping",
        "A template giving every unlisted plain-Parquet landing folder an asset (keys below); "
        "without it such folders are only reported by the `cdc_new_tables` sensor.",
    ),
    "snapshot_roots": (
        "list of folders",
        "The only folders `resync_table` may read a snapshot from (relative: to the config "
        "file); none: it refuses every run.",
    ),
    "adoption_roots": (
        "list of folders or URIs",
        "The only folders or object-store prefixes `adopt_table` may read a source from; "
        "none: it refuses every run.",
    ),
}
TABLE_KEYS: dict[str, tuple[str, str]] = {
    "name": (
        "string",
        "The table: its landing folder, asset and warehouse folder. Letters, digits and `_`, "
        "not starting with a digit or `_`.",
    ),
    "primary_key": ("list of columns", "The key columns (a single name is a one-column list)."),
    "start": ("`YYYY-MM-DD-HH:00`", "The first hourly partition (UTC)."),
    "format": (
        "",
        "How landing files are written: "
        + "; ".join(f"`{f.name}`, {f.summary}" for f in FORMATS.values())
        + " (one module each in `lib/landing/formats/`).",
    ),
    "compression": ("", "ZSTD-compressed landing files (Fivetran's batch-file format)."),
    "encryption": (
        "",
        "AES-256-CBC-encrypted landing files; the keys come from the keyring (`CDC_KEYRING`).",
    ),
    "null_string": ("string", "CSV: the cell value that means NULL."),
    "unmodified_string": ("string", 'CSV: the cell value that means "column unchanged".'),
    "columns": ("", "CSV: the type of every column, the key included."),
    "lookback_hours": ("positive int", "Landing sensor: hours re-checked for new files each tick."),
    "full_sweep_minutes": (
        "positive int",
        "Landing sensor: how often every hour folder is re-checked (for very late files).",
    ),
    "sensor_interval_seconds": ("positive int", "Landing sensor: seconds between ticks."),
    "current_table": (
        "boolean",
        "Also keep `<table>_current`: one row per live key, refreshed after each run.",
    ),
    "track_history_columns": (
        "list of columns",
        "Only changes to these data columns open a new version (never with `ignore_history_columns`).",
    ),
    "ignore_history_columns": (
        "list of columns",
        "Changes to these data columns alone open no version (never with `track_history_columns`).",
    ),
    "widen_types": (
        "",
        "Which column types a landing file may widen for good: `data` columns only, `all` "
        "(key columns too) or `never`.",
    ),
    "group": (
        "name",
        "The Dagster asset group of the table's assets: the asset graph shows a group as one "
        "box, so hundreds of tables stay navigable when grouped by source or domain.",
    ),
    "max_file_bytes": (
        "positive int",
        "A landing file whose plaintext (decrypted and decompressed; for Parquet, its "
        "uncompressed row groups) is larger is set aside, decoding stopped there: a "
        "decompression bomb costs a reading task about twice this much memory at most. Default "
        "2 GiB.",
    ),
    "expected_delivery_hours": (
        "positive int",
        "The source's expected delivery cadence: no new data for this many hours makes the table "
        "late (WARN) in Dagster's freshness, twice as many stale (FAIL). Unset: no expectation "
        "(a `discover:` template's tables: 24).",
    ),
    "retry_backoff_seconds": (
        "positive int",
        "Landing sensor: an hour requested but not applied yet (its run failed or died) is "
        "requested again after this many seconds, doubling with each retry up to an hour, "
        "until the applied-files ledger shows its files read.",
    ),
    "unapplied_alert_minutes": (
        "positive int",
        "An hour requested and still not applied this many minutes later (its runs failed, or "
        "wait in the queue) is alerted once, `hours_unapplied`, and `hours_applied` once no "
        "requested hour is left unapplied; default 60, more than twice `retry_backoff_seconds`.",
    ),
}
DISCOVER_KEYS: dict[str, tuple[str, str]] = {
    "primary_key": ("list of columns", "Every discovered table's primary key."),
    "start": ("`YYYY-MM-DD-HH:00`", "Every discovered table's first partition."),
    "expected_delivery_hours": (
        "positive int",
        "Every discovered table's expected delivery cadence (freshness; default 24).",
    ),
}
_TABLE_CHOICES: dict[str, tuple[str, ...]] = {
    "format": cfg.FORMATS,
    "compression": cfg.COMPRESSIONS,
    "encryption": cfg.ENCRYPTIONS,
    "widen_types": cfg.WIDEN_TYPES,
}
# Required keys and how the parser's result names a key's default when it is not an attribute.
_REQUIRED = {"landing_root", "warehouse_root", "name", "primary_key", "start"}
_TABLES_REQUIRED = "required without `discover:`"

# Descriptions of resource and job fields whose class gives none (prefer `Field(description=...)`
# in the class: an entry here for a field that has one, or that no longer exists, is an error).
FALLBACK_DESCRIPTIONS: dict[str, str] = {
    "AlertWebhookResource.webhook_url": "A Slack-compatible incoming webhook; none: no alert is "
    "sent. The code location sets it from `CDC_ALERT_WEBHOOK_URL`.",
    "AlertWebhookResource.ui_base_url": "The Dagster UI's public address, for the run links in "
    "alerts. The code location sets it from `CDC_UI_BASE_URL` when that is set.",
    "AlertWebhookResource.timeout_seconds": "Seconds before a delivery counts as failed "
    "(it is retried on later ticks).",
}


class ReferenceError(RuntimeError):
    """The code and the descriptions here disagree (a key without a description, or the like)."""


# -- the platform config (no Dagster) ---------------------------------------------------------


def check_descriptions() -> None:
    """Every key ``lib.config`` allows has a description here, and no description is stale."""
    problems = []
    for what, allowed, described in (
        ("top-level", cfg._TOP_FIELDS, TOP_KEYS),
        ("table", cfg._TABLE_FIELDS, TABLE_KEYS),
        ("discover", cfg._DISCOVER_FIELDS, DISCOVER_KEYS),
    ):
        if missing := sorted(set(allowed) - set(described)):
            problems.append(f"{what} key(s) {missing} have no description in {__name__}")
        if stale := sorted(set(described) - set(allowed)):
            problems.append(f"{what} key(s) {stale} are described but lib.config refuses them")
    if problems:
        raise ReferenceError("; ".join(problems))


def _minimal(base_dir: Path) -> cfg.PlatformConfig:
    return cfg.parse_config(
        {
            "landing_root": "landing",
            "warehouse_root": "warehouse",
            "tables": [dict(_MINIMAL_TABLE)],
            "discover": {"primary_key": ["id"], "start": _MINIMAL_TABLE["start"]},
        },
        base_dir=base_dir,
    )


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, HistoryColumns):
        return "every column" if value == HistoryColumns() else f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list | tuple) and not value:
        return "`[]`"
    if isinstance(value, dict) and not value:
        return "`{}`"
    return f"`{value}`"


def _platform_default(key: str, parsed: object, absent: object = None) -> str:
    if key in _REQUIRED:
        return "required"
    if key == "tables":
        return _TABLES_REQUIRED
    if key in ("track_history_columns", "ignore_history_columns"):
        return _value(parsed.history_columns)  # type: ignore[attr-defined]
    if key == "warehouse_storage_options":
        return "`{}`"
    if key == "discover":
        return _value(absent)
    if not hasattr(parsed, key):
        raise ReferenceError(f"no default found for config key {key!r}")
    return _value(getattr(parsed, key))


def _table_type(key: str, text: str) -> str:
    if key in _TABLE_CHOICES:
        return " \\| ".join(f"`{c}`" for c in _TABLE_CHOICES[key])
    if key == "columns":
        return (
            "mapping column → "
            + " \\| ".join(f"`{t}`" for t in cfg.CSV_TYPES)
            + " \\| `decimal(p,s)`"
        )
    return text


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |" for row in rows]
    return out


def platform_reference() -> list[str]:
    """The platform config's three tables of keys (Markdown lines)."""
    check_descriptions()
    with tempfile.TemporaryDirectory() as folder:
        parsed = _minimal(Path(folder))
    table, discover = parsed.tables[0], parsed.discover
    lines = [
        "## The platform config file",
        "",
        f"YAML, named by `{cfg.CONFIG_ENV_VAR}` (default: `cdc_platform.yaml` at the repo root). "
        "Parsing is strict: an unknown key, a missing primary key or a bad date is an error "
        "naming the table and the field. How to write one: "
        "[getting started](getting-started.md).",
        "",
        "### Top-level keys",
        "",
    ]
    top_defaults = {k: _platform_default(k, parsed) for k in TOP_KEYS}
    lines += _table(
        ("key", "type", "default", "description"),
        [(f"`{k}`", t, top_defaults[k], d) for k, (t, d) in _ordered(TOP_KEYS, cfg._TOP_FIELDS)],
    )
    lines += ["", "### A table (an entry of `tables:`)", ""]
    lines += _table(
        ("key", "type", "default", "description"),
        [
            (f"`{k}`", _table_type(k, t), _platform_default(k, table), d)
            for k, (t, d) in _ordered(TABLE_KEYS, cfg._TABLE_FIELDS)
        ],
    )
    lines += ["", "### `discover:`", ""]
    lines += _table(
        ("key", "type", "default", "description"),
        [
            (f"`{k}`", t, "required" if hasattr(discover, k) else "", d)
            for k, (t, d) in _ordered(DISCOVER_KEYS, cfg._DISCOVER_FIELDS)
        ],
    )
    return lines


def _ordered(
    described: Mapping[str, tuple[str, str]], allowed: Any
) -> Iterator[tuple[str, tuple[str, str]]]:
    """The described keys in the order written here (checked to equal the allowed set)."""
    assert set(described) == set(allowed)
    yield from described.items()


# -- resources and jobs (Dagster) -------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "none"
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _field_rows(cls: type) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]
        if info.is_required():
            default = "required"
        elif info.default_factory is not None:
            default = _value(info.default_factory())  # type: ignore[call-arg]
        else:
            default = _value(info.default)
        description = info.description or FALLBACK_DESCRIPTIONS.get(f"{cls.__name__}.{name}")
        if not description:
            raise ReferenceError(
                f"{cls.__name__}.{name} has no description: give it Field(description=...)"
            )
        rows.append((f"`{name}`", _type_name(info.annotation), default, description))
    return rows


def _check_fallbacks(classes: list[type]) -> None:
    by_name = {c.__name__: c for c in classes}
    for key in FALLBACK_DESCRIPTIONS:
        cls_name, field_name = key.split(".")
        cls = by_name.get(cls_name)
        fields = getattr(cls, "model_fields", {})
        if field_name not in fields:
            raise ReferenceError(f"FALLBACK_DESCRIPTIONS[{key!r}]: no such field; remove it")
        if fields[field_name].description:
            raise ReferenceError(
                f"FALLBACK_DESCRIPTIONS[{key!r}]: the class describes it now; remove it"
            )


def _op_config_class(op: Any) -> type | None:
    """The ``dg.Config`` class an op's compute function takes (None: the op takes no config)."""
    import dagster as dg

    fn = getattr(getattr(op, "compute_fn", None), "decorated_fn", None)
    if fn is None:
        return None
    for annotation in typing.get_type_hints(fn).values():
        if (
            inspect.isclass(annotation)
            and issubclass(annotation, dg.Config)
            and not issubclass(annotation, dg.ConfigurableResource)
        ):
            return annotation
    return None


def _generic(name: str, per_table: bool) -> str:
    return name.replace(EXAMPLE_TABLE, "<table>") if per_table else name


def _yaml_value(default: str, type_name: str) -> str:
    if default == "none":
        return "null"
    if default == "required":
        plain = type_name.replace("`", "").replace(" \\| ", "|")
        return f"<{plain}>"
    return default.strip("`")


def dagster_reference() -> list[str]:
    """The resources and the jobs of the code location, built over a one-table config."""
    from cdc_platform.defs.factory import build_definitions

    with tempfile.TemporaryDirectory() as folder:
        platform = _minimal(Path(folder))
        # Only the listed table: discover: would list the (empty) landing zone.
        platform = cfg.PlatformConfig(
            platform.landing_root, platform.warehouse_root, platform.tables
        )
        defs = build_definitions(platform)
        repo = defs.get_repository_def()
    classes: list[type] = []
    lines = [
        "## Resources",
        "",
        "Set in the Launchpad under `resources: {<key>: {config: {...}}}`. Where Spark runs, its "
        "security settings and the keyring are the deployment's (environment variables, "
        "[deploying](deploying.md)), never a run's ([security](SECURITY.md)).",
    ]
    for key, resource in sorted((defs.resources or {}).items()):
        cls = type(resource)
        classes.append(cls)
        doc = inspect.getdoc(cls) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ").replace("``", "`")
        lines += ["", f"### `{key}` ({cls.__name__})", "", summary]
        rows = _field_rows(cls)
        lines += [
            "",
            *(
                _table(("field", "type", "default", "description"), rows)
                if rows
                else ["No fields."]
            ),
        ]
    lines += [
        "",
        "## Jobs",
        "",
        "Launched from the Launchpad (Jobs → the job → Launchpad) with the run config shown; "
        "what each does: [operating](operating.md). Asset materializations and checks are not "
        "jobs here: they are launched from the asset's page.",
    ]
    for job in sorted(repo.get_all_jobs(), key=lambda j: j.name):
        if job.name.startswith("__"):
            continue
        per_table = job.tags.get("cdc_platform/table") == EXAMPLE_TABLE
        name = _generic(job.name, per_table)
        lines += ["", f"### `{name}`", ""]
        if per_table:
            lines += ["One job per table (`<table>` is the table's name).", ""]
        if job.description:
            lines += [_generic(job.description, per_table), ""]
        ops = []
        for node in job.graph.node_defs:
            cls = _op_config_class(node)
            if cls is not None:
                classes.append(cls)
                ops.append((_generic(node.name, per_table), cls))
        if not ops:
            lines.append("No run config.")
            continue
        lines += ["```yaml", "ops:"]
        for op_name, cls in ops:
            lines += [f"  {op_name}:", "    config:"]
            for field, type_name, default, _ in _field_rows(cls):
                lines.append(f"      {field.strip('`')}: {_yaml_value(default, type_name)}")
        lines += ["```"]
        for _, cls in ops:
            lines += ["", *_table(("field", "type", "default", "description"), _field_rows(cls))]
    _check_fallbacks(classes)
    return lines


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the code by `" + COMMAND + "`: do not edit by hand. -->",
        "",
        "Generated from the code (`cdc_platform/lib/config.py` and the `Config` and "
        "`ConfigurableResource` classes under `cdc_platform/defs/`) by "
        f"`{COMMAND}`; a test fails when this page and the code disagree.",
        "",
        *platform_reference(),
        "",
        *dagster_reference(),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_platform.config_reference",
        description="Write or check docs/configuration.md, generated from the code.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--write", action="store_true", help=f"write {PAGE.relative_to(cfg.REPO_ROOT)}"
    )
    group.add_argument("--check", action="store_true", help="exit 1 if the committed page differs")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(cfg.REPO_ROOT)}")
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(
                f"{PAGE.relative_to(cfg.REPO_ROOT)} is out of date: run {COMMAND}", file=sys.stderr
            )
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
