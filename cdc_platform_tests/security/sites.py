"""What the operator-input tests share: the secret a site keeps beside the roots an
operator may name, and the CSV table they read."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.adopt import AdoptRequest, adopt

H5 = datetime(2024, 1, 1, 5, tzinfo=UTC)


TS = datetime(2024, 1, 1, 5, 1, tzinfo=UTC)


SECRET = "k3y-MATERIAL-do-not-leak"


KEYRING = '{"tables": {"orders": ["' + SECRET + '"]}}\n'


CSV_TABLE = TableConfig(
    name="orders",
    primary_key=("id",),
    start=H5,
    format="csv",
    columns={"id": "long", "status": "string"},
)


def _adopt(spark: Any, site: dict[str, Path], table: TableConfig, source: Path) -> Any:
    """Adopt ``source`` with the site's allowed folder as the only adoption root."""
    return adopt(
        HistoryTable(spark, table, site["warehouse"], site["landing"]),
        AdoptRequest(str(source), (site["allowed"],)),
    )
