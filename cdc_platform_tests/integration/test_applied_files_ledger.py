"""The applied-files ledger stays small to read after a long run of hourly materializations:
``table_maintenance`` compacts it (sorted by partition) and VACUUMs what it replaced, a read of
some partitions opens only the files that may hold them, and readers get the same rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pyarrow as pa

from cdc_platform.lib.landing.where.layout import LandingFile, hour_to_partition_key
from cdc_platform.lib.ledgers import applied_files
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.storage.stores import Where
from cdc_platform_tests.helpers import POOLS, one_table_config, run_operator_job
from cdc_platform_tests.integration.test_object_store import bucket, platform  # noqa: F401  (fixtures)
from cdc_platform_tests.integration.test_pii import failure_of

H0 = datetime(2024, 1, 1, tzinfo=UTC)
HOURS = 120  # five days of hourly runs: one ledger file each
FILES_PER_HOUR = 3


def record_hour(path: Where, landing: Path, i: int, files: int = FILES_PER_HOUR) -> str:
    """What the pipeline records after a run of hour ``i`` (``applied_files.record``)."""
    hour = H0 + timedelta(hours=i)
    key = hour_to_partition_key(hour)
    rows = [
        applied_files.AppliedFile(
            key, LandingFile(str(landing / f"t/{key}/part-{j}.parquet"), 100 + j, 10**18 + i)
        )
        for j in range(files)
    ]
    applied_files.record(path, landing, [key], rows, f"run-{i}", hour)
    return key


def test_maintenance_compacts_and_vacuums_the_ledger_and_reads_are_unchanged(spark, tmp_path):
    config = one_table_config(tmp_path, "primary_key: [id]")
    landing = Path(config.landing_path)
    path = applied_files.ledger_path(config.warehouse_root, "t")
    # A ledger file from before the etag column: compacted with the rest, its etags null.
    old = pa.schema([f for f in applied_files.SCHEMA if f.name != "etag"])
    Ledger(path, old).append(
        [{"partition": "2023-12-31-23:00", "file": "t/old.parquet", "size": 1, "mtime_ns": 1}]
    )
    keys = [record_hour(path, landing, i) for i in range(HOURS)]
    ledger = Ledger(path, applied_files.SCHEMA)
    due = [keys[3], keys[60], keys[-1], "2023-12-31-23:00", "2030-01-01-00:00"]
    before_all = applied_files.applied(path)
    before_due = applied_files.applied_by_partition(path, due)
    before_rows = sorted(map(repr, ledger.rows()))
    assert len(ledger.files_read()) == HOURS + 1

    with dg.instance_for_test(overrides=POOLS) as instance:
        result = run_operator_job(
            config,
            "table_maintenance",
            "compact_and_vacuum",
            instance,
            retention_hours=0,
            allow_short_retention=True,
        )
    assert result.success, failure_of(result)
    (observed,) = result.asset_observations_for_node("compact_and_vacuum")
    meta = {k: v.value for k, v in observed.metadata.items()}
    assert (meta["applied_files_files_before"], meta["applied_files_files_after"]) == (HOURS + 1, 1)

    assert len(ledger.files_read()) == 1
    assert applied_files.applied(path) == before_all
    assert applied_files.applied_by_partition(path, due) == before_due
    assert sorted(map(repr, ledger.rows())) == before_rows
    on_disk = [p for p in Path(path.uri).rglob("*.parquet") if "_delta_log" not in p.parts]
    assert len(on_disk) == 1  # the replaced files were vacuumed

    # Later runs: an hour read again replaces its rows in the compacted file, a new hour adds a
    # file; a read of the new hour opens that file alone.
    applied_files.record(path, landing, [keys[3]], [], "rerun", H0)
    new = record_hour(path, landing, HOURS, files=1)
    assert keys[3] not in applied_files.applied_by_partition(path, due)
    assert applied_files.applied_by_partition(path, [new]) == {
        new: {(f"t/{new}/part-0.parquet", 100, 10**18 + HOURS)}
    }
    assert len(ledger.files_read(("partition", [new]))) == 1
    assert len(ledger.files_read()) == 2


def test_a_ledger_in_a_bucket_is_compacted_and_read_by_partition(platform) -> None:  # noqa: F811
    """On an object store: the compaction reads and writes through the warehouse's storage
    options, and a read of some partitions goes through delta-rs' pruned scan."""
    from cdc_platform.lib.operations.maintenance import compact_applied_files
    from cdc_platform.lib.storage.warehouse import TablePaths

    landing = Path(platform.landing_path)
    paths = TablePaths.of(platform.warehouse_root, "orders")
    path = applied_files.of_table(paths)
    keys = [record_hour(path, landing, i) for i in range(6)]
    due = [keys[1], keys[4], "2030-01-01-00:00"]
    before_all = applied_files.applied(path)
    before_due = applied_files.applied_by_partition(path, due)
    assert set(before_due) == {keys[1], keys[4]}
    done = compact_applied_files(paths)
    assert (done.files_before, done.files_after, done.files_rewritten) == (6, 1, 6)
    assert applied_files.applied(path) == before_all
    assert applied_files.applied_by_partition(path, due) == before_due


def test_a_filtered_read_skips_only_files_whose_bounds_exclude_every_value() -> None:
    from cdc_platform.lib.ledgers.ledger import matching_files
    from cdc_platform.lib.storage.delta import DataFile

    def file(name: str, lo: object, hi: object) -> DataFile:
        bounds = ({"partition": lo}, {"partition": hi}) if lo is not None else ({}, {})
        return DataFile(name, 1, 1, *bounds)

    files = [
        file("jan", "2024-01-01-00:00", "2024-01-31-23:00"),
        file("feb", "2024-02-01-00:00", "2024-02-29-23:00"),
        file("none", None, None),  # no statistics: always read
        file("cut", "2024-03", "2024-03-" + "9" * 40),  # a bound that may have been cut
    ]
    names = lambda values: [f.path for f in matching_files(files, ("partition", values))]  # noqa: E731
    assert names(["2024-01-31-23:00"]) == ["jan", "none", "cut"]
    assert names(["2024-02-01-00:00", "2023-12-31-23:00"]) == ["feb", "none", "cut"]
    assert names(["2024-01-31-23:30"]) == ["none", "cut"]  # between two files
    assert names([]) == ["none", "cut"]
