"""Reading the config file into ``models.PlatformConfig``, and its errors into one line each
naming the table and the key (``where: table 'orders', field 'start': why``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from cdc_platform.lib.config.fields import FieldProblem
from cdc_platform.lib.config.models import DiscoverTemplate, PlatformConfig, TableConfig
from cdc_platform.lib.errors import Refusal

CONFIG_ENV_VAR = "CDC_PLATFORM_CONFIG"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONFIG_PATH = REPO_ROOT / "cdc_platform.yaml"

# Fields the loader sets, never the file.
_NOT_IN_FILE = {"source"}
_PLATFORM = TypeAdapter(PlatformConfig)


class ConfigError(Refusal):
    """The config file is invalid; the message names the table and the field."""


def file_keys(model: type) -> list[str]:
    """The keys a config file may give for ``model`` (its fields, in their order)."""
    return [name for name in model.__pydantic_fields__ if name not in _NOT_IN_FILE]  # type: ignore[attr-defined]


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
    """The file's mapping as a ``PlatformConfig``; relative paths are against ``base_dir``."""
    where = str(source or "config")
    _check_shape(raw, where)
    # A key left out of a table is None to its validator, which says what it should be.
    filled = {**raw, "source": source, "tables": [_filled(t) for t in raw.get("tables") or ()]}
    if isinstance(raw.get("discover"), dict):
        filled["discover"] = _filled(raw["discover"], ("primary_key", "start"))
    try:
        return _PLATFORM.validate_python(filled, context={"base_dir": base_dir})
    except ValidationError as exc:
        errors = exc.errors()
    # Raised outside the handler: pydantic's error, which holds the refused values (a secret
    # among them), is not this one's context.
    raise ConfigError("\n".join(dict.fromkeys(_message(e, raw, where) for e in errors)))


def _filled(
    raw: dict[str, Any], keys: tuple[str, ...] = ("name", "primary_key", "start")
) -> dict[str, Any]:
    """A required key left out is None to its validator, which says what it should be."""
    return {**dict.fromkeys(keys), **raw}


def _check_shape(raw: Any, where: str) -> None:
    """What the models cannot say: unknown and missing keys in the file's words, and that a
    file lists its tables unless it discovers them."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    allowed = file_keys(PlatformConfig)
    unknown = sorted(str(k) for k in set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    if "discover" in raw and not isinstance(raw["discover"], dict):
        raise ConfigError(
            f"{where}: field 'discover' must be a mapping such as "
            '{primary_key: [id], start: "2024-01-01-00:00"}'
        )
    discovers = "discover" in raw
    for key in ("landing_root", "warehouse_root", *(() if discovers else ("tables",))):
        if key not in raw:
            raise ConfigError(f"{where}: missing required key '{key}'")
    tables = raw.get("tables")
    if discovers and tables is None:
        return  # `tables:` absent or empty: every table is discovered
    if not isinstance(tables, list) or (not tables and not discovers):
        raise ConfigError(
            f"{where}: 'tables' must be a list"
            if discovers
            else f"{where}: 'tables' must be a non-empty list (or give a 'discover' template)"
        )
    for index, table in enumerate(tables):
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: tables[{index}] must be a mapping")
        for key in ("track_history_columns", "ignore_history_columns"):
            if key in table and table[key] is None:  # `key:` with no value: not "every column"
                name = table.get("name")
                label = f"table '{name}'" if isinstance(name, str) else f"tables[{index}]"
                raise ConfigError(
                    f"{where}: {label}, field '{key}': must be a list of column names"
                )


def _message(error: ErrorDetails, raw: dict[str, Any], where: str) -> str:
    """One pydantic error as ``where: [table 'x', | discover, ]field 'key': why``."""
    loc, label = list(error["loc"]), ""
    if loc[:1] == ["tables"] and len(loc) > 1 and isinstance(loc[1], int):
        name = raw["tables"][loc[1]].get("name")
        label = f"table '{name}', " if isinstance(name, str) else f"tables[{loc[1]}], "
        loc = loc[2:]
    problem = error.get("ctx", {}).get("error")
    if loc[:1] == ["discover"] and (len(loc) > 1 or isinstance(problem, FieldProblem)):
        label, loc = "discover, ", loc[1:]
    key = str(loc[0]) if loc else None
    if isinstance(problem, FieldProblem) and problem.field is not None:
        key = problem.field or None
        if not key:
            return f"{where}: {label}{problem}"
    why = str(problem) if isinstance(problem, ValueError) else _pydantic_why(error, label)
    return f"{where}: {label}field '{key}': {why}" if key else f"{where}: {label}{why}"


def _pydantic_why(error: ErrorDetails, label: str) -> str:
    """The words for an error pydantic raised itself (a key left out, an unknown key, a type)."""
    if error["type"] == "missing":
        return "required"
    if error["type"] == "unexpected_keyword_argument":
        model = DiscoverTemplate if label.startswith("discover") else TableConfig
        return f"unknown key; allowed: {sorted(file_keys(model))}"
    if error["type"] in ("dataclass_type", "dataclass_exact_type"):
        return 'must be a mapping such as {primary_key: [id], start: "2024-01-01-00:00"}'
    return error["msg"]


def json_schema() -> dict[str, Any]:
    """The config file's JSON Schema, for an editor's completion and checking as one types.

    Stricter than the parser in one way only: choices are written in lower case."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **_PLATFORM.json_schema(mode="validation"),
        "title": "cdc_platform config",
        "required": ["landing_root", "warehouse_root"],
        # tables: or discover: (`tables:` may then be empty, or left without a value)
        "anyOf": [{"required": ["tables"]}, {"required": ["discover"]}],
    }
    tables = schema["properties"]["tables"]
    schema["properties"]["tables"] = {
        "anyOf": [{"type": "array", "items": tables["items"]}, {"type": "null"}],
        **{k: v for k, v in tables.items() if k not in ("type", "items")},
    }
    columns = schema["$defs"]["TableConfig"]["properties"]["columns"]
    columns["type"] = ["object", "null"]
    return schema
