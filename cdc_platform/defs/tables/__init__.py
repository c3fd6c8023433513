"""The tables role: a table's config in, its history asset, its checks, its landing sensor (per
table) and its optional ``<table>_current`` out; and, for every table, the definitions the code
location serves for them (``definitions``).

With a ``discover:`` template in the config, every unlisted plain-Parquet table folder of the
landing zone gets the same definitions (``lib.landing.discovery``, read when the code location
loads); the ``cdc_new_tables`` sensor reports every unlisted folder (``defs.sensors.discovery``).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg

from cdc_platform.defs.sensors.per_table import build_landing_sensor
from cdc_platform.defs.tables.checks import full_checks, history_checks
from cdc_platform.defs.tables.current import build_current_table_asset, current_tables_sensor
from cdc_platform.defs.tables.history import history_asset
from cdc_platform.lib.config import PlatformConfig, TableConfig


@dataclass(frozen=True)
class TableDefinitions:
    asset: dg.AssetsDefinition
    checks: dg.AssetChecksDefinition
    sensor: dg.SensorDefinition | None  # None with `landing_sensor: fleet` (defs.sensors)
    current: dg.AssetsDefinition | None = None  # `<table>_current`, if the config asks for it


def build_table_definitions(platform: PlatformConfig, table: TableConfig) -> TableDefinitions:
    """One table's definitions; its landing sensor only with ``landing_sensor: per_table``."""
    history = history_asset(platform, table)
    sensor = (
        build_landing_sensor(
            table, platform.landing_root, history, warehouse_root=platform.warehouse_root
        )
        if platform.landing_sensor == "per_table"
        else None
    )
    current = build_current_table_asset(platform, table) if table.current_table else None
    return TableDefinitions(history, history_checks(platform, table), sensor, current)


def definitions(platform: PlatformConfig, tables: Sequence[TableDefinitions]) -> dg.Definitions:
    """The tables' assets and checks, the current tables' sensor, and the check job with its
    schedule. The landing sensors are the sensors role's (``defs.sensors.definitions``)."""
    current = [t.current for t in tables if t.current is not None]
    return dg.Definitions.merge(
        dg.Definitions(
            assets=[*(t.asset for t in tables), *current],
            asset_checks=[t.checks for t in tables],
            sensors=current_tables_sensor(current),
        ),
        full_checks(platform, [t.checks for t in tables]),
    )
