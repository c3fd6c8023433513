"""``erase_key`` (docs/history-table.md, "Erasing a key"): a data subject's keys leave every live
file of the warehouse, are never logged again, and are gone from storage after a VACUUM."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
from deltalake import DeltaTable

from cdc_platform.defs.resources import KEYRING_ENV_VAR
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.operations.erase import WITHHELD
from cdc_platform.lib.operations.maintenance import vacuum
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import (
    materialize_with_checks,
    one_table_config,
    run_operator_job,
    write_parquet_events,
)
from cdc_platform_tests.integration.test_pii import every_value_in, failure_of

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)
# Distinctive values: the erased key, its data, a key whose every event is a delete.
TARGET, ONLY_DELETED, OTHER = 918273645, 918273600, 2
NAME, LATER_NAME = "Zelda Quux-Erasure", "Zelda Quux-Later"


def erase_job(platform, keys, reason: str = "request DSR-1") -> dg.ExecuteInProcessResult:
    return run_operator_job(platform, "erase_key", "erase", keys=keys, reason=reason)


def checks_pass(result: dg.ExecuteInProcessResult) -> bool:
    return result.success and all(e.passed for e in result.get_asset_check_evaluations())


def secrets_in(text: str) -> list[str]:
    return [s for s in (str(TARGET), str(ONLY_DELETED), NAME, LATER_NAME) if s in text]


def test_erase_key_leaves_no_live_file_and_no_file_after_vacuum(spark, tmp_path, keyring):
    platform = one_table_config(tmp_path, "primary_key: [id]\n    current_table: true")
    paths = TablePaths.of(platform.warehouse_root, "t")
    t = lambda m: H0 + timedelta(minutes=m)  # noqa: E731
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [
            ev("INSERT", 1, t(1), TARGET, name=NAME),
            ev("INSERT", 2, t(2), OTHER, name="b"),
            ev("UPDATE", 3, t(3), TARGET, name=NAME + "!"),
        ],
    )
    assert checks_pass(materialize_with_checks(platform, "t", H0))
    # A hard truncate forgets the events (its ledger names the key), then the keys come back.
    assert run_operator_job(platform, "truncate_table", "truncate", soft=False).success
    write_parquet_events(
        platform.landing_path,
        "t",
        H1,
        [
            ev("INSERT", 5, H1 + timedelta(minutes=1), TARGET, name=LATER_NAME),
            ev("INSERT", 6, H1 + timedelta(minutes=2), OTHER, name="c"),
            ev("DELETE", 4, H1 + timedelta(minutes=4), ONLY_DELETED, name=None),
        ],
    )
    assert checks_pass(materialize_with_checks(platform, "t", H1))
    quarantine.record(  # a reason that quoted the key (a bad row of its own, say)
        paths.quarantine,
        [],
        [quarantine.QuarantinedFile("t/x.parquet", "p", f"row 3: id {TARGET} is bad", 3, 1, H1)],
    )
    quarantine.record(
        paths.quarantine,
        [],
        [quarantine.QuarantinedFile("t/y.parquet", "p", "row 12: no id", 12, 1, H1)],
    )
    assert secrets_in(every_value_in(Path(platform.warehouse_root.uri)))

    result = erase_job(platform, [{"id": str(TARGET)}, {"ID": str(ONLY_DELETED)}])
    assert result.success, failure_of(result)
    (observed,) = result.asset_observations_for_node("erase")
    meta = {k: v.value for k, v in observed.metadata.items()}
    assert (meta["events_removed"], meta["keys_found"], meta["forgotten_rows_removed"]) == (2, 2, 2)
    assert meta["quarantine_reasons_withheld"] == 2  # each may quote a cell of a key's row
    assert not secrets_in(str(list(result.all_events)))  # nothing the run told Dagster names them

    def live(table) -> str:
        return repr(DeltaTable(str(table)).to_pyarrow_table().to_pylist())

    for table in (
        paths.history,
        paths.changelog,
        paths.delete_only_keys,
        paths.retracted_keys,
        paths.forgotten_events,
        paths.quarantine,
        paths.erased_keys,
        paths.current,
    ):
        if DeltaTable.is_deltatable(str(table)):
            assert not secrets_in(live(table)), table
    assert "'c'" in live(paths.history) and "'b'" not in live(paths.history)  # OTHER: truncated
    assert str(OTHER) in live(paths.forgotten_events)  # OTHER's forgotten events stay forgotten
    reasons = {r.file: r.reason for r in quarantine.current(paths.quarantine)}
    assert reasons == {"t/x.parquet": WITHHELD, "t/y.parquet": WITHHELD}
    quarantine.record(paths.quarantine, ["t/x.parquet", "t/y.parquet"], [])  # files fixed

    # Read again, and a late file: the keys are never logged again; checks pass.
    write_parquet_events(
        platform.landing_path,
        "t",
        H1,
        [ev("UPDATE", 7, H1 + timedelta(minutes=3), TARGET, name=NAME)],
    )
    for hour in (H0, H1):
        assert checks_pass(materialize_with_checks(platform, "t", hour))
    assert not secrets_in(live(paths.changelog) + live(paths.history))
    assert erase_job(platform, [{"id": str(TARGET)}]).success  # again: nothing to do

    # The replaced files keep them until a VACUUM past the retention; after it, only the Delta
    # logs (statistics and small runs' key lists) may still name them (docs/limitations.md).
    warehouse = Path(platform.warehouse_root.uri)
    assert secrets_in(every_value_in(warehouse))
    vacuum(paths, retention_hours=0, enforce_retention_duration=False, current_table=True)
    for path in (p for p in warehouse.rglob("*") if p.is_file()):
        text = every_value_in(path.parent) if path.suffix == ".parquet" else path.read_text()
        if secrets_in(text):
            assert "_delta_log" in path.parts and path.suffix == ".json", path


def test_erase_key_refusals_write_nothing(spark, tmp_path, keyring, monkeypatch):
    platform = one_table_config(tmp_path, "primary_key: [id]")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [ev("INSERT", 1, H0 + timedelta(minutes=1), TARGET, name=NAME)],
    )
    assert materialize_with_checks(platform, "t", H0).success
    cases = [
        ([{"name": "x"}], "request", "names ['name']"),
        ([{"id": "not-a-number-7f3a"}], "request", "is not a int64"),
        ([{"id": str(TARGET)}], "  ", "needs a reason"),
        ([], "request", "name 1 to 1000 keys"),
    ]
    for keys, reason, message in cases:
        result = erase_job(platform, keys, reason)
        assert not result.success and message in failure_of(result), failure_of(result)
        assert "not-a-number-7f3a" not in failure_of(result)
    monkeypatch.delenv(KEYRING_ENV_VAR)
    result = erase_job(platform, [{"id": str(TARGET)}])
    assert not result.success and "hash_salt" in failure_of(result)
    assert not DeltaTable.is_deltatable(str(paths.erased_keys))
    assert NAME in repr(DeltaTable(str(paths.history)).to_pyarrow_table().to_pylist())


def test_a_table_with_erased_keys_is_not_read_without_the_salt(
    spark, tmp_path, keyring, monkeypatch
):
    platform = one_table_config(tmp_path, "primary_key: [id]")
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [ev("INSERT", 1, H0 + timedelta(minutes=1), TARGET, name=NAME)],
    )
    assert materialize_with_checks(platform, "t", H0).success
    assert erase_job(platform, [{"id": str(TARGET)}]).success
    monkeypatch.delenv(KEYRING_ENV_VAR)
    result = materialize_with_checks(platform, "t", H0)
    assert not result.success and "were erased" in failure_of(result)


def test_erase_key_on_a_keyless_table(spark, tmp_path, keyring):
    platform = one_table_config(tmp_path, "keyless: true\n    current_table: true")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [
            {
                "name": NAME,
                "cdc_operation_type": "INSERT",
                "cdc_change_seq": 1,
                "cdc_commit_timestamp": H0 + timedelta(minutes=1),
            },
            {
                "name": "b",
                "cdc_operation_type": "INSERT",
                "cdc_change_seq": 2,
                "cdc_commit_timestamp": H0 + timedelta(minutes=2),
            },
        ],
    )
    assert checks_pass(materialize_with_checks(platform, "t", H0))
    rows = DeltaTable(str(paths.history)).to_pyarrow_table().to_pylist()
    (row_id,) = [r["_fivetran_id"] for r in rows if r["name"] == NAME]
    result = erase_job(platform, [{"_fivetran_id": row_id}])
    assert result.success, failure_of(result)
    assert checks_pass(materialize_with_checks(platform, "t", H0))  # read again: not back
    for table in (paths.history, paths.changelog):
        live = repr(DeltaTable(str(table)).to_pyarrow_table().to_pylist())
        assert NAME not in live and "'b'" in live


def test_erase_key_by_a_hashed_key_columns_cleartext(spark, tmp_path, keyring):
    """A hashed key column holds hashes: the request may give the cleartext (a string) or the
    hash the table shows; both name the same key."""
    platform = one_table_config(tmp_path, "primary_key: [email]\n    hash_columns: [email]")
    paths = TablePaths.of(platform.warehouse_root, "t")
    rows = [
        ev("INSERT", i, H0 + timedelta(minutes=i), email, "email", name=name)
        for i, (email, name) in enumerate([("zq@example.com", NAME), ("b@x", "b"), ("c@x", "c")], 1)
    ]
    write_parquet_events(platform.landing_path, "t", H0, rows)
    assert checks_pass(materialize_with_checks(platform, "t", H0))
    history = DeltaTable(str(paths.history)).to_pyarrow_table().to_pylist()
    (c_hash,) = [r["email"] for r in history if r["name"] == "c"]
    result = erase_job(platform, [{"email": "zq@example.com"}, {"email": c_hash}])
    assert result.success, failure_of(result)
    assert checks_pass(materialize_with_checks(platform, "t", H0))
    names = {r["name"] for r in DeltaTable(str(paths.history)).to_pyarrow_table().to_pylist()}
    assert names == {"b"}


def test_a_key_widened_after_its_erasure_stays_out_and_a_rekey_is_refused(spark, tmp_path, keyring):
    """The ledger hashes a key in the types it had: a key column widened later (an integer id
    delivered as text) is cast back before it is hashed; a rekey, which would change every
    key's hash, is refused."""
    platform = one_table_config(tmp_path, "primary_key: [id]\n    widen_types: all")
    paths = TablePaths.of(platform.warehouse_root, "t")
    write_parquet_events(
        platform.landing_path,
        "t",
        H0,
        [
            ev("INSERT", 1, H0 + timedelta(minutes=1), TARGET, name=NAME),
            ev("INSERT", 2, H0 + timedelta(minutes=2), OTHER, name="b"),
        ],
    )
    assert checks_pass(materialize_with_checks(platform, "t", H0))
    assert erase_job(platform, [{"id": str(TARGET)}]).success
    write_parquet_events(
        platform.landing_path,
        "t",
        H1,
        [
            ev("UPDATE", 3, H1 + timedelta(minutes=1), str(TARGET), name=LATER_NAME),
            ev("INSERT", 4, H1 + timedelta(minutes=2), "x-1", name="c"),
        ],
    )
    assert checks_pass(materialize_with_checks(platform, "t", H1))
    live = repr(DeltaTable(str(paths.changelog)).to_pyarrow_table().to_pylist())
    assert "x-1" in live and not secrets_in(live)  # widened to text, and still kept out

    rekeyed = one_table_config(tmp_path, "primary_key: [id, name]\n    widen_types: all")
    refused = run_operator_job(rekeyed, "rekey_table", "rekey")
    assert not refused.success and "keys of this table were erased" in failure_of(refused)
