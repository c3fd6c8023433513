"""Files swapped or rewritten between the listing and the read: a file or folder
replaced by a symlink, a file rewritten in place keeping its size and modification time, a file
changed while Spark reads it. None is ever read or logged as the table's; the change is seen, the
file set aside and never recorded as applied."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet import sensor_cursor
from cdc_platform.lib.landing.decoding.codecs import LandingFileError
from cdc_platform.lib.landing.discovery import describe
from cdc_platform.lib.landing.reading.file_reader import LandingReader, changed_files_named
from cdc_platform.lib.landing.reading.native import NativeGuard, native_report
from cdc_platform.lib.landing.reading.passes import event_schema
from cdc_platform.lib.landing.where.layout import files_in_hour
from cdc_platform.lib.landing.where.safe_open import CHANGED, FileId
from cdc_platform.lib.landing.where.zone import LocalZone
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events
from cdc_platform_tests.security.hostile_files import (
    CSV,
    TABLE,
    land,
    logged_keys,
    materialize_through_the_asset,
    reasons,
)
from cdc_platform_tests.security.sites import H5, SECRET, TS


def test_a_file_swapped_after_the_listing_is_not_read(site) -> None:
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    path = write_parquet_events(
        site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1)], name="p.parquet"
    )
    (listed,) = files_in_hour(site["landing"], "orders", H5)
    reader = LandingReader(table, site["landing"])
    reader.expect({listed.path: listed.file_id})
    secret = site["private"] / "p.parquet"
    pq.write_table(pa.table({"id": [SECRET]}), secret)

    os.replace(path, site["private"] / "kept.parquet")  # the file itself -> a symlink
    path.symlink_to(secret)
    assert "symlink" in str(reader.inspect(str(path)).error)
    assert native_report(reader, str(path)) is None

    path.unlink()  # -> another regular file (same name, another inode)
    shutil.copy(secret, path)
    assert "changed since it was listed" in str(reader.inspect(str(path)).error)

    path.unlink()  # the hour folder -> a symlink to a folder holding a file of that name
    folder = path.parent
    folder.rename(folder.with_name("hour=05.moved"))
    folder.symlink_to(site["private"], target_is_directory=True)
    for report in (
        reader.inspect(str(path)),
        LandingReader(table, site["landing"]).inspect(str(path)),
    ):
        assert report.error and "symlink" in report.error and SECRET not in report.error


def test_spark_by_path_reads_are_checked_before_and_after(site) -> None:
    """Spark opens a path itself: a folder renamed away and back meanwhile is seen (ctime)."""
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    path = write_parquet_events(site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1)])
    reader = LandingReader(table, site["landing"])
    time.sleep(0.05)  # past the coarse clock tick that stamped the folder's creation
    guard = NativeGuard(reader, [str(path)])
    assert guard.readable == {str(path)} and guard.changed() == []
    folder = path.parent
    folder.rename(folder.with_name("away"))
    folder.with_name("away").rename(folder)  # back again: same inode, new ctime
    assert guard.changed() == [str(path)]
    with pytest.raises(Exception, match="changed while Spark read it"):
        guard.verify()


def test_a_materialization_never_reads_through_a_folder_swapped_after_listing(
    spark, site, monkeypatch
) -> None:
    """The swap is done by the attacker right after the listing (a wrapper around it)."""

    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    path = write_parquet_events(site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1, v="ok")])
    decoy = site["private"] / "decoy"
    decoy.mkdir()
    write_parquet_events(decoy, "x", H5, [ev("INSERT", 2, TS, 2, v=SECRET)], name=path.name)
    stolen = next(decoy.rglob(path.name))
    listing = LocalZone.files_in_hour

    def list_then_swap(self: LocalZone, *args: Any) -> Any:
        files = listing(self, *args)
        path.parent.rename(path.parent.with_name("hour=05.moved"))
        path.parent.symlink_to(stolen.parent, target_is_directory=True)
        return files

    monkeypatch.setattr(LocalZone, "files_in_hour", list_then_swap)
    out = materialize(spark, table, site["landing"], site["warehouse"], [H5])
    assert [q.reason for q in out.quarantined] == [
        "symlink: links in the landing zone are not followed"
    ]
    assert (out.files_read, out.events_read, out.read_natively) == (1, 0, ())


def test_a_file_swapped_while_spark_reads_it_is_never_taken_even_when_spark_fails(
    spark, site, monkeypatch
) -> None:
    """Swapped for a link to a file that is no Parquet once the guard has looked: Spark's own
    read fails first (its error would name the target); the guard is asked all the same."""
    from cdc_platform.lib.landing import batch

    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    path = write_parquet_events(site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1, v="ok")])
    keyring = site["private"] / "keyring.json"
    real_read = batch.read_events

    def swap_then_read(*args: Any, **kwargs: Any) -> Any:
        if args[4] and not path.is_symlink():  # the native read: Spark opens by path
            os.replace(path, site["private"] / "kept.parquet")
            path.symlink_to(keyring)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", swap_then_read)
    try:
        out = materialize(spark, table, site["landing"], site["warehouse"], [H5])
    except Exception as exc:  # refused: through the checked descriptor, the link is no file
        assert SECRET not in str(exc) and "keyring" not in str(exc)
        # The checked Python read refused the link; not Spark's by-path read failing.
        assert "FAILED_READ_FILE" not in str(exc) and "symlink" in str(exc)
    else:
        assert SECRET not in repr(out) and out.read_natively == ()
    changelog = TablePaths.of(site["warehouse"], "orders").changelog
    if delta.exists(changelog):
        assert SECRET not in str(DeltaTable(changelog.uri).to_pyarrow_table().to_pylist())


def test_discovery_never_reads_a_file_swapped_after_listing(site, monkeypatch) -> None:
    """The new_table alert carries the columns: they must not be the keyring's first line."""
    path = write_parquet_events(site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1)])
    secret_csv = site["private"] / "secret.csv"
    secret_csv.write_text(f"{SECRET},b\n1,2\n")
    listing = LocalZone.files_in_hour

    def list_then_swap(self: LocalZone, *args: Any) -> Any:
        files = listing(self, *args)
        if path.exists() and not path.is_symlink():
            os.replace(path, site["private"] / "kept.parquet")
            path.symlink_to(secret_csv)
        return files

    monkeypatch.setattr(LocalZone, "files_in_hour", list_then_swap)
    found = describe(site["landing"], "orders")
    assert SECRET not in repr(found) and SECRET not in found.config_snippet()
    assert found.columns == []


def rewrite_in_place(path: Path, rows: list[dict[str, Any]]) -> None:
    """Same inode, same modification time: only the inode's change time can tell."""
    st = path.stat()
    tbl = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    pq.write_table(tbl, sink)
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.write(sink.getvalue().to_pybytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino


BAD_ROWS = [ev("DELETE", 9, TS, None, v="no key"), ev("BOGUS", 10, TS, 2, v="no op")]


@pytest.mark.parametrize("encoded", [False, True], ids=["native", "decoded"])
def test_a_file_rewritten_in_place_after_inspection_is_set_aside_never_logged(
    spark, lake, monkeypatch, encoded
) -> None:
    from cdc_platform.lib.landing import batch

    table = TABLE
    victim = write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 1, TS, 1, v="a")], name="victim.parquet"
    )
    if encoded:  # a uint64 column, nanoseconds: not read natively, decoded in Python tasks
        pq.write_table(
            pa.table(
                {
                    "id": pa.array([1], pa.uint8()),
                    "v": ["a"],
                    "n": pa.array([1], pa.uint64()),
                    "cdc_operation_type": ["INSERT"],
                    "cdc_change_seq": pa.array([1], pa.int64()),
                    "cdc_commit_timestamp": pa.array([TS], pa.timestamp("ns", tz="UTC")),
                }
            ),
            victim,
        )
    write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 5, TS, 5, v="b")], name="other.parquet"
    )
    real_read = batch.read_events

    def rewrite_then_read(*args: Any, **kwargs: Any) -> Any:
        if victim.stat().st_size and not getattr(rewrite_then_read, "done", False):
            rewrite_then_read.done = True  # type: ignore[attr-defined]
            rewrite_in_place(victim, BAD_ROWS)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", rewrite_then_read)
    out = materialize(spark, table, lake["landing"], lake["warehouse"], [H5])
    assert reasons(lake)["victim.parquet"] == CHANGED
    assert logged_keys(lake) == [5] and out.events_read == 1
    assert [r["id"] for r in history_rows(TablePaths.of(lake["warehouse"], "t").history)] == [5]

    # Once the file is stable, its hour read again applies what inspection allows: nothing
    # of it (bad rows set it aside), the quarantine naming the row.
    monkeypatch.setattr(batch, "read_events", real_read)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H5])
    assert "row 1: primary key column 'id' is null" in reasons(lake)["victim.parquet"]
    assert logged_keys(lake) == [5]


def test_pass_two_checks_rows_again_even_when_the_file_looks_unchanged(
    spark, lake, monkeypatch
) -> None:
    """A rewrite the file system cannot show (a coarse clock, a mount that reports times
    poorly): Spark's pass 2 validates every row again, within pass 1's rows and seq range."""
    from cdc_platform.lib.landing import batch

    monkeypatch.setattr(FileId, "matches", lambda self, st: self.ino == st.st_ino)
    victim = write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 1, TS, 1, v="a")], name="victim.parquet"
    )
    write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 5, TS, 5, v="b")], name="other.parquet"
    )
    real_read = batch.read_events

    def rewrite_then_read(*args: Any, **kwargs: Any) -> Any:
        if not getattr(rewrite_then_read, "done", False):
            rewrite_then_read.done = True  # type: ignore[attr-defined]
            rewrite_in_place(victim, [ev("INSERT", 99, TS, 1, v="a")])  # seq out of range
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", rewrite_then_read)
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H5])
    assert reasons(lake)["victim.parquet"] == CHANGED
    assert logged_keys(lake) == [5]


def test_the_python_decoder_checks_rows_again_and_names_the_file(lake, monkeypatch) -> None:
    """The decoded path's pass 2 (run here in process, as a Spark task runs it)."""
    monkeypatch.setattr(FileId, "matches", lambda self, st: self.ino == st.st_ino)
    header = b"id,v,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
    path = land(lake, "victim.csv", header + b"1,a,INSERT,1,2024-01-01T05:01:00Z\n")
    table = replace(CSV, compression="none")
    (listed,) = files_in_hour(lake["landing"], "t", H5)
    reader = LandingReader(table, lake["landing"])
    reader.expect({listed.path: listed.file_id})
    report = reader.inspect(str(path))
    assert report.ok and (report.num_rows, report.seq_min, report.seq_max) == (1, 1, 1)
    schema = event_schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])
    for rewritten in (
        b"NULL,x,DELETE,1,2024-01-01T05:01:00Z\n",  # a null key
        b"1,a,INSERT,1,2024-01-01T05:01:00Z\n2,b,INSERT,1,2024-01-01T05:01:00Z\n",  # a row more
        b"1,a,INSERT,7,2024-01-01T05:01:00Z\n",  # another seq
    ):
        st = path.stat()
        with open(path, "r+b") as fh:
            fh.truncate(0)
            fh.write(header + rewritten)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(LandingFileError) as err:
            list(reader.read_conformed(str(path), schema, report))
        assert changed_files_named(err.value) == {reader.relative(str(path))}


def test_a_file_set_aside_as_changed_is_not_recorded_as_applied(spark, tmp_path, monkeypatch):
    """A chmod (or a rewrite keeping size and mtime) moves only the change time: the sensor's
    fingerprint does not see it, so the ledger must not claim the file was read, or its hour
    would never be asked for again (the pending hour is re-requested instead)."""

    from cdc_platform.lib.config import load_config
    from cdc_platform.lib.landing import batch
    from cdc_platform.lib.ledgers import applied_files

    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        "  - {name: t, primary_key: [id], start: '2023-12-31-05:00', retry_backoff_seconds: 60}\n"
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    landing = platform.landing_path
    victim = write_parquet_events(
        landing, "t", H5, [ev("INSERT", 1, TS, 1, v="a")], name="v.parquet"
    )
    write_parquet_events(landing, "t", H5, [ev("INSERT", 5, TS, 5, v="b")], name="o.parquet")
    real_read = batch.read_events

    def chmod_then_read(*args: Any, **kwargs: Any) -> Any:
        os.chmod(victim, 0o640)  # the permissions cron: only the ctime moves
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", chmod_then_read)
    materialize_through_the_asset(platform)
    ledger = applied_files.ledger_path(platform.warehouse_root, "t")
    recorded = {f.rsplit("/", 1)[1] for f, _, _ in applied_files.applied(ledger)}
    assert recorded == {"o.parquet"}
    # The sensor's pending hour is then requested again.
    table = platform.table("t")
    state = sensor_cursor.CursorState(
        pending={"2024-01-01-05:00": sensor_cursor.Pending("fp", 0.0, 0.0, 0)}
    )
    applied = applied_files.applied_by_partition(ledger, ["2024-01-01-05:00"])
    requests, _ = sensor_cursor.reconcile(table, landing, datetime.now(UTC), state, applied, set())
    assert [r.partition_keys for r in requests] == [("2024-01-01-05:00",)]
