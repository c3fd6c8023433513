"""`make demo`, the README's first command: it exits 0 every time and prints no warnings.

The demo runs in a subprocess on temp folders (config, landing, warehouse, Dagster instance,
keyring), never on the repo's ``data/`` or ``.dagster_home/``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.fs
import pytest
from deltalake import DeltaTable, write_deltalake

from cdc_platform.demo.run import history_summary
from cdc_platform.lib.config import REPO_ROOT
from cdc_platform.lib.history import invariants
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.ledgers.quarantine import SCHEMA as QUARANTINE_SCHEMA

# Any line a library prints to warn: Python warnings (BetaWarning, FutureWarning, ...), log4j's
# "WARN", the JVM's "WARNING:".
WARNING_LINE = re.compile(r"warn", re.IGNORECASE)


def demo_env(root: Path) -> dict[str, str]:
    shutil.copy(REPO_ROOT / "cdc_platform.yaml", root / "cdc_platform.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "DAGSTER_"))}
    env.update(
        CDC_PLATFORM_CONFIG=str(root / "cdc_platform.yaml"),
        CDC_KEYRING=str(root / "keyring.json"),
        DAGSTER_HOME=str(root / "dagster_home"),
        PYTHONPATH=str(REPO_ROOT),
    )
    return env


def run_demo(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_platform.demo.run"],
        cwd=root,
        env=demo_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )


# The JVM's own notice, printed before any configuration applies: Spark 4's launcher always
# starts the driver with `--add-modules=jdk.incubator.vector` (JavaModuleOptions) and Java then
# prints this line unconditionally. Nothing in Spark or Java configures it away.
JVM_INCUBATOR_NOTICE = "WARNING: Using incubator modules: jdk.incubator.vector"


def unexpected_warnings(output: str) -> list[str]:
    """Every warning line but the JVM's notice."""
    return [
        line
        for line in output.splitlines()
        if WARNING_LINE.search(line) and line.strip() != JVM_INCUBATOR_NOTICE
    ]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("demo")
    return root, run_demo(root)


def test_demo_exits_0_with_a_summary(demo: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, proc = demo
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output}"
    assert "terminate called" not in output
    n = len(invariants.CHECK_NAMES)
    summary = [line.split()[0] for line in proc.stdout.splitlines() if f"{n}/{n} passed" in line]
    assert summary == ["customers", "orders", "payments"], output
    assert (root / "data" / "warehouse" / "orders" / "_delta_log").is_dir()
    assert re.search(r"^orders_daily 2024-01-01: \d+ live orders, total [\d,.]+", proc.stdout, re.M)
    assert (root / "dagster_home" / "dagster.yaml").is_file()


def test_demo_writes_no_parquet_summary_or_marker_files(
    demo: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, _ = demo
    names = {p.name for p in (root / "data" / "warehouse").rglob("*")}
    assert not names & {"_metadata", "_common_metadata", "_SUCCESS"}


def test_demo_prints_no_warnings(demo: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """No Python warning, no log4j WARN: the user sees the summary, not library chatter."""
    _, proc = demo
    lines = unexpected_warnings(proc.stdout + proc.stderr)
    assert not lines, "\n".join(lines)


def test_demo_prints_no_dagster_beta_warning(
    demo: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, proc = demo
    assert "BetaWarning" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_demo_three_times_in_a_row(tmp_path: Path) -> None:
    """`make demo` is repeatable: three runs from fresh folders each exit 0, with no warning."""
    for i in range(3):
        root = tmp_path / f"run{i}"
        root.mkdir()
        proc = run_demo(root)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert not unexpected_warnings(proc.stdout + proc.stderr)


# The demo's last step reads Delta tables and the interpreter exits right after. Reading through
# deltalake's Python file-system handler (``DeltaTable.to_pyarrow_table``) lets Arrow's I/O
# threads release Python-owned buffers after the read returned; one that does so during
# interpreter exit is ended by CPython inside Arrow's C++ code and the process aborts with 134
# ("terminate called without an active exception"; the demo's last step alone: 5 of 30 runs).
# Whether a run aborts depends on timing, so the test asserts the cause is gone: the platform's
# readers never hand Arrow a Python file system.


def test_table_reads_never_go_through_a_python_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    history, quarantined = tmp_path / "history", tmp_path / "quarantine"
    for part in range(3):
        rows = [{"id": part * 10 + i, "_fivetran_active": i % 2 == 0} for i in range(10)]
        write_deltalake(str(history), pa.Table.from_pylist(rows), mode="append")
    entry = {
        "file": "t/year=2024/month=01/day=01/hour=00/a.parquet",
        "partition": "2024-01-01-00:00",
        "reason": "not a Parquet file",
        "row": None,
        "bad_rows": 0,
        "detected_at": datetime(2024, 1, 1, tzinfo=UTC),
    }
    write_deltalake(
        str(quarantined), pa.Table.from_pylist([entry], schema=QUARANTINE_SCHEMA), mode="append"
    )

    def python_file_system(*args: object, **kwargs: object) -> None:
        raise AssertionError("a read went through a Python file-system handler")

    monkeypatch.setattr(pyarrow.fs, "PyFileSystem", python_file_system)
    with pytest.raises(AssertionError):  # the guard works: deltalake's own reader trips it
        DeltaTable(str(history)).to_pyarrow_table()

    assert history_summary(history) == (30, 15, 2)
    assert [q.reason for q in quarantine.current(quarantined)] == ["not a Parquet file"]
