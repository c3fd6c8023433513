"""The demo's code location (``make ui``): the platform's own (``cdc_platform.definitions``)
and one downstream asset built on a history table, ``orders_daily`` (``demo.downstream``),
which the ``cdc_restatements`` sensor re-runs for the days late data restates."""

import dagster as dg

from cdc_platform.definitions import build_definitions
from cdc_platform.demo.downstream import daily_totals
from cdc_platform.lib.config import PlatformConfig, load_config

DOWNSTREAM_OF = ("orders", "amount")  # the table, and the column its daily total sums


def build_demo_definitions(platform: PlatformConfig) -> dg.Definitions:
    table, amount = DOWNSTREAM_OF
    names = {t.name for t in platform.tables}
    downstream = [daily_totals(platform, table, amount)] if table in names else []
    return dg.Definitions.merge(build_definitions(platform), dg.Definitions(assets=downstream))


@dg.definitions
def defs() -> dg.Definitions:
    return build_demo_definitions(load_config())
