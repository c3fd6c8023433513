"""The Dagster code location: ``dagster dev`` / ``dagster asset materialize -m cdc_platform.definitions``.

Reads the config file (``CDC_PLATFORM_CONFIG``, default ``cdc_platform.yaml``) when Dagster
loads the location (``dg.definitions``: lazily, not at import) and merges what each role of
``defs/`` builds for its tables: tables, sensors, alerts and the operator jobs. Nothing heavier
happens at load: no Spark session, no key, no file listing.
"""

import dagster as dg

from cdc_platform.defs import alerts, jobs, sensors, tables
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig, load_config
from cdc_platform.lib.landing.discovery import with_discovered_tables


def build_definitions(platform: PlatformConfig) -> dg.Definitions:
    """Everything the code location serves, for every table in the config, plus (with a
    ``discover:`` template) every unlisted plain-Parquet table folder of the landing zone."""
    listed = platform
    platform = with_discovered_tables(listed)
    built = [tables.build_table_definitions(platform, t) for t in platform.tables]
    table_defs = tables.definitions(platform, built)
    sensor_defs = sensors.definitions(platform, listed, built)
    watched = [s.name for d in (table_defs, sensor_defs) for s in d.sensors or []]
    return dg.Definitions.merge(
        table_defs,
        sensor_defs,
        alerts.definitions(platform, [k for t in built for k in t.checks.check_keys], watched),
        jobs.definitions(platform),
        dg.Definitions(
            # One process per run: the asset step and its checks share one Spark session (one
            # JVM) instead of starting a JVM per step; Spark, not Dagster, parallelizes the work.
            executor=dg.in_process_executor,
            # Where Spark runs and which keyring is read: the deployment's environment only.
            resources={"spark": SparkResource(), "keyring": KeyringResource()},
        ),
    )


@dg.definitions
def defs() -> dg.Definitions:
    return build_definitions(load_config())
