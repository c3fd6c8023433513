"""Hashed and blocked columns (docs/history-table.md, "Hashed and blocked columns"): the cleartext
of either reaches no Delta file of the warehouse, hashes join, and a change is refused."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdc_platform.defs.resources import KEYRING_ENV_VAR
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import PlatformConfig, load_config
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.decoding.keyring import Keyring, KeyringError
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import (
    HASH_SALT,
    dagster_resources,
    materialize_with_checks,
    run_operator_job,
    write_parquet_events,
)
from cdc_platform_tests.helpers import event as ev

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
SALT = HASH_SALT
EMAIL, SSN, BAD = "alice@example.com", "123-45-6789", 2**64 - 1
PROTECTED = "    hash_columns: [email, code]\n    block_columns: [ssn]\n"


def config_file(tmp_path: Path, protect: str = PROTECTED, keyless: bool = False) -> PlatformConfig:
    key = "keyless: true" if keyless else "primary_key: [id]"
    path = tmp_path / "cdc_platform.yaml"
    path.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        f'  - name: t\n    {key}\n    start: "2024-01-01-00:00"\n    current_table: true\n'
        + protect
    )
    return load_config(path)


def materialize_asset(platform: PlatformConfig, hour: datetime) -> dg.ExecuteInProcessResult:
    return materialize_with_checks(platform, "t", hour)


def hashed(text: str) -> str:
    """The documented form: SHA-256 of the salt, then the value's tagged bytes."""
    raw = text.encode()
    return hashlib.sha256(SALT + b"s" + len(raw).to_bytes(4, "big") + raw).hexdigest()


def every_value_in(warehouse: Path) -> str:
    """Every cell of every Parquet file under the warehouse, and every other file's bytes."""
    seen = []
    for path in sorted(p for p in warehouse.rglob("*") if p.is_file()):
        if path.suffix == ".parquet":
            seen.append(repr(pq.read_table(path).to_pylist()))
        else:
            seen.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(seen)


def failure_of(result: dg.ExecuteInProcessResult) -> str:
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    return failure.event_specific_data.error.message  # type: ignore[union-attr]


@pytest.mark.parametrize("keyless", [False, True], ids=["keyed", "keyless"])
def test_hashed_and_blocked_cleartext_reaches_no_warehouse_file(spark, tmp_path, keyring, keyless):
    platform = config_file(tmp_path, keyless=keyless)
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [
            ev("INSERT", 1, H0 + timedelta(minutes=1), 1, email=EMAIL, SSN=SSN, name="a"),
            ev("INSERT", 2, H0 + timedelta(minutes=2), 2, email=None, SSN="999-99-9999", name="b"),
        ],
    )
    # A hashed column's value that cannot be stored: its file is set aside, the value unquoted.
    bad = pa.table(
        {
            "id": pa.array([3], pa.int64()),
            "code": pa.array([BAD], pa.uint64()),
            "cdc_operation_type": ["INSERT"],
            "cdc_change_seq": pa.array([3], pa.int64()),
            "cdc_commit_timestamp": pa.array(
                [H0 + timedelta(minutes=3)], pa.timestamp("us", "UTC")
            ),
        }
    )
    folder = platform.landing_path / "t/year=2024/month=01/day=01/hour=00"
    pq.write_table(bad, folder / "bad.parquet")
    result = materialize_asset(platform, H0)
    assert result.success
    defs = build_table_definitions(platform, platform.table("t"))
    assert defs.current is not None
    assert dg.materialize(
        [defs.current], instance=dg.DagsterInstance.ephemeral(), resources=dagster_resources()
    ).success

    history = DeltaTable(paths.history.uri).to_pyarrow_table()
    assert "SSN" not in history.column_names and "ssn" not in history.column_names
    assert sorted(history.column("email").to_pylist(), key=str) == sorted(
        [hashed(EMAIL), None], key=str
    )
    (entry,) = DeltaTable(paths.quarantine.uri).to_pyarrow_table().to_pylist()
    assert entry["file"].endswith("bad.parquet") and str(BAD) not in entry["reason"]

    stored = every_value_in(Path(platform.warehouse_root.uri))
    for secret in (
        EMAIL,
        SSN,
        "999-99-9999",
        str(BAD),
        SALT.decode(),
        base64.b64encode(SALT).decode(),
    ):
        assert secret not in stored
    for event in result.all_events:  # nor in what the run told Dagster
        assert EMAIL not in str(event) and SSN not in str(event)


def test_a_change_of_hashed_or_blocked_columns_is_refused(spark, tmp_path, keyring):
    platform = config_file(tmp_path)
    write_parquet_events(
        platform.landing_path, "t", H0, [ev("INSERT", 1, H0 + timedelta(minutes=1), 1, email=EMAIL)]
    )
    assert materialize_asset(platform, H0).success
    write_parquet_events(
        platform.landing_path, "t", H1, [ev("UPDATE", 2, H1 + timedelta(minutes=1), 1, email="b")]
    )
    for protect in ("", "    hash_columns: [email]\n", PROTECTED + "    # same\n"):
        result = materialize_asset(config_file(tmp_path, protect), H1)
        if protect.endswith("# same\n"):
            assert result.success  # the same columns: applied
            continue
        assert not result.success
        assert "Nothing was written" in failure_of(result) and "block_columns" in failure_of(result)


def test_hash_columns_without_a_salt_refuse_the_run(spark, tmp_path, monkeypatch):
    monkeypatch.delenv(KEYRING_ENV_VAR, raising=False)
    platform = config_file(tmp_path)
    write_parquet_events(
        platform.landing_path, "t", H0, [ev("INSERT", 1, H0 + timedelta(minutes=1), 1, email=EMAIL)]
    )
    result = materialize_asset(platform, H0)
    assert not result.success and "no hash_salt" in failure_of(result)
    assert not (Path(platform.warehouse_root.uri) / "t").exists()


@pytest.mark.parametrize(
    ("protect", "message"),
    [
        ("    hash_columns: [a]\n    block_columns: [A]\n", "hashed too"),
        ("    block_columns: [id]\n", "cannot be blocked"),
        ("    hash_columns: [cdc_change_seq]\n", "not data columns"),
        ("    block_columns: [a]\n    track_history_columns: [A]\n", "never stored"),
    ],
)
def test_config_rules_of_protected_columns(tmp_path, protect, message):
    with pytest.raises(ValueError, match=message):
        config_file(tmp_path, protect)


def test_the_keyring_salt_is_checked_and_never_shown():
    short = base64.b64encode(b"short").decode()
    with pytest.raises(KeyringError, match="at least 16") as err:
        Keyring.from_mapping({"hash_salt": short})
    assert short not in str(err.value)
    ring = Keyring.from_mapping({"hash_salt": base64.b64encode(SALT).decode()})
    assert ring.for_table("t").hash_salt == SALT
    assert SALT.decode() not in repr(ring) and "hash_salt" in repr(ring)


def test_a_csv_table_never_parses_a_blocked_column(spark, tmp_path, keyring):
    """Undeclared in `columns` and holding cells no type would take: never read."""
    path = tmp_path / "cdc_platform.yaml"
    path.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: t\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n    format: csv\n'
        "    columns: {id: long, email: string}\n" + PROTECTED
    )
    platform = load_config(path)
    folder = platform.landing_path / "t/year=2024/month=01/day=01/hour=00"
    folder.mkdir(parents=True)
    (folder / "part-1.csv").write_text(
        "id,SSN,email,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
        f"1,{SSN},{EMAIL},INSERT,1,2024-01-01T00:01:00Z\n"
    )
    table, ring = platform.table("t"), Keyring.from_file(keyring)
    result = materialize(spark, table, platform.landing_path, platform.warehouse_root, [H0], ring)
    assert result.quarantined == ()
    paths = TablePaths.of(platform.warehouse_root, "t")
    (row,) = DeltaTable(paths.history.uri).to_pyarrow_table().to_pylist()
    assert row["email"] == hashed(EMAIL) and "SSN" not in row and "ssn" not in row
    assert SSN not in every_value_in(Path(platform.warehouse_root.uri))


def protect_job(platform: PlatformConfig) -> dg.ExecuteInProcessResult:
    return run_operator_job(platform, "protect_columns", "protect")


@pytest.mark.parametrize("keyless", [False, True], ids=["keyed", "keyless"])
def test_protect_columns_rewrites_a_table_and_vacuum_removes_the_cleartext(
    spark, tmp_path, keyring, keyless
):
    """Columns hashed and blocked after the fact: after the job no live file holds their
    cleartext, a new file hashes as the rewrite did, and a VACUUM at zero retention leaves no
    file that does (docs/history-table.md: the cleartext stays until a VACUUM)."""
    from cdc_platform.lib.history import current_table
    from cdc_platform.lib.operations.maintenance import vacuum

    clear = config_file(tmp_path, protect="", keyless=keyless)
    paths = TablePaths.of(clear.warehouse_root, "t")
    write_parquet_events(
        clear.landing_path,
        "t",
        H0,
        [
            ev("INSERT", 1, H0 + timedelta(minutes=1), 1, email=EMAIL, SSN=SSN, name="a"),
            ev("UPDATE", 2, H0 + timedelta(minutes=2), 1, email=EMAIL, SSN=SSN, name="b"),
        ],
    )
    assert materialize_asset(clear, H0).success
    current_table.refresh(HistoryTable.of(spark, clear, "t"))  # as the t_current asset does
    assert EMAIL in every_value_in(Path(clear.warehouse_root.uri))

    protected = config_file(
        tmp_path, protect="    hash_columns: [email]\n    block_columns: [ssn]\n", keyless=keyless
    )
    refused = materialize_asset(protected, H0)
    assert not refused.success and "protect_columns" in failure_of(refused)
    result = protect_job(protected)
    assert result.success, failure_of(result)
    history = DeltaTable(str(paths.history)).to_pyarrow_table()
    assert "SSN" not in history.column_names
    assert set(history["email"].to_pylist()) == {hashed(EMAIL)}
    for table in (paths.history, paths.changelog, paths.current):
        live = DeltaTable(str(table)).to_pyarrow_table().to_pylist()
        assert EMAIL not in repr(live) and SSN not in repr(live)

    # A new file's cell hashes as the rewrite did: the update makes no version, checks pass.
    write_parquet_events(
        clear.landing_path,
        "t",
        H1,
        [ev("UPDATE", 3, H1 + timedelta(minutes=1), 1, email=EMAIL, SSN=SSN, name="b")],
    )
    after = materialize_asset(protected, H1)
    assert after.success and all(e.passed for e in after.get_asset_check_evaluations())
    assert DeltaTable(str(paths.history)).to_pyarrow_table().num_rows == 2

    # The replaced files keep the cleartext (time travel) until a VACUUM past the retention;
    # after it, only the Delta logs' statistics of the removed files still name it (until the
    # log's own cleanup: docs/limitations.md).
    warehouse = Path(clear.warehouse_root.uri)
    assert EMAIL in every_value_in(warehouse)
    vacuum(paths, retention_hours=0, enforce_retention_duration=False, current_table=True)
    for path in (p for p in warehouse.rglob("*") if p.is_file()):
        text = every_value_in(path.parent) if path.suffix == ".parquet" else path.read_text()
        if EMAIL in text or SSN in text:
            assert "_delta_log" in path.parts and path.suffix == ".json", path


def test_protect_columns_refuses_what_it_cannot_undo(spark, tmp_path, keyring):
    platform = config_file(tmp_path, protect="    hash_columns: [email]\n")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(
        platform.landing_path, "t", H0, [ev("INSERT", 1, H0 + timedelta(minutes=1), 1, email=EMAIL)]
    )
    assert materialize_asset(platform, H0).success
    before = DeltaTable(str(paths.changelog)).version()
    for protect, message in (
        ("", "no longer hashes ['email']"),
        ("    hash_columns: [email, id]\n", "newly hashes key column(s) ['id']"),
    ):
        result = protect_job(config_file(tmp_path, protect=protect))
        assert not result.success and message in failure_of(result)
        assert "Nothing was written" in failure_of(result)
    assert DeltaTable(str(paths.changelog)).version() == before


def test_a_protect_columns_run_that_stopped_is_finished_by_running_it_again(
    spark, tmp_path, keyring
):
    """Stopped after recording the lists under way: every run is refused, another list too,
    and the same job run again finishes it."""
    from cdc_platform.lib.history.protected_columns import PROTECTING_PROPERTY

    clear = config_file(tmp_path, protect="")
    paths = TablePaths.of(clear.warehouse_root, "t")
    write_parquet_events(
        clear.landing_path, "t", H0, [ev("INSERT", 1, H0 + timedelta(minutes=1), 1, email=EMAIL)]
    )
    assert materialize_asset(clear, H0).success
    lists = {"hash": ["email"], "block": []}
    DeltaTable(str(paths.changelog)).alter.set_table_properties(
        {PROTECTING_PROPERTY: json.dumps(lists)}, raise_if_not_exists=False
    )
    for platform in (clear, config_file(tmp_path, protect="    hash_columns: [email]\n")):
        refused = materialize_asset(platform, H0)
        assert not refused.success and "did not finish" in failure_of(refused)
    other = protect_job(config_file(tmp_path, protect="    hash_columns: [email, name]\n"))
    assert not other.success and "did not finish" in failure_of(other)
    protected = config_file(tmp_path, protect="    hash_columns: [email]\n")
    assert protect_job(protected).success
    result = materialize_asset(protected, H0)
    assert result.success and all(e.passed for e in result.get_asset_check_evaluations())
    assert set(DeltaTable(str(paths.history)).to_pyarrow_table()["email"].to_pylist()) == {
        hashed(EMAIL)
    }
