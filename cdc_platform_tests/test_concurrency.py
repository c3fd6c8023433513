"""Two writers on one table at once: both finish, and the table is what one writer would make.

Dagster keeps one writer per table (a pool of limit 1); these tests cover the second line of
defence: delta-rs refuses a history commit built on a stale snapshot and ``apply_pending``
recomputes against the winner and retries (a bounded number of times).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from cdc_platform.defs.factory import build_table_definitions, pool_name
from cdc_platform.lib import invariants, merge
from cdc_platform.lib.config import REPO_ROOT, PlatformConfig, TableConfig
from cdc_platform.lib.merge import COMMIT_ATTEMPTS
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize
from cdc_platform.lib.warehouse import TablePaths
from cdc_platform_tests.helpers import history_rows, write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)
T0, T1, T2 = (h + timedelta(minutes=5) for h in (H0, H1, H2))
NAME = "conc"
TABLE = TableConfig(name=NAME, primary_key=("id",), start=H0)


def ev(op: str, seq: int, ts: datetime, id_: int, v: int | None = None) -> dict[str, Any]:
    return {
        "id": id_,
        "v": v,
        "cdc_operation_type": op,
        "cdc_change_seq": seq,
        "cdc_commit_timestamp": ts,
    }


def write_landing(landing: Path) -> None:
    """Hours 1 and 2 both change keys 1, 2 and 3; hour 2 also holds late events."""
    write_parquet_events(
        landing, NAME, H0, [ev("INSERT", 1, T0, 1, 10), ev("INSERT", 2, T0, 2, 20)]
    )
    write_parquet_events(landing, NAME, H0, [ev("INSERT", 3, T0, 3, 30)])
    write_parquet_events(
        landing,
        NAME,
        H1,
        [ev("UPDATE", 5, T1, 1, 11), ev("DELETE", 6, T1, 2), ev("UPDATE", 7, T1, 3, 31)],
    )
    write_parquet_events(
        landing,
        NAME,
        H2,
        [
            ev("UPDATE", 4, T0 + timedelta(minutes=30), 1, 15),  # late: committed before hour 1
            ev("UPDATE", 8, T2, 1, 12),
            ev("INSERT", 9, T2, 2, 21),  # re-insert after hour 1's delete
            ev("UPDATE", 10, T1 - timedelta(minutes=10), 3, 29),  # late, before hour 1's update
        ],
    )


@pytest.fixture(scope="module")
def lakes(spark, tmp_path_factory) -> dict[str, Path]:
    """``base``: hour 0 materialized; ``reference``: all three hours in one materialization."""
    base = tmp_path_factory.mktemp("conc_base")
    write_landing(base / "landing")
    materialize(spark, TABLE, base / "landing", base / "warehouse", [H0])
    reference = tmp_path_factory.mktemp("conc_reference")
    shutil.copytree(base / "landing", reference / "landing")
    materialize(spark, TABLE, reference / "landing", reference / "warehouse", [H0, H1, H2])
    return {"base": base, "reference": reference}


def run_together(
    spark, root: Path, calls: Sequence[list[datetime]]
) -> list[MaterializationOutcome]:
    """Start one thread per call, released at the same moment; re-raise any thread's error."""
    barrier = threading.Barrier(len(calls))
    results: list[MaterializationOutcome | None] = [None] * len(calls)
    errors: list[BaseException] = []

    def work(i: int, hours: list[datetime]) -> None:
        try:
            barrier.wait(timeout=60)
            results[i] = materialize(spark, TABLE, root / "landing", root / "warehouse", hours)
        except BaseException as exc:  # re-raised by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, h)) for i, h in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a materialization did not finish"
    if errors:
        raise errors[0]
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def assert_same_table(root: Path, reference: Path) -> None:
    got = history_rows(TablePaths.of(root / "warehouse", NAME).history)
    want = history_rows(TablePaths.of(reference / "warehouse", NAME).history)
    assert got == want
    assert len(want) == 9  # the reference really has history to compare


def copy_of(lakes: dict[str, Path], tmp_path: Path) -> Path:
    dest = tmp_path / "lake"
    shutil.copytree(lakes["base"], dest)
    return dest


def test_two_hours_touching_the_same_keys_at_once(spark, lakes, tmp_path: Path) -> None:
    root = copy_of(lakes, tmp_path)
    results = run_together(spark, root, [[H1], [H2]])
    attempts = [r.merge.attempts for r in results]
    assert all(1 <= a <= COMMIT_ATTEMPTS for a in attempts)
    print(f"commit attempts per writer: {attempts}")
    assert_same_table(root, lakes["reference"])
    outcomes = invariants.run_checks(spark, TablePaths.of(root / "warehouse", NAME), ("id",))
    assert [o.name for o in outcomes if not o.passed] == []


def test_the_same_hours_twice_at_once(spark, lakes, tmp_path: Path) -> None:
    root = copy_of(lakes, tmp_path)
    results = run_together(spark, root, [[H1, H2], [H1, H2]])
    print(f"commit attempts per writer: {[r.merge.attempts for r in results]}")
    assert_same_table(root, lakes["reference"])
    # Re-running afterwards changes nothing (the watermark covers both writers' events).
    again = materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    assert again.events_new == 0 and again.merge.keys_affected == 0
    assert_same_table(root, lakes["reference"])

    # The change log holds each (key, seq) once: a writer whose change-log commit loses the race
    # dedupes against the winner's events again before it retries.
    log = DeltaTable(str(TablePaths.of(root / "warehouse", NAME).changelog)).to_pyarrow_table()
    counts = Counter(zip(log["id"].to_pylist(), log["cdc_change_seq"].to_pylist(), strict=True))
    assert sorted(k for k, n in counts.items() if n > 1) == []


def test_a_lost_commit_race_is_recomputed_and_retried(
    spark, lakes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic: another writer commits hours 1 and 2 just before this one commits hour 1."""
    root = copy_of(lakes, tmp_path)
    real_fault_point = merge.fault_point
    rival: list[MaterializationOutcome] = []
    started: list[str] = []

    def rival_commits_first(name: str) -> None:
        real_fault_point(name)
        if name == "before_history_commit" and not started:
            started.append(name)  # before the call: the rival passes this point too
            rival.append(materialize(spark, TABLE, root / "landing", root / "warehouse", [H2]))

    monkeypatch.setattr(merge, "fault_point", rival_commits_first)
    result = materialize(spark, TABLE, root / "landing", root / "warehouse", [H1])
    assert rival[0].merge.attempts == 1
    assert result.merge.attempts == 2
    # The retry found the rival's commit already covering this run's events: nothing to redo.
    assert result.merge.keys_affected == 0
    assert result.merge.history_version == rival[0].merge.history_version
    assert_same_table(root, lakes["reference"])
    assert_no_uncommitted_files(TablePaths.of(root / "warehouse", NAME).history)


def test_retries_are_bounded_and_leave_the_table_intact(
    spark, lakes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_of(lakes, tmp_path)
    history = TablePaths.of(root / "warehouse", NAME).history
    before = history_rows(history, drop=())
    version = DeltaTable(str(history)).version()
    real_fault_point = merge.fault_point
    lost: list[str] = []

    def always_lose(name: str) -> None:
        real_fault_point(name)
        if name == "before_history_commit":
            lost.append(name)
            raise CommitFailedError("simulated: a concurrent commit won")

    monkeypatch.setattr(merge, "fault_point", always_lose)
    with pytest.raises(RuntimeError, match=f"lost {COMMIT_ATTEMPTS} races in a row"):
        materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    assert len(lost) == COMMIT_ATTEMPTS
    assert DeltaTable(str(history)).version() == version
    assert history_rows(history, drop=()) == before
    assert_no_uncommitted_files(history)

    # The events were logged before the merge gave up: the next run applies them.
    monkeypatch.setattr(merge, "fault_point", real_fault_point)
    again = materialize(spark, TABLE, root / "landing", root / "warehouse", [H1, H2])
    assert again.events_new == 0 and again.merge.keys_affected == 3
    assert_same_table(root, lakes["reference"])


def assert_no_uncommitted_files(table_path: Path) -> None:
    """Every Parquet file under the table is in the snapshot or was removed by a commit."""
    dt = DeltaTable(str(table_path))
    on_disk = {
        str(p.relative_to(table_path))
        for p in Path(table_path).rglob("*.parquet")
        if "_delta_log" not in p.parts
    }
    ever_added = {
        a["add"]["path"]
        for v in range(dt.version() + 1)
        for a in map(json.loads, (table_path / "_delta_log" / f"{v:020d}.json").open())
        if "add" in a
    }
    assert on_disk <= ever_added, on_disk - ever_added


def test_one_writer_per_table_is_configured() -> None:
    instance_yaml = yaml.safe_load((REPO_ROOT / "dagster.yaml").read_text())
    assert instance_yaml["concurrency"]["pools"]["default_limit"] == 1
    platform = PlatformConfig(Path("/nonexistent/l"), Path("/nonexistent/w"), (TABLE,))
    defs = build_table_definitions(platform, TABLE)
    assert pool_name(TABLE) == f"cdc_table_{NAME}"
    assert defs.asset.op.pool == f"cdc_table_{NAME}"
    assert defs.asset.op.pools == {f"cdc_table_{NAME}"}
