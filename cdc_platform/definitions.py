"""The Dagster code location: ``dagster dev`` / ``dagster asset materialize -m cdc_platform.definitions``.

Reads the config file (``CDC_PLATFORM_CONFIG``, default ``cdc_platform.yaml``) and builds one
asset, one set of checks and one landing sensor per table. Nothing heavier happens at import:
no Spark session, no key, no file listing.
"""

from cdc_platform.defs.factory import build_definitions
from cdc_platform.lib.config import load_config

defs = build_definitions(load_config())
