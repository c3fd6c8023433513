"""What the pipeline-input tests share: table t from H0, a run of its hours, its paths,
its quarantine reasons and builders of its landing files."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths

H0 = datetime(2024, 1, 1, tzinfo=UTC)


H1 = H0 + timedelta(hours=1)


MS = timedelta(milliseconds=1)


TMAX_TS = datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)


TABLE = TableConfig(name="t", primary_key=("id",), start=H0)


def run(spark, lake, hours, table: TableConfig = TABLE, keyring: Keyring | None = None):
    return materialize(spark, table, lake["landing"], lake["warehouse"], hours, keyring)


def paths(lake, name: str = "t") -> TablePaths:
    return TablePaths.of(lake["warehouse"], name)


def reasons(lake, name: str = "t") -> dict[str, str]:
    """The current quarantine as {file name: reason}."""
    return {
        q.file.rsplit("/", 1)[1]: q.reason for q in quarantine.current(paths(lake, name).quarantine)
    }
