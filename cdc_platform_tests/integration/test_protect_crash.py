"""``protect_columns`` killed between its commits, a VACUUM in between, then run again: every
hashed cell is hash(x) exactly once (docs/history-table.md, "Hashed and blocked columns")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from deltalake import DeltaTable

from cdc_platform.defs.resources import KEYRING_ENV_VAR
from cdc_platform.lib.history.merge import FAULT_ENV
from cdc_platform.lib.history.protected_columns import PROTECTING_PROPERTY
from cdc_platform.lib.operations.maintenance import vacuum
from cdc_platform.lib.operations.protect import AFTER_REWRITE_FAULT, REWRITTEN_TO
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events
from cdc_platform_tests.integration.test_maintenance import crashed_write
from cdc_platform_tests.integration.test_pii import (
    H0,
    config_file,
    failure_of,
    hashed,
    materialize_asset,
    protect_job,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EMAILS = ("alice@example.com", "bob@example.com")


def _env(tmp_path: Path, keyring: Path, **extra: str) -> dict[str, str]:
    """A process of its own, as an operator's shell or the daemon would start it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    return env | {
        "CDC_PLATFORM_CONFIG": str(tmp_path / "cdc_platform.yaml"),
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
        KEYRING_ENV_VAR: str(keyring),
        **extra,
    }


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
    )


def test_protect_columns_killed_after_its_rewrite_then_vacuumed_hashes_each_cell_once(
    spark, tmp_path, keyring
):
    clear = config_file(tmp_path, protect="")
    paths = TablePaths.of(clear.warehouse_root, "t")
    write_parquet_events(
        clear.landing_path,
        "t",
        H0,
        [
            ev("INSERT", i + 1, H0 + timedelta(minutes=i + 1), i + 1, email=e, name="n")
            for i, e in enumerate(EMAILS)
        ],
    )
    assert materialize_asset(clear, H0).success
    crashed_write(paths.changelog)  # an old run's leftover: the VACUUM has a file to remove
    protected = config_file(tmp_path, protect="    hash_columns: [email]\n")

    # The job through the Dagster CLI, killed between the change log's rewrite and the commit
    # that records the lists.
    run_config = tmp_path / "protect.yaml"
    run_config.write_text("ops:\n  protect:\n    config:\n      table: t\n")
    dagster = str(Path(sys.executable).parent / "dagster")
    job = [dagster, "job", "execute", "-m", "cdc_platform.definitions", "-j", "protect_columns"]
    killed = _run(
        [*job, "-c", str(run_config)], _env(tmp_path, keyring, **{FAULT_ENV: AFTER_REWRITE_FAULT})
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    log = DeltaTable(str(paths.changelog))
    assert log.history(limit=1)[0].get(REWRITTEN_TO)  # the rewrite is committed ...
    assert json.loads(log.metadata().configuration[PROTECTING_PROPERTY]) is not None  # ... alone
    rewritten_at = log.version()

    # The command-line VACUUM leaves the table alone, naming it and the job that finishes it.
    cli = _run(
        [sys.executable, "-m", "cdc_platform.lib.operations.maintenance"], _env(tmp_path, keyring)
    )
    assert cli.returncode != 0, cli.stdout + cli.stderr[-3000:]
    assert "t: " in cli.stderr and "Launch protect_columns for the table again" in cli.stderr
    assert DeltaTable(str(paths.changelog)).version() == rewritten_at

    # A VACUUM that knows nothing of the run (another tool) commits after the rewrite anyway.
    assert vacuum(paths)
    assert DeltaTable(str(paths.changelog)).version() > rewritten_at

    result = protect_job(protected)
    assert result.success, failure_of(result)
    want = {hashed(e) for e in EMAILS}
    for table in (paths.changelog, paths.history, paths.current):
        if DeltaTable.is_deltatable(str(table)):
            cells = DeltaTable(str(table)).to_pyarrow_table()["email"].to_pylist()
            assert set(cells) == want, table
    after = materialize_asset(protected, H0)
    assert after.success and all(e.passed for e in after.get_asset_check_evaluations())
