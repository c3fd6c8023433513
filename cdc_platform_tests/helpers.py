"""Test helpers: write landing files the way exporters do, read Delta tables the way users do."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from cdc_platform.defs.alerts.webhook import AlertWebhookResource
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.storage.stores import Where

# The ``keyring`` fixture's hash salt (conftest.py).
HASH_SALT = b"0123456789abcdef-salt-for-tests!"

CDC_FIELDS = [
    pa.field("cdc_operation_type", pa.string()),
    pa.field("cdc_change_seq", pa.int64()),
    pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
]


def event(
    op: str, seq: int | None, ts: datetime | None, key: Any, key_column: str = "id", **cols: Any
) -> dict[str, Any]:
    """One change event: the key, data columns, and the three change columns."""
    return {
        key_column: key,
        **cols,
        "cdc_operation_type": op,
        "cdc_change_seq": seq,
        "cdc_commit_timestamp": ts,
    }


def write_parquet_events(
    landing_root: Path,
    table: str,
    hour: datetime,
    rows: Sequence[Mapping[str, Any]],
    schema: pa.Schema | None = None,
    name: str | None = None,
) -> Path:
    """One Parquet landing file in the hour folder; columns missing from a row are null."""
    folder = hour_folder(landing_root, table, hour)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or f"part-{uuid.uuid4().hex[:12]}.snappy.parquet")
    if schema is None:
        names: list[str] = []
        for r in rows:
            names.extend(k for k in r if k not in names)
        data = {n: [r.get(n) for r in rows] for n in names}
        tbl = pa.table(data)
        fields = []
        for f in tbl.schema:
            cdc = next((c for c in CDC_FIELDS if c.name == f.name), None)
            fields.append(
                cdc or f
            )  # an all-None column stays Arrow type null, as pyarrow writes it
        tbl = tbl.cast(pa.schema(fields))
    else:
        tbl = pa.Table.from_pylist([dict(r) for r in rows], schema=schema)
    pq.write_table(tbl, path)
    return path


def history_rows(
    table_path: Where,
    drop: Iterable[str] = (
        "_fivetran_synced",
        "_cdc_current",
        "_cdc_last_event_at",
        "_cdc_changed_columns",
    ),
) -> list[dict[str, Any]]:
    """The table's rows as dicts sorted by every column but the dropped ones."""
    tbl = DeltaTable(str(table_path)).to_pyarrow_table()
    rows = [{k: v for k, v in r.items() if k not in set(drop)} for r in tbl.to_pylist()]
    return sorted(rows, key=lambda r: tuple((v is None, str(v)) for v in r.values()))


def normalize(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> list[tuple]:
    """Rows as tuples over ``columns`` (missing -> None), sorted, for exact comparison."""
    out = [tuple(r.get(c) for c in columns) for r in rows]
    return sorted(out, key=lambda t: tuple((v is None, str(v)) for v in t))


def dagster_resources(**overrides: Any) -> dict[str, Any]:
    """The one resource set Dagster-level tests run with: Spark that leaves the suite's shared
    session running, the keyring named by ``CDC_KEYRING`` (none: an empty one), no webhook.
    Pass a key to replace one, e.g. ``spark=SparkResource(spark_config=...)``."""
    return {
        "spark": SparkResource(stop_at_end_of_run=False),
        "keyring": KeyringResource(),
        "alert_webhook": AlertWebhookResource(),
        **overrides,
    }


class Clock:
    """A settable ``now`` for a sensor's ``clock``."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def materialize_with_checks(
    platform: PlatformConfig, table: str, hour: datetime
) -> dg.ExecuteInProcessResult:
    """One hour of ``table`` materialized through Dagster with its asset checks, as the UI's
    Materialize does; failures are returned, not raised."""
    from cdc_platform.defs.tables import build_table_definitions

    defs = build_table_definitions(platform, platform.table(table))
    return dg.materialize(
        [defs.asset, defs.checks],
        partition_key=hour.strftime("%Y-%m-%d-%H:%M"),
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
        raise_on_error=False,
    )


def one_table_config(tmp_path: Path, table_lines: str) -> PlatformConfig:
    """A config of one table ``t`` starting 2024-01-01, ``table_lines`` (YAML, each line indented
    four spaces after the first) under it; landing and warehouse beside the file."""
    from cdc_platform.lib.config import load_config

    path = tmp_path / "cdc_platform.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        f'  - name: t\n    {table_lines}\n    start: "2024-01-01-00:00"\n'
    )
    return load_config(path)


def run_operator_job(
    platform: PlatformConfig,
    job: str,
    op: str,
    instance: dg.DagsterInstance | None = None,
    **config: Any,
) -> dg.ExecuteInProcessResult:
    """Launch an operator job on table ``t`` as the Launchpad does; failures are returned. The
    instance is an in-memory one (no concurrency pools) unless given."""
    from cdc_platform.definitions import build_definitions

    return (
        build_definitions(platform)
        .resolve_job_def(job)
        .execute_in_process(
            run_config={"ops": {op: {"config": {"table": "t", **config}}}},
            resources=dagster_resources(),
            instance=instance or dg.DagsterInstance.ephemeral(),
            raise_on_error=False,
        )
    )


# The deployment's pools (dagster.yaml): one slot per table.
POOLS = {"concurrency": {"pools": {"default_limit": 1}}}


def materialize_with_cli(
    select: str, partition_range: str, env: Mapping[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """The README's command in a process of its own: ``dagster asset materialize`` of the
    ``select``ed assets over ``partition_range`` (``first...last``), one run."""
    command = [str(Path(sys.executable).parent / "dagster"), "asset", "materialize"]
    command += ["-m", "cdc_platform.definitions", "--select", select]
    command += ["--partition-range", partition_range]
    return subprocess.run(
        command, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=900
    )
