"""What the hostile-landing tests share: table t from the day before 05:00, bombs and
landed files, the quarantine reasons and the keys logged."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.where.layout import (
    hour_folder,
)
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.storage.warehouse import TablePaths

H5 = datetime(2024, 1, 1, 5, tzinfo=UTC)


TS = datetime(2024, 1, 1, 5, 1, tzinfo=UTC)


TABLE = TableConfig(name="t", primary_key=("id",), start=H5 - timedelta(hours=24))


CSV = replace(
    TABLE,
    format="csv",
    compression="zstd",
    columns={"id": "long", "v": "string"},
    null_string="NULL",
)


def land(lake: dict[str, Path], name: str, data: bytes, table: str = "t") -> Path:
    folder = hour_folder(lake["landing"], table, H5)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def reasons(lake: dict[str, Path], table: str = "t") -> dict[str, str]:
    q = quarantine.current(TablePaths.of(lake["warehouse"], table).quarantine)
    return {e.file.rsplit("/", 1)[-1]: e.reason for e in q}


def logged_keys(lake: dict[str, Path], table: str = "t") -> list[Any]:
    log = TablePaths.of(lake["warehouse"], table).changelog
    return sorted(DeltaTable(log.uri).to_pyarrow_table(columns=["id"])["id"].to_pylist())


def materialize_through_the_asset(platform: Any) -> None:
    """The hour 05:00 of table t through its Dagster asset (in process)."""
    import dagster as dg

    from cdc_platform.defs.tables import build_table_definitions
    from cdc_platform_tests.helpers import dagster_resources

    defs = build_table_definitions(platform, platform.table("t"))
    result = dg.materialize(
        [defs.asset],
        partition_key="2024-01-01-05:00",
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
    )
    assert result.success
