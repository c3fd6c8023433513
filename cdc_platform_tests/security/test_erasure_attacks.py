"""Erasures and salts attacked (docs/history-table.md, "Erasing a key"; docs/SECURITY.md): a
changed hash salt is refused before a run reads, a hashed key is erased whatever its source
type, a key with no events fails the request, and an erasure leaves the key's value in no Delta
log entry, no stale current table and no quarantine reason."""

from __future__ import annotations

import base64
import json
import os
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc_platform.lib.config import REPO_ROOT, PlatformConfig, load_config
from cdc_platform.lib.history import current_table
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.rows.pii import SaltChangedError, hash_column
from cdc_platform.lib.ledgers import erased_keys, quarantine
from cdc_platform.lib.ledgers.ledger import Ledger
from cdc_platform.lib.operations.erase import WITHHELD
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    CDC_FIELDS,
    HASH_SALT,
    materialize_with_checks,
    materialize_with_cli,
    one_table_config,
    run_operator_job,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.integration.test_pii import failure_of

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
TARGET, OTHER, HIGH = 918273645, 2, 777000111222333
NAME, LATER_NAME = "Zelda Quux-Erasure", "Zelda Quux-Later"
EMAIL = "zq@example.com"
NEW_SALT = b"another-salt-restored-from-a-backup"
# A source key that is itself 64 hex digits (a hash of something, in the source).
HEX_KEY = "ab" * 32
SALT_CHANGED = "differs from the one the table's erased keys were recorded under"
HASHING_CHANGED = "differs from the one the table's hashed columns ['email'] were recorded under"


def erase_job(platform: PlatformConfig, keys, **extra):
    return run_operator_job(platform, "erase_key", "erase", keys=keys, reason="DSR-7", **extra)


def live(table: Path | object) -> str:
    return repr(DeltaTable(str(table)).to_pyarrow_table().to_pylist())


def replace_salt(keyring: Path) -> None:
    """The keyring regenerated (or restored from another backup): another hash_salt."""
    keyring.write_text(json.dumps({"hash_salt": base64.b64encode(NEW_SALT).decode()}))
    keyring.chmod(0o600)


def data_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*.parquet") if "_delta_log" not in p.parts}


def two_tables(tmp_path: Path) -> PlatformConfig:
    """``t`` keyed on an id, ``u`` hashing its ``email``; snapshots under ``snapshots``."""
    path = tmp_path / "cdc_platform.yaml"
    (tmp_path / "snapshots").mkdir()
    path.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\n"
        f"snapshot_roots: [{tmp_path / 'snapshots'}]\ntables:\n"
        '  - name: t\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
        "  - name: u\n    primary_key: [id]\n    hash_columns: [email]\n"
        '    start: "2024-01-01-00:00"\n'
    )
    return load_config(path)


def cli_env(tmp_path: Path, keyring: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    return env | {
        "CDC_PLATFORM_CONFIG": str(tmp_path / "cdc_platform.yaml"),
        "CDC_KEYRING": str(keyring),
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
    }


def test_a_changed_salt_is_refused_before_a_late_file_is_read(spark, tmp_path, keyring):
    """After ``erase_key``, a keyring with another salt would recognise no erased key (and
    hash ``u``'s emails apart from its history): the CLI's materialization fails naming what
    changed, before it reads the late files; the operator jobs are refused as well."""
    platform = two_tables(tmp_path)
    landing, warehouse = platform.landing_path, Path(platform.warehouse_root.uri)
    t = lambda m: H0 + timedelta(minutes=m)  # noqa: E731
    write_parquet_events(
        landing, "t", H0, [ev("INSERT", 1, t(1), TARGET, name=NAME), ev("INSERT", 2, t(2), OTHER)]
    )
    write_parquet_events(landing, "u", H0, [ev("INSERT", 1, t(1), 1, email=EMAIL)])
    for table in ("t", "u"):
        assert materialize_with_checks(platform, table, H0).success
    assert erase_job(platform, [{"id": str(TARGET)}]).success

    replace_salt(keyring)
    write_parquet_events(landing, "t", H1, [ev("UPDATE", 3, H1, TARGET, name=LATER_NAME)])
    write_parquet_events(landing, "u", H1, [ev("UPDATE", 2, H1, 1, email=EMAIL)])
    before = data_files(warehouse)
    proc = materialize_with_cli(
        "t,u", "2024-01-01-01:00...2024-01-01-01:00", cli_env(tmp_path, keyring), REPO_ROOT
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert SALT_CHANGED in out and HASHING_CHANGED in out, out[-4000:]
    assert NEW_SALT.decode() not in out and base64.b64encode(NEW_SALT).decode() not in out
    assert data_files(warehouse) == before  # nothing read, nothing written
    t_paths, u_paths = (TablePaths.of(platform.warehouse_root, n) for n in ("t", "u"))
    assert str(TARGET) not in live(t_paths.changelog) + live(t_paths.history)
    new_hash = hash_column(pa.array([EMAIL]), NEW_SALT)[0].as_py()
    assert new_hash not in live(u_paths.changelog) + live(u_paths.history)

    # The operator jobs that log events, and a second erasure (its hashes would be another
    # salt's), are refused too, writing nothing.
    snapshot = write_parquet_events(
        tmp_path / "snapshots", "t", H1, [ev("INSERT", 9, H1, TARGET, name=LATER_NAME)]
    ).parent
    ledger = live(t_paths.erased_keys)
    for result in (
        run_operator_job(platform, "resync_table", "resync", snapshot=str(snapshot)),
        erase_job(platform, [{"id": str(OTHER)}]),
    ):
        assert not result.success and SALT_CHANGED in failure_of(result), failure_of(result)
    assert live(t_paths.erased_keys) == ledger
    assert str(TARGET) not in live(t_paths.changelog)


def hashed_keys_config(tmp_path: Path) -> PlatformConfig:
    return one_table_config(tmp_path, "primary_key: [id, ref]\n    hash_columns: [id, ref]")


def test_erase_key_hashes_a_cleartext_in_its_source_type_and_fails_for_an_absent_key(
    spark, tmp_path, keyring
):
    """A hashed integer key is hashed as the integer its files held, and a source key that is
    itself 64 hex digits is tried as a cleartext too: the rows go. A key with no events fails
    the request, writing nothing, unless ``allow_absent``; then it never arrives."""
    platform = hashed_keys_config(tmp_path)
    paths = TablePaths.of(platform.warehouse_root, "t")
    rows = [
        ev("INSERT", 1, H0 + timedelta(minutes=1), TARGET, ref=HEX_KEY, name=NAME),
        ev("INSERT", 2, H0 + timedelta(minutes=2), OTHER, ref="b", name="b"),
    ]
    write_parquet_events(platform.landing_path, "t", H0, rows)
    assert materialize_with_checks(platform, "t", H0).success
    assert NAME in live(paths.history)

    result = erase_job(platform, [{"id": str(TARGET), "ref": HEX_KEY}])
    assert result.success, failure_of(result)
    (observed,) = result.asset_observations_for_node("erase")
    assert observed.metadata["keys_found"].value == 1
    assert NAME not in live(paths.history) + live(paths.changelog)
    assert "'b'" in live(paths.history)

    ledger = live(paths.erased_keys)
    absent = [{"id": "31337", "ref": "never-seen"}]
    refused = erase_job(platform, absent)
    assert not refused.success and "key(s) 1 of the request have no event" in failure_of(refused)
    assert "31337" not in failure_of(refused) and "never-seen" not in failure_of(refused)
    assert live(paths.erased_keys) == ledger  # nothing written
    not_a_value = erase_job(platform, [{"id": "not-a-number", "ref": "b"}])
    assert not not_a_value.success and "neither a stored hash" in failure_of(not_a_value)

    assert erase_job(platform, absent, allow_absent=True).success
    write_parquet_events(  # the key arrives later: never logged
        platform.landing_path,
        "t",
        H1,
        [ev("INSERT", 3, H1, 31337, ref="never-seen", name=LATER_NAME)],
    )
    assert materialize_with_checks(platform, "t", H1).success
    assert LATER_NAME not in live(paths.changelog) + live(paths.history)


def test_an_erasure_leaves_the_key_in_no_delta_log_no_stale_current_table_and_no_reason(
    spark, tmp_path, keyring
):
    """The retracted keys' commit keeps no bound of the erased key in its Delta log entry; a
    current table left behind once ``current_table`` was turned off loses the key's rows; a
    quarantine reason quoting another cell of the key's file row is withheld."""
    platform = one_table_config(tmp_path, "primary_key: [id]\n    current_table: true")
    paths = TablePaths.of(platform.warehouse_root, "t")
    t = lambda m: H0 + timedelta(minutes=m)  # noqa: E731
    # The key is neither the least nor the greatest: no earlier file's bound is its value.
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [
            ev("INSERT", 1, t(1), OTHER, name="b"),
            ev("INSERT", 2, t(2), TARGET, name=NAME),
            ev("INSERT", 3, t(3), HIGH, name="c"),
        ],
    )
    big = 2**64 - 1  # a uint64 the reader cannot keep: its reason quotes it, not the key
    bad = pa.schema([pa.field("id", pa.int64()), pa.field("big", pa.uint64()), *CDC_FIELDS])
    write_parquet_events(
        platform.landing_path, "t", H1, [ev("UPDATE", 4, t(4), TARGET, big=big)], schema=bad
    )
    for hour in (H0, H1):
        assert materialize_with_checks(platform, "t", hour).success
    (reason,) = [q.reason for q in quarantine.current(paths.quarantine)]
    assert str(big) in reason and str(TARGET) not in reason
    current_table.refresh(HistoryTable.of(spark, platform, "t"))  # as the t_current asset does
    assert NAME in live(paths.current)

    warehouse = Path(platform.warehouse_root.uri)
    # Entries from before keep what their commits wrote (small runs' key lists; limitations).
    before = set(warehouse.rglob("_delta_log/*.json"))
    stale = one_table_config(tmp_path, "primary_key: [id]")  # current_table turned off
    result = erase_job(stale, [{"id": str(TARGET)}])
    assert result.success, failure_of(result)

    assert str(TARGET) not in live(paths.current) and "'c'" in live(paths.current)
    assert [q.reason for q in quarantine.current(paths.quarantine)] == [WITHHELD]
    logs = sorted(set(warehouse.rglob("_delta_log/*.json")) - before)
    assert any("retracted_keys" in str(p) for p in logs)  # the erasure's commit is among them
    for path in logs:  # every entry the erasure wrote, in every table
        assert str(TARGET) not in path.read_text(), path


def test_a_ledger_from_before_the_fingerprint_takes_the_salt_of_its_first_load(tmp_path):
    """An erased-keys ledger written before the fingerprint cannot tell which salt it was: its
    first read (the first run after the upgrade) records the keyring's salt, after which
    another salt is refused, by a read and by an erasure alike."""
    path = tmp_path / "erased_keys"
    types = pa.schema([pa.field("id", pa.int64())])
    at = datetime(2024, 1, 2, tzinfo=UTC)
    hashes = erased_keys.key_hashes({"id": pa.array([TARGET])}, 1, HASH_SALT).to_pylist()
    encoded = base64.b64encode(types.serialize().to_pybytes()).decode()
    row = {"key_hash": hashes[0], "key_types": encoded, "reason": "r", "run_id": "x"}
    row["erased_at"] = at
    Ledger(path, erased_keys.SCHEMA).append([row])  # as the ledger was written before
    assert erased_keys.load(path, Keyring({}, {}, HASH_SALT)) is not None  # pinned now
    assert erased_keys.add(path, hashes, types, "again", "y", at, HASH_SALT) == 0
    with pytest.raises(SaltChangedError, match=SALT_CHANGED):
        erased_keys.load(path, Keyring({}, {}, NEW_SALT))
    with pytest.raises(SaltChangedError, match=SALT_CHANGED):
        erased_keys.add(path, hashes, types, "again", "z", at, NEW_SALT)


def test_an_erasure_leaves_another_table_named_like_the_current_table_alone(
    spark, tmp_path, keyring
):
    """With ``current_table`` off, ``<table>_current`` may be another table of the config: the
    erasure of ``t``'s key never rewrites ``t_current``'s history."""
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: t\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
        '  - name: t_current\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    platform = load_config(config)
    for table in ("t", "t_current"):
        rows = [ev("INSERT", 1, H0 + timedelta(minutes=1), TARGET, name=f"{table} row")]
        write_parquet_events(platform.landing_path, table, H0, rows)
        assert materialize_with_checks(platform, table, H0).success
    other = TablePaths.of(platform.warehouse_root, "t_current").history
    before = live(other)
    result = erase_job(platform, [{"id": str(TARGET)}])
    assert result.success, failure_of(result)
    assert "t row" not in live(TablePaths.of(platform.warehouse_root, "t").history)
    assert live(other) == before and "t_current row" in before


def test_a_resync_records_the_source_type_a_hashed_key_arrives_in(spark, tmp_path, keyring):
    """A re-sync snapshot may bring a hashed key column in a type the files never had (an
    integer ``ref`` where the files held text): the re-sync records it, so an erasure of the
    snapshot's key hashes its cleartext as that integer and finds the rows."""
    import pyarrow.parquet as pq

    one_table_config(tmp_path, "primary_key: [id, ref]\n    hash_columns: [id, ref]")
    config = tmp_path / "cdc_platform.yaml"
    config.write_text(config.read_text() + f"snapshot_roots: [{tmp_path / 'snapshots'}]\n")
    platform = load_config(config)
    paths = TablePaths.of(platform.warehouse_root, "t")
    rows = [ev("INSERT", 1, H0 + timedelta(minutes=1), OTHER, ref="b", name="b")]
    write_parquet_events(platform.landing_path, "t", H0, rows)
    assert materialize_with_checks(platform, "t", H0).success
    snapshot = tmp_path / "snapshots" / "t"
    snapshot.mkdir(parents=True)
    snapshot_rows = {"id": [TARGET], "ref": pa.array([5], pa.int64()), "name": [NAME]}
    pq.write_table(pa.table(snapshot_rows), snapshot / "part-0.parquet")
    resynced = run_operator_job(platform, "resync_table", "resync", snapshot=str(snapshot))
    assert resynced.success, failure_of(resynced)
    assert NAME in live(paths.history)
    result = erase_job(platform, [{"id": str(TARGET), "ref": "5"}])
    assert result.success, failure_of(result)
    (observed,) = result.asset_observations_for_node("erase")
    assert observed.metadata["keys_found"].value == 1
    assert NAME not in live(paths.history) + live(paths.changelog)
