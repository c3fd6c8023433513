"""The table every benchmark measures, as a user would configure it, and where the README puts
its Delta tables (not imported from the package: a redesign may move them)."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa

import cdc_platform
from cdc_platform.lib.columns import TMAX, unix_micros
from cdc_platform.lib.config import TableConfig

TABLE_NAME = "bench"
START = datetime(2024, 1, 1, tzinfo=UTC)
TABLE = TableConfig(name=TABLE_NAME, primary_key=("id",), start=START)
REPO_ROOT = Path(cdc_platform.__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
US = 1_000_000
HOUR_US = 3600 * US
DAY_US = 24 * HOUR_US
START_US = int(START.timestamp()) * US
TMAX_US = unix_micros(TMAX)
TS_TYPE = pa.timestamp("us", tz="UTC")
DATA_COLUMNS = ("status", "amount", "quantity", "updated_at", "is_priority", "note")


def hour_at(index: int) -> datetime:
    return START + timedelta(hours=index)


def history_path(warehouse: Path) -> Path:
    """The history table, where the README says it is (not imported: the code may change)."""
    return warehouse / TABLE_NAME


def changelog_path(warehouse: Path) -> Path:
    return warehouse / "_cdc" / TABLE_NAME / "changelog"
