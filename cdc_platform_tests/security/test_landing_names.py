"""Hostile names in the landing zone: file names that read as glob patterns are read by
their name, names never inject YAML into a config snippet, symlinks and sub-folders in an hour are
set aside and never followed, and a missing landing root fails with a clear message."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.discovery import describe
from cdc_platform.lib.landing.where.layout import IN_SUBFOLDER, SYMLINK, hour_folder
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.pipeline import LandingRootMissingError, materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events
from cdc_platform_tests.security.pipeline_runs import H0, H1, TABLE, paths, run
from cdc_platform_tests.security.sites import H5, TS


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


@pytest.mark.parametrize("name", ["bad[1.parquet", "x{a,b}.parquet"])
def test_a_landing_file_named_like_a_glob_pattern_is_read_by_its_name(spark, site, name) -> None:
    """Spark reads ``[`` and ``{a,b}`` in a path as a pattern: the unclosed bracket
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


def test_symlinks_and_sub_folders_are_set_aside_never_followed(spark, lake):
    secret = lake["root"] / "secret.parquet"
    secret.write_text("SECRET first line of a file the service can read\n")
    secret_dir = lake["root"] / "elsewhere"
    secret_dir.mkdir()
    write_parquet_events(secret_dir, "t", H0, [ev("INSERT", 50, H0, 50, v=50)], name="x.parquet")
    good = write_parquet_events(lake["landing"], "t", H0, [ev("INSERT", 1, H0, 1, v=1)])
    folder = good.parent
    (folder / "link.parquet").symlink_to(secret)
    (folder / "linked_dir").symlink_to(secret_dir)
    sub = folder / "sub"
    sub.mkdir()
    write_parquet_events(sub, "t", H0, [ev("INSERT", 2, H0, 2, v=2)], name="nested.parquet")
    # An hour folder that is itself a link, to another table's data.
    hour1 = hour_folder(lake["landing"], "t", H1)
    hour1.parent.mkdir(parents=True, exist_ok=True)
    hour1.symlink_to(hour_folder(secret_dir, "t", H0))

    result = run(spark, lake, [H0, H1])
    entries = {q.file: q.reason for q in quarantine.current(paths(lake).quarantine)}
    hour0 = "t/year=2024/month=01/day=01/hour=00"
    assert entries == {
        f"{hour0}/link.parquet": SYMLINK,
        f"{hour0}/linked_dir": SYMLINK,
        f"{hour0}/sub/t/year=2024/month=01/day=01/hour=00/nested.parquet": IN_SUBFOLDER,
        "t/year=2024/month=01/day=01/hour=01": SYMLINK,
    }
    assert "SECRET" not in repr(result)
    assert [r["id"] for r in history_rows(paths(lake).history)] == [1]


def test_missing_landing_root_fails_with_a_clear_message(spark, lake, tmp_path):
    missing = tmp_path / "no-such-landing"
    with pytest.raises(LandingRootMissingError, match=r"landing_root .*no-such-landing does not"):
        materialize(spark, TABLE, missing, lake["warehouse"], [H0])
    assert not paths(lake).changelog.path.exists()
    # A table folder missing inside an existing landing root is just zero files.
    assert run(spark, lake, [H0]).files_read == 0
