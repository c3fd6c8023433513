"""A run config naming a snapshot or adoption source outside what the config allows:
traversal, relative and absolute paths, other buckets and schemes, symlinks, the platform's own
folders, glob characters. Each is refused before anything is read, and the config keeps the
source roots apart from the landing zone and the warehouse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc_platform.lib.config import ConfigError, parse_config
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.adopt import AdoptionError, AdoptRequest, adopt
from cdc_platform.lib.operations.resync import (
    ResyncError,
    ResyncRequest,
    resync,
)
from cdc_platform.lib.storage.roots import (
    SourceRootError,
    adoption_source,
    snapshot_folder,
)
from cdc_platform_tests.security.sites import CSV_TABLE


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
