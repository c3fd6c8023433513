"""The configuration reference page (``docs/configuration.md``) and the config file's JSON Schema
(``docs/cdc_platform.schema.json``), generated from the code.

``python -m cdc_platform.config_reference --write`` writes both; ``--check`` exits 1 when a
committed one differs (``cdc_platform_tests/integration/test_docs.py`` fails the same way). Nothing here is
typed twice where the code already says it:

* the platform config's keys, types, defaults and descriptions are the fields of
  ``lib.config.models`` (a key without a description is an error), its types read off the
  JSON Schema pydantic derives from them;
* resources and jobs come from the code location itself: ``build_definitions`` over a
  one-table config, each job's ops and the ``dg.Config`` class each op takes, each resource's
  ``ConfigurableResource`` class; types, defaults and descriptions are the pydantic fields'.

The platform part imports no Dagster; the resource and job part imports it when it runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

from cdc_platform.lib import config as cfg

PAGE = cfg.REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m cdc_platform.config_reference --write"
# The table name the reference's code location is built with; per-table names show it as <table>.
EXAMPLE_TABLE = "example_table"

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
SCHEMA = cfg.REPO_ROOT / "docs" / "cdc_platform.schema.json"

# The reference's words for the JSON Schema's string formats (``lib.config.fields``).
_FORMATS = {
    "path": "path",
    "uri-reference": "path or URI",
    "cron": "cron (UTC)",
    "hour": "`YYYY-MM-DD-HH:00`",
    "name": "name",
    "column": "column",
    "decimal": "`decimal(p,s)`",
}
_PLURALS = {"path or URI": "paths or URIs"}


class ReferenceError(RuntimeError):
    """The code and the descriptions here disagree (a key without a description, or the like)."""


# -- the platform config (no Dagster) ---------------------------------------------------------


def check_descriptions() -> None:
    """Every key of the config file has a description (``Field(description=...)``)."""
    missing = [
        f"{model.__name__}.{key}"
        for model in (cfg.PlatformConfig, cfg.TableConfig, cfg.DiscoverTemplate)
        for key in cfg.file_keys(model)
        if not model.__pydantic_fields__[key].description  # type: ignore[attr-defined]
    ]
    if missing:
        raise ReferenceError(f"config key(s) {missing} have no Field(description=...)")


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, list | tuple) and not value:
        return "`[]`"
    if isinstance(value, dict) and not value:
        return "`{}`"
    return f"`{value}`"


def _schema_type(prop: dict[str, Any]) -> str:
    """A key's type in words, read off its JSON Schema."""
    if "anyOf" in prop:
        kinds = [_schema_type(p) for p in prop["anyOf"] if p.get("type") != "null"]
        return " or ".join(kinds)
    if "enum" in prop:
        return " \\| ".join(f"`{c}`" for c in prop["enum"])
    if "$ref" in prop:
        return "mapping (keys below)"
    kind = prop.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "object" and set(prop.get("properties", {})) == {"env"}:
        return "`{env: NAME}`"
    if kind == "integer":
        low, high = prop.get("minimum"), prop.get("maximum")
        return "positive int" if (low, high) == (1, None) else f"int ({low}-{high})"
    if kind == "string":
        return _FORMATS.get(prop.get("format", ""), "string")
    if kind == "array":
        items = prop["items"]
        item = "table" if "$ref" in items else _schema_type(items)
        return f"list of {_PLURALS.get(item, item + 's')}"
    if kind == "object" and "additionalProperties" in prop:
        values = _schema_type(prop["additionalProperties"]).replace(" or ", " \\| ")
        return f"mapping name → {values}"
    return str(kind)


def _default(model: type, key: str) -> str:
    if model is cfg.PlatformConfig and key == "tables":
        return "required without `discover:`"
    if model is cfg.TableConfig and key == "primary_key":
        return "required without `keyless: true`"
    info = model.__pydantic_fields__[key]  # type: ignore[attr-defined]
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return _value(info.default_factory())
    return _value(info.default)


def _key_rows(model: type, schema: dict[str, Any]) -> list[tuple[str, ...]]:
    props = schema["properties"]
    return [
        (
            f"`{key}`",
            _schema_type(props[key]),
            _default(model, key),
            model.__pydantic_fields__[key].description,  # type: ignore[attr-defined]
        )
        for key in cfg.file_keys(model)
    ]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |" for row in rows]
    return out


def platform_reference() -> list[str]:
    """The platform config's three tables of keys (Markdown lines)."""
    check_descriptions()
    schema = cfg.json_schema()
    header = ("key", "type", "default", "description")
    lines = [
        "## The platform config file",
        "",
        f"YAML, named by `{cfg.CONFIG_ENV_VAR}` (default: `cdc_platform.yaml` at the repo root). "
        "Parsing is strict: an unknown key, a missing primary key or a bad date is an error "
        "naming the table and the field. How to write one: "
        "[getting started](getting-started.md).",
        "",
        f"An editor completes and checks the file with its JSON Schema, `{SCHEMA.name}` in this "
        "folder (generated with this page). With the YAML language server (VS Code's YAML "
        "extension and others), the file's first line",
        "",
        "```yaml",
        f"# yaml-language-server: $schema=docs/{SCHEMA.name}",
        "```",
        "",
        "names it (relative to the file; or map `cdc_platform*.yaml` to it in the editor's "
        "settings).",
        "",
        "### Top-level keys",
        "",
        *_table(header, _key_rows(cfg.PlatformConfig, schema)),
        "",
        "### A table (an entry of `tables:`)",
        "",
        *_table(header, _key_rows(cfg.TableConfig, schema["$defs"]["TableConfig"])),
        "",
        "### `discover:`",
        "",
        *_table(header, _key_rows(cfg.DiscoverTemplate, schema["$defs"]["DiscoverTemplate"])),
    ]
    return lines


def schema_text() -> str:
    return json.dumps(cfg.json_schema(), indent=2, ensure_ascii=False) + "\n"


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
    from cdc_platform.definitions import build_definitions

    with tempfile.TemporaryDirectory() as folder:
        table = {"name": EXAMPLE_TABLE, "primary_key": ["id"], "start": "2024-01-01-00:00"}
        raw = {"landing_root": "landing", "warehouse_root": "warehouse", "tables": [table]}
        platform = cfg.parse_config(raw, base_dir=Path(folder))
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
        "Generated from the code (the models in `cdc_platform/lib/config/models.py` and the "
        "`Config` and "
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
        description="Write or check docs/configuration.md and the config's JSON Schema, "
        "generated from the code.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="write both files")
    group.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = parser.parse_args(argv)
    files = {PAGE: render(), SCHEMA: schema_text()}
    if args.write:
        for path, text in files.items():
            path.write_text(text)
            print(f"wrote {path.relative_to(cfg.REPO_ROOT)}")
    elif args.check:
        stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
        for path in stale:
            print(
                f"{path.relative_to(cfg.REPO_ROOT)} is out of date: run {COMMAND}", file=sys.stderr
            )
        return 1 if stale else 0
    else:
        sys.stdout.write(files[PAGE])
    return 0


if __name__ == "__main__":
    sys.exit(main())
