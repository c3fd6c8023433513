"""The operator surface as an attacker sees it (issue 20, items 2, 3, 5 and 6).

Two attackers: whoever can type a run config in the Launchpad (a snapshot or adoption source
that is any path or URI: traversal, absolute paths, other buckets, the warehouse itself,
symlinks) and whoever can write the landing zone (names with newlines or backticks, a file or
folder swapped for a symlink between the listing and the read). Each test gives the hostile
value and checks that nothing outside what the config allows is read, and that no error,
alert or check sample carries a secret. Library-level calls: most need no Spark at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from deltalake import DeltaTable, write_deltalake

from cdc_platform.lib.config import ConfigError, TableConfig, parse_config
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.discovery import describe
from cdc_platform.lib.landing.reading.file_reader import LandingReader
from cdc_platform.lib.landing.reading.native import NativeGuard, native_report
from cdc_platform.lib.landing.where.layout import files_in_hour, hour_folder
from cdc_platform.lib.landing.where.zone import LocalZone
from cdc_platform.lib.operations.adoption import AdoptionError, AdoptRequest, adopt
from cdc_platform.lib.operations.resync import (
    ResyncError,
    ResyncRequest,
    SnapshotReader,
    resync,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.roots import (
    SourceRootError,
    adoption_source,
    snapshot_folder,
)
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

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


@pytest.fixture()
def site(tmp_path: Path) -> dict[str, Path]:
    """A landing zone, a warehouse, an allowed folder of snapshots/exports and a private
    folder holding a secret (as /etc/cdc-platform holds the keyring)."""
    out = {n: tmp_path / n for n in ("landing", "warehouse", "allowed", "private")}
    for p in out.values():
        p.mkdir()
    (out["private"] / "keyring.json").write_text(KEYRING)
    return out


# -- item 2: re-sync snapshots come from under snapshot_roots only ---------------------------


def hostile_snapshots(site: dict[str, Path]) -> list[tuple[str, str]]:
    allowed = site["allowed"]
    (allowed / "link").symlink_to(site["private"], target_is_directory=True)
    return [
        (str(site["private"]), "not under any of the allowed roots"),
        (f"{allowed}/../private", "'..' segments are not allowed"),
        ("allowed/snap", "give an absolute path"),
        (f"file://{site['private']}", "not under any of the allowed roots"),
        ("s3://bucket/snap", "not under any of the allowed roots"),
        ("gs://bucket/snap", "a folder or an s3:// prefix"),
        (str(allowed / "link"), "is a symlink"),
        (str(site["warehouse"] / "orders"), "overlaps the platform's own folder"),
        (str(site["landing"] / "orders"), "overlaps the platform's own folder"),
        (str(allowed.parent), "overlaps the platform's own folder"),  # holds the warehouse
    ]


def test_a_snapshot_outside_the_snapshot_roots_is_never_read(site) -> None:
    forbidden = (site["landing"], site["warehouse"])
    with pytest.raises(SourceRootError, match="sets no 'snapshot_roots'"):
        snapshot_folder(site["allowed"], [], forbidden)
    for value, why in hostile_snapshots(site):
        with pytest.raises(SourceRootError, match=why):
            snapshot_folder(value, [site["allowed"]], forbidden)
    (site["allowed"] / "snap").mkdir()
    assert snapshot_folder(str(site["allowed"] / "snap"), [site["allowed"]], forbidden) == (
        site["allowed"] / "snap"
    )


def test_resync_refuses_a_run_when_no_snapshot_root_is_configured(site) -> None:
    with pytest.raises(ResyncError, match="snapshot_roots"):
        resync(
            HistoryTable(
                None,  # type: ignore[arg-type]  # refused before any Spark work
                CSV_TABLE,
                site["warehouse"],
                site["landing"],
            ),
            ResyncRequest(str(site["private"]), ()),
        )


def test_a_file_that_is_not_the_tables_is_named_never_quoted(site) -> None:
    """The keyring read as a CSV snapshot (or a landing file): its header is the key."""
    folder = site["allowed"] / "snap"
    folder.mkdir()
    shutil.copy(site["private"] / "keyring.json", folder / "keyring.json")
    bad_cell = folder / "cells.csv"
    bad_cell.write_text(
        "id,status,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
        f"{SECRET},x,INSERT,1,2024-01-01T00:00:00Z\n"
    )
    at = datetime(2024, 1, 2, tzinfo=UTC)
    reader = SnapshotReader(CSV_TABLE, site["landing"], None, at, 0, folder)
    for path in (folder / "keyring.json", bad_cell):
        report = reader.inspect(str(path))
        assert report.error and SECRET not in report.error, report.error
    assert "column #1" in str(reader.inspect(str(folder / "keyring.json")).error)
    assert "row 1, column 'id'" in str(reader.inspect(str(bad_cell)).error)
    landing = hour_folder(site["landing"], "orders", H5)
    landing.mkdir(parents=True)
    shutil.copy(site["private"] / "keyring.json", landing / "part-1.csv")
    error = LandingReader(CSV_TABLE, site["landing"]).inspect(str(landing / "part-1.csv")).error
    assert error and SECRET not in error and "column #1" in error


# -- item 3: adoption sources come from under adoption_roots only ----------------------------


def test_an_adoption_source_outside_the_adoption_roots_is_never_read(site) -> None:
    wh, landing = site["warehouse"], site["landing"]
    forbidden = (wh, landing)
    allowed = [site["allowed"], "s3://exports/orders"]
    (site["allowed"] / "export").mkdir()
    (site["allowed"] / "export" / "stolen").symlink_to(site["private"] / "keyring.json")
    hostile = [
        (str(wh / "other_table"), "overlaps the platform's own folder"),
        (str(wh / "_cdc" / "changelog" / "other_table"), "overlaps the platform's own folder"),
        (str(landing / "orders"), "overlaps the platform's own folder"),
        (f"{site['allowed']}/../warehouse/other", "'..' segments are not allowed"),
        ("allowed/export", "give an absolute path or a URI"),
        (str(site["allowed"] / "export"), "stolen is a symlink"),
        ("s3://other-bucket/orders", "not under any of the allowed roots"),
        ("s3://exports/orders-private", "not under any of the allowed roots"),
        ("s3://exports/orders/../secrets", "'.' and '..' segments"),
        ("s3://exports/orders/%2e%2e/secrets", "'.' and '..' segments"),
        ("gs://exports/orders", "not under any of the allowed roots"),
        ("ftp://exports/orders", "not supported"),
    ]
    with pytest.raises(SourceRootError, match="sets no 'adoption_roots'"):
        adoption_source(str(site["allowed"]), [], forbidden)
    for value, why in hostile:
        with pytest.raises(SourceRootError, match=why):
            adoption_source(value, allowed, forbidden)
    assert adoption_source("s3a://exports/orders/2024/", allowed, forbidden).uri == (
        "s3://exports/orders/2024"
    )
    with pytest.raises(AdoptionError, match="adoption_roots"):
        adopt(
            HistoryTable(
                None,  # type: ignore[arg-type]  # refused before any Spark work
                CSV_TABLE,
                wh,
                landing,
            ),
            AdoptRequest(str(wh / "other_table"), ()),
        )


def test_the_config_keeps_the_roots_apart_from_the_platforms_own(tmp_path: Path) -> None:
    def parse(**extra: Any) -> Any:
        raw = {"landing_root": "landing", "warehouse_root": "warehouse", **extra}
        raw["tables"] = [{"name": "t", "primary_key": ["id"], "start": "2024-01-01-00:00"}]
        return parse_config(raw, tmp_path)

    assert parse().snapshot_roots == () and parse().adoption_roots == ()
    roots = parse(snapshot_roots=["snaps"], adoption_roots=["exports", "s3://b/p/"])
    assert [r.uri for r in roots.snapshot_roots] == [str(tmp_path / "snaps")]
    assert [r.uri for r in roots.adoption_roots] == [str(tmp_path / "exports"), "s3://b/p"]
    for extra, why in [
        ({"snapshot_roots": ["warehouse/x"]}, "overlaps"),
        ({"snapshot_roots": ["."]}, "overlaps"),
        ({"snapshot_roots": ["gs://b/snaps"]}, "a folder or an s3:// prefix"),
        ({"adoption_roots": ["landing"]}, "overlaps"),
        ({"adoption_roots": ["s3://b/p/../q"]}, "'..' segments"),
        ({"adoption_roots": "exports"}, "must be a list"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse(**extra)


def _adopt(spark: Any, site: dict[str, Path], table: TableConfig, source: Path) -> Any:
    """Adopt ``source`` with the site's allowed folder as the only adoption root."""
    return adopt(
        HistoryTable(spark, table, site["warehouse"], site["landing"]),
        AdoptRequest(str(source), (site["allowed"],)),
    )


def test_adoption_errors_name_rows_never_key_values(spark, site) -> None:
    export = site["allowed"] / "export"
    export.mkdir()
    pq.write_table(pa.table({"id": [SECRET, SECRET], "v": [1, 2]}), export / "part-0.parquet")
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    with pytest.raises(AdoptionError) as err:
        _adopt(spark, site, table, export)
    assert SECRET not in str(err.value)
    assert "part-0.parquet row 1 and" in str(err.value)


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_delta_log_never_points_adoption_at_files_outside_the_source(
    spark, site, partitioned
) -> None:
    """Whoever can write a ``_delta_log`` under an adoption root could name another table's
    history or change-log files by absolute path or ``..``: refused before any file is read."""
    secret_file = site["private"] / "history.parquet"
    pq.write_table(pa.table({"id": [1], "v": [SECRET]}), secret_file)
    for name, path in (("abs", str(secret_file)), ("up", "../../private/history.parquet")):
        export = site["allowed"] / f"{name}-{partitioned}"
        data = pa.table({"id": [2], "v": ["x"], "p": ["a"]})
        write_deltalake(str(export), data, partition_by=["p"] if partitioned else None)
        log = export / "_delta_log" / "00000000000000000000.json"
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        for action in lines:
            if "add" in action:
                action["add"]["path"] = path
        log.write_text("".join(json.dumps(a) + "\n" for a in lines))
        table = TableConfig(name="orders", primary_key=("id",), start=H5)
        with pytest.raises(AdoptionError, match="outside the table") as err:
            _adopt(spark, site, table, export)
        assert SECRET not in str(err.value)
        assert not (site["warehouse"] / "orders").exists()


# -- issue 31: glob characters never reach Spark's path parser as a pattern --------------------

# Spark expands ``{a,b}`` (which may hold ``/``) before it resolves ``..``: below an allowed
# prefix, this names the payments table's change log in the warehouse next to it.
ESCAPE = "n{/..}{/..}{/warehouse/_cdc/payments/changelog}"


def test_an_adoption_source_or_root_with_glob_characters_is_refused(site) -> None:
    wh, landing = site["warehouse"], site["landing"]
    forbidden = (wh, landing)
    for source, roots in [
        (f"s3://exports/orders/{ESCAPE}", ["s3://exports/orders"]),
        ("s3://exports/orders/n%7B/..%7D%7B/..%7D/x", ["s3://exports/orders"]),  # decoded
        (f"{site['allowed']}/{ESCAPE}", [site["allowed"]]),
    ]:
        with pytest.raises(
            SourceRootError, match=r"^adoption source .*: glob characters \(\{ \}\) are not allowed"
        ):
            adoption_source(source, roots, forbidden)
        with pytest.raises(AdoptionError, match="glob characters"):
            adopt(
                HistoryTable(
                    None,  # type: ignore[arg-type]  # refused before any Spark work
                    CSV_TABLE,
                    wh,
                    landing,
                ),
                AdoptRequest(source, tuple(roots)),
            )
    with pytest.raises(SourceRootError, match=r"^adoption_roots entry .*glob characters \(\[ \]\)"):
        adoption_source("s3://exports/b/x", ["s3://exports/a[1]"], forbidden)
    with pytest.raises(SourceRootError, match=r"^snapshot .*glob characters \(\* \{ \}\)"):
        snapshot_folder(f"{site['allowed']}/s{{/..}}{{/..}}/*", [site["allowed"]], forbidden)
    glob_root = site["allowed"] / "snaps[1]"
    glob_root.mkdir()
    with pytest.raises(SourceRootError, match=r"^snapshot_roots entry .*glob characters"):
        snapshot_folder(str(site["allowed"] / "s"), [glob_root], forbidden)


def test_the_config_refuses_source_roots_with_glob_characters(tmp_path: Path) -> None:
    def parse(**extra: Any) -> Any:
        raw = {"landing_root": "landing", "warehouse_root": "warehouse", **extra}
        raw["tables"] = [{"name": "t", "primary_key": ["id"], "start": "2024-01-01-00:00"}]
        return parse_config(raw, tmp_path)

    for extra in (
        {"adoption_roots": ["s3://b/p{/..}"]},
        {"adoption_roots": ["s3://b/p%5B1%5D"]},
        {"snapshot_roots": ["snaps[1]"]},
    ):
        with pytest.raises(ConfigError, match=r"entry .* glob characters .* are not allowed"):
            parse(**extra)


def _delta_with_add_path(export: Path, path: str, partitioned: bool) -> None:
    """A Delta table at ``export`` whose log names its one data file ``path``."""
    data = pa.table({"id": [2], "v": ["x"], "p": ["a"]})
    write_deltalake(str(export), data, partition_by=["p"] if partitioned else None)
    log = export / "_delta_log" / "00000000000000000000.json"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for action in lines:
        if "add" in action:
            action["add"]["path"] = path
    log.write_text("".join(json.dumps(a) + "\n" for a in lines))


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_delta_log_add_path_with_a_glob_pattern_is_refused_never_read(
    spark, site, partitioned, monkeypatch
) -> None:
    """``a{/..}{/..}{/..}/private/history.parquet`` has no ``..`` segment, and Spark expanded
    it to ``a/../../../private/history.parquet``: outside the source. Refused, naming the
    field, before Spark is handed any path. Percent-encoded, the same text is a file name
    (decoded, checked, read literally): there is no such file, and the secret is not read."""
    from pyspark.sql.readwriter import DataFrameReader

    secret_file = site["private"] / "history.parquet"
    pq.write_table(pa.table({"id": [1], "v": [SECRET]}), secret_file)
    handed: list[str] = []
    parquet = DataFrameReader.parquet

    def spy(self: DataFrameReader, *paths: str, **options: Any) -> Any:
        handed.extend(paths)
        return parquet(self, *paths, **options)

    monkeypatch.setattr(DataFrameReader, "parquet", spy)
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    export = site["allowed"] / f"bare-{partitioned}"
    _delta_with_add_path(export, "a{/..}{/..}{/..}/private/history.parquet", partitioned)
    with pytest.raises(AdoptionError, match=r"add\.path .* has glob characters \{ \} not") as err:
        _adopt(spark, site, table, export)
    assert SECRET not in str(err.value) and handed == []

    export = site["allowed"] / f"encoded-{partitioned}"
    encoded = "a%7B%2F..%7D%7B%2F..%7D%7B%2F..%7D/private/history.parquet"
    _delta_with_add_path(export, encoded, partitioned)
    with pytest.raises(Exception, match="PATH_NOT_FOUND") as err:
        _adopt(spark, site, table, export)
    assert SECRET not in str(err.value)
    assert handed and all("private/history.parquet" in p and "\\{" in p for p in handed)
    assert not (site["warehouse"] / "orders").exists()


def test_a_delta_log_path_is_decoded_then_kept_inside_the_table() -> None:
    """What every read of a Delta table's files goes through (``delta.absolute_paths``)."""
    inside = {
        "part-0.parquet": "part-0.parquet",
        "p=x%257By%257D/part-0.parquet": "p=x%7By%7D/part-0.parquet",  # delta-rs, x{y}
        "p=x%257By%7D/part-0.parquet": "p=x%7By}/part-0.parquet",  # delta-spark, x{y}
        "p=a%2520b/part-0.parquet": "p=a%20b/part-0.parquet",
        "d%C3%A9j%C3%A0/a%20b.parquet": "déjà/a b.parquet",
    }
    for logged, relative in inside.items():
        assert delta.relative_file("/wh/t", logged) == relative
        assert delta.absolute_paths("/wh/t", [logged]) == [f"/wh/t/{relative}"]
    outside = {
        "a{/..}{/..}/x.parquet": "glob characters { }",
        "x*.parquet": "glob characters *",
        "a\\..\\x.parquet": "glob characters \\",
        "/wh/other/x.parquet": "an absolute path",
        "%2Fwh%2Fother/x.parquet": "an absolute path",
        "file:/wh/other/x.parquet": "a URI",
        "s3a://bucket/x.parquet": "a URI",
        "../other/x.parquet": "a '.' or '..' segment",
        "a/%2E%2E/%2e%2e/other/x.parquet": "a '.' or '..' segment",
        "a%5C..%5C..%5Cx.parquet": "a '.' or '..' segment",
        "": "empty",
    }
    for logged, why in outside.items():
        with pytest.raises(delta.UnsafeFilePathError, match=f"add.path .*{re.escape(why)}"):
            delta.absolute_paths("/wh/t", [logged])


@pytest.mark.parametrize("writer", ["delta-rs", "delta-spark"])
def test_partition_values_with_glob_characters_adopt(spark, site, writer) -> None:
    """Legitimate logs are not refused: each writer percent-encodes a partition value's
    ``{``, ``[``, ``*``, ``%`` or space in the add path; the decoded name (delta-spark leaves
    ``}`` and ``]`` bare on disk) is read by its name."""
    from cdc_platform_tests.helpers import history_rows, normalize

    values = ["x{y}", "[1]", "a*b?", "c%d e", "plain"]
    export = site["allowed"] / writer
    data = pa.table({"id": list(range(len(values))), "p": values})
    if writer == "delta-rs":
        write_deltalake(str(export), data, partition_by=["p"])
    else:
        spark.createDataFrame(data.to_pandas()).write.format("delta").partitionBy("p").save(
            str(export)
        )
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    result = _adopt(spark, site, table, export)
    assert result.live_rows == len(values)
    history = TablePaths.of(site["warehouse"], "orders").history
    assert normalize(history_rows(history), ["id", "p"]) == list(enumerate(values))


# -- item 5: a file or folder swapped for a symlink after the listing is never read -------------


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


# -- item 6: hostile names ------------------------------------------------------------------


def test_hostile_landing_names_never_inject_yaml_into_the_snippet(site) -> None:
    evil = "part\n  - name: pwned\n    primary_key: [x]\n    start: '2024-01-01-00:00'\n#"
    write_parquet_events(site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1)], name=evil)
    columns = {"id": [1], 'we"ird\\': [1], "new\nline": [2], "cdc_operation_type": ["INSERT"]}
    columns |= {"cdc_change_seq": [1], "cdc_commit_timestamp": [TS]}
    hour_later = hour_folder(site["landing"], "orders", H5.replace(hour=6))
    hour_later.mkdir(parents=True)
    pq.write_table(pa.table(columns), hour_later / "ok.parquet")
    found = describe(site["landing"], "orders")
    entries = yaml.safe_load("tables:\n" + found.config_snippet())["tables"]
    assert [e["name"] for e in entries] == ["orders"] and "pwned" not in found.config_snippet()
    assert set(entries[0]) == {"name", "primary_key", "start"}
    assert any("control character in the name" in n for n in found.notes)
    assert all("\n" not in c for c, _ in found.columns)
    assert 'we"ird\\' in [c for c, _ in found.columns]


def test_a_backtick_in_a_key_name_is_a_name_and_encrypted_keys_are_redacted(spark, site) -> None:
    key = "we`ird` OR true OR `x"
    table = TableConfig(name="orders", primary_key=(key,), start=H5)
    rows = [ev("INSERT", 1, TS, SECRET, key_column=key, v=1)]
    write_parquet_events(site["landing"], "orders", H5, rows)
    materialize(spark, table, site["landing"], site["warehouse"], [H5])
    paths = TablePaths.of(site["warehouse"], "orders")
    # Two active versions of the key: the checks run (the name was SQL text: a parse error)
    # and fail, and the sample of an encrypted table's check never shows the key.
    history = DeltaTable(str(paths.history)).to_pyarrow_table()
    write_deltalake(str(paths.history), pa.concat_tables([history, history]), mode="overwrite")
    failed = {
        o.name: o
        for o in invariants.run_checks(spark, paths, table.key, hide_keys=True)
        if not o.passed
    }
    assert failed[invariants.ONE_ACTIVE].failing == 1
    assert all(o.sample == [invariants.REDACTED] for o in failed.values())
    assert SECRET not in repr(failed)


@pytest.mark.parametrize("name", ["bad[1.parquet", "x{a,b}.parquet"])
def test_a_landing_file_named_like_a_glob_pattern_is_read_by_its_name(spark, site, name) -> None:
    """Spark reads ``[`` and ``{a,b}`` in a path as a pattern (issue 31): the unclosed bracket
    failed every run of the hour, and ``x{a,b}.parquet`` would read ``xa.parquet`` in its
    place. Both are read natively by their own names, each file's rows once."""
    from cdc_platform_tests.helpers import history_rows, normalize

    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    write_parquet_events(site["landing"], "orders", H5, [ev("INSERT", 1, TS, 1, v="a")], name=name)
    write_parquet_events(
        site["landing"], "orders", H5, [ev("INSERT", 2, TS, 2, v="b")], name="xa.parquet"
    )
    out = materialize(spark, table, site["landing"], site["warehouse"], [H5])
    assert out.quarantined == () and (out.files_read, out.events_read) == (2, 2)
    assert sorted(os.path.basename(p) for p in out.read_natively) == sorted([name, "xa.parquet"])
    history = TablePaths.of(site["warehouse"], "orders").history
    assert normalize(history_rows(history), ["id", "v"]) == [(1, "a"), (2, "b")]
