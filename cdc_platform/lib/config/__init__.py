"""The platform's config file: which tables exist and how their landing files look.

The file is YAML, named by the env var ``CDC_PLATFORM_CONFIG`` (default: ``cdc_platform.yaml``
at the repo root). Parsing is strict: an unknown key, a missing primary key or a bad date is
an error naming the table and the field, so a typo never silently changes behaviour.

- ``fields``: the value of each key, with the validator that says what a wrong one should be;
- ``models``: the tables, the discover template and the platform, as pydantic dataclasses
  (types, defaults, descriptions, the rules between keys);
- ``loading``: the file into the models, and pydantic's errors into the file's words.

``docs/configuration.md`` and ``docs/cdc_platform.schema.json`` are generated from the models
(``python -m cdc_platform.config_reference --write``).
"""

from cdc_platform.lib.config.fields import (
    COMPRESSIONS,
    CSV_TYPES,
    ENCRYPTIONS,
    PARTITION_FORMAT,
    WIDEN_TYPES,
)
from cdc_platform.lib.config.loading import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_PATH,
    REPO_ROOT,
    ConfigError,
    config_path,
    file_keys,
    json_schema,
    load_config,
    parse_config,
)
from cdc_platform.lib.config.models import (
    DEFAULT_DELIVERY_HOURS,
    DEFAULT_GROUP,
    DiscoverTemplate,
    PlatformConfig,
    TableConfig,
)

__all__ = [
    "COMPRESSIONS",
    "CONFIG_ENV_VAR",
    "CSV_TYPES",
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_DELIVERY_HOURS",
    "DEFAULT_GROUP",
    "ENCRYPTIONS",
    "PARTITION_FORMAT",
    "REPO_ROOT",
    "WIDEN_TYPES",
    "ConfigError",
    "DiscoverTemplate",
    "PlatformConfig",
    "TableConfig",
    "config_path",
    "file_keys",
    "json_schema",
    "load_config",
    "parse_config",
]
