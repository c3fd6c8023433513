"""`make demo`: sample landing zone -> every partition materialized through a real Dagster
instance (``DAGSTER_HOME``, default ``.dagster_home/``) -> a short summary per table.

The runs are real Dagster runs with their checks, so ``make ui`` shows them afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import dagster as dg

from cdc_platform.defs.alerts.webhook import ALERT_RESOURCE_KEY, alert_webhook_from_env
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.defs.tags import RANGE_END_TAG, RANGE_START_TAG
from cdc_platform.demo.definitions import DOWNSTREAM_OF
from cdc_platform.demo.downstream import daily_totals
from cdc_platform.demo.encrypted import write_encrypted_csv_table
from cdc_platform.demo.generate import generate_landing_zone
from cdc_platform.lib.config import REPO_ROOT, PlatformConfig, load_config
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.landing.where.object_store import S3Landing
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import LandingZone, LocalZone
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Where
from cdc_platform.lib.storage.warehouse import TablePaths

HOURS = 12


def prepare_instance() -> Path:
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(REPO_ROOT / ".dagster_home")))
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "dagster.yaml").exists():
        shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    return home


def prepare_landing(platform: PlatformConfig) -> None:
    """Generate the sample landing zone unless it is already there (delete data/ to start
    over). On an ``s3://`` landing root it is generated in a temporary folder and uploaded."""
    keyring = Path(os.environ.setdefault("CDC_KEYRING", str(REPO_ROOT / "data" / "keyring.json")))
    landing = zone_at(platform.landing_root)
    if any(landing.hours(t.name) for t in platform.tables):
        return
    if isinstance(landing, LocalZone):
        counts = generate_sample(Path(landing.root), keyring, platform)
    else:
        with tempfile.TemporaryDirectory() as folder:
            counts = generate_sample(Path(folder), keyring, platform)
            uploaded = upload_folder(Path(folder), landing)
        print(f"uploaded {uploaded} landing file(s) to {landing.root}")
    print("sample landing zone:", ", ".join(f"{t}: {n} events" for t, n in sorted(counts.items())))


def generate_sample(folder: Path, keyring: Path, platform: PlatformConfig) -> dict[str, int]:
    counts = generate_landing_zone(folder, hours=HOURS)
    for table in platform.tables:
        if table.format == "csv" and table.encryption != "none":
            counts[table.name] = write_encrypted_csv_table(folder, keyring, table, hours=HOURS)
    return counts


def upload_folder(folder: Path, landing: LandingZone) -> int:
    """Every file under ``folder`` put at the same relative key under the bucket's root."""
    if not isinstance(landing, S3Landing):
        raise TypeError(f"{landing.root}: not a bucket")
    count = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            key = landing.key_of(path.relative_to(folder).as_posix())
            landing.client.put_object(Bucket=landing.bucket, Key=key, Body=path.read_bytes())
            count += 1
    return count


def history_summary(history: Where) -> tuple[int, int, int]:
    """(versions, active versions, Delta version) of a history table."""
    rows = delta.read_arrow(history, columns=["_fivetran_active"])
    active = rows["_fivetran_active"].to_pylist().count(True)
    return rows.num_rows, active, delta.version_or_none(history) or 0


def summarize_downstream(
    platform: PlatformConfig, instance: dg.DagsterInstance, landing: LandingZone
) -> None:
    """The demo's downstream asset (``demo.downstream``): each day of the sample landing zone,
    the live orders and their total as of its end."""
    table, amount = DOWNSTREAM_OF
    if table not in {t.name for t in platform.tables}:
        return
    daily = daily_totals(platform, table, amount)
    for day in sorted({h.strftime("%Y-%m-%d") for h in landing.hours(table)}):
        result = dg.materialize([daily], partition_key=day, instance=instance)
        meta = result.get_asset_materialization_events()[0].materialization.metadata
        rows, total = meta["rows"].value, meta["total"].value
        print(f"{table}_daily {day}: {rows} live {table}, total {total:,.2f} at the day's end")


def main() -> None:
    started = time.monotonic()
    prepare_instance()
    platform = load_config()
    prepare_landing(platform)
    landing = zone_at(platform.landing_root)
    instance = dg.DagsterInstance.get()
    spark = SparkResource(stop_at_end_of_run=False)
    resources = {
        "spark": spark,
        "keyring": KeyringResource(),
        ALERT_RESOURCE_KEY: alert_webhook_from_env(),
    }
    print(
        f"{'table':<10} {'partitions':>10} {'events':>7} {'versions':>9} {'active':>7} {'delta v':>8} checks"
    )
    try:
        for table in platform.tables:
            hours = [h for h in landing.hours(table.name) if h >= table.start]
            if not hours:
                print(f"{table.name:<10} no landing folders")
                continue
            first, last = hour_to_partition_key(min(hours)), hour_to_partition_key(max(hours))
            defs = build_table_definitions(platform, table)
            result = dg.materialize(
                [defs.asset, defs.checks],
                instance=instance,
                resources=resources,
                tags={RANGE_START_TAG: first, RANGE_END_TAG: last},
                run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
                raise_on_error=False,
            )
            meta = {}
            for event in result.get_asset_materialization_events():
                meta = event.materialization.metadata
            checks = result.get_asset_check_evaluations()
            passed = sum(1 for c in checks if c.passed)
            versions, active, version = history_summary(
                TablePaths.of(platform.warehouse_root, table.name).history
            )
            events = meta["events_read"].value if "events_read" in meta else 0
            status = f"{passed}/{len(checks)} passed" if result.success else "RUN FAILED"
            print(
                f"{table.name:<10} {len(hours):>10} {events:>7} {versions:>9} {active:>7} "
                f"{version:>8} {status}"
            )
        summarize_downstream(platform, instance, landing)
    finally:
        spark.stop()
    print(
        f"done in {time.monotonic() - started:.1f}s; `make ui` opens these runs in the Dagster UI"
    )


if __name__ == "__main__":
    main()
