"""A class-data-sharing (CDS) archive for the Spark JVMs the suite starts, and the JVM options
that use it.

Why: every subprocess test (the Dagster CLI, the daemon's runs, the demo, the deployment) starts
Spark's JVM cold: on the 2-core CI machine 9-10 s to a session and 4 s more to its first job,
most of it loading and verifying classes. A dynamic CDS archive of the classes one small
materialization loads maps them in at start (5 s, then 2 s); C1 alone
(``-XX:TieredStopAtLevel=1``) cuts the start further and, measured on an in-process test file,
costs nothing on the suite's tiny data. This is the suite's own JVM setting, handed to every JVM
through ``JAVA_TOOL_OPTIONS`` (conftest.py); the platform's sessions are unchanged.

The archive is built once per JDK, pyspark and jar set (its name carries their hash), under
``.jars/jvm/``, by a warm-up of the platform's own session (the classpath of the CLI's runs). A
JVM whose classpath differs (a session with Delta's or S3's jars, a cluster, a Connect server)
finds the archive does not match and starts as it would without it, silently
(``-Xlog:cds=off``). A failed build leaves no archive, and the suite runs without one.

``python -m cdc_platform_tests.jvm_startup ARCHIVE`` is the warm-up itself."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCHIVE_DIR = REPO_ROOT / ".jars" / "jvm"
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
WARM_UP_TIMEOUT_S = 600


def _key() -> str:
    """What the archive is valid for: the JDK, pyspark and the jars on its classpath."""
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=True)
    jar_dir = Path(pyspark.__file__).parent / "jars"
    jars = sorted(f"{p.name}:{p.stat().st_size}" for p in jar_dir.glob("*.jar"))
    text = "\n".join([java.stderr, pyspark.__version__, *jars])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_archive() -> Path | None:
    """The archive for this JDK and pyspark, built now if missing; None if it cannot be built."""
    try:
        path = ARCHIVE_DIR / f"spark-{_key()}.jsa"
    except (OSError, subprocess.CalledProcessError):
        return None
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
    try:
        subprocess.run(
            [sys.executable, "-m", "cdc_platform_tests.jvm_startup", str(partial)],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=WARM_UP_TIMEOUT_S,
            check=True,
        )
        if not partial.is_file():
            return None
        os.replace(partial, path)  # whole or not at all: a JVM never maps a half-written one
        return path
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        partial.unlink(missing_ok=True)


def java_options(archive: Path | None) -> str:
    """The options every JVM of the suite starts with."""
    shared = f"-XX:SharedArchiveFile={archive} " if archive else ""
    return f"{shared}-XX:TieredStopAtLevel=1 {QUIET}"


def _warm_up(archive: Path) -> None:
    """One small hour materialized and checked in the platform's own session; the JVM writes
    the classes it loaded to ``archive`` as it exits."""
    from cdc_platform.lib.config import load_config
    from cdc_platform.lib.history import invariants
    from cdc_platform.lib.pipeline import materialize
    from cdc_platform.lib.spark.session import build_spark_session
    from cdc_platform.lib.storage.warehouse import TablePaths
    from cdc_platform_tests.helpers import event, write_parquet_events

    spark = build_spark_session(
        "local[2]",
        {"spark.driver.defaultJavaOptions": f"-XX:ArchiveClassesAtExit={archive} {QUIET}"},
    )
    with tempfile.TemporaryDirectory() as root:
        config = Path(root, "cdc_platform.yaml")
        config.write_text(
            "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
            '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
        )
        platform = load_config(config)
        hour = datetime(2024, 1, 1, 5, tzinfo=UTC)
        rows = [
            event("INSERT", 1, hour, 1, status="new"),
            event("UPDATE", 2, hour, 1, status="paid"),
        ]
        write_parquet_events(Path(root, "landing"), "orders", hour, rows)
        table = platform.table("orders")
        materialize(spark, table, platform.landing_path, platform.warehouse_root, [hour])
        paths = TablePaths.of(platform.warehouse_root, "orders")
        invariants.run_checks(spark, paths, table.primary_key or ())
        spark.createDataFrame([(1, "a")], "id long, s string").toArrow()
    # The JVM writes the archive only as it exits: close the gateway's stdin and wait.
    process = getattr(spark.sparkContext._gateway, "proc", None)
    spark.stop()
    if process is not None:
        process.stdin.close()
        process.wait(timeout=WARM_UP_TIMEOUT_S)


if __name__ == "__main__":
    _warm_up(Path(sys.argv[1]))
