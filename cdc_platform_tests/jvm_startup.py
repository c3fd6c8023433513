"""A class-data-sharing (CDS) archive for the Spark JVMs the suite starts, and the JVM options
that use it.

Why: every subprocess test (the Dagster CLI, the daemon's runs, the demo) starts Spark's JVM
cold: on the 2-core CI machine 9-10 s to a session and 4 s more to its first job, most of it
loading and verifying classes. A dynamic CDS archive of the classes one small materialization
loads maps them in at start (5 s, then 2 s); C1 alone (``-XX:TieredStopAtLevel=1``) cuts the
start further. This is the suite's own JVM setting, handed to every JVM it starts through
``JAVA_TOOL_OPTIONS`` (conftest.py), but for the workers' shared sessions, which keep C2
(``full_jit``); the platform's sessions are unchanged.

The archive is built once per JDK, pyspark and jar set (its name carries their hash), under
``.jars/jvm/``, by a warm-up of the platform's own session (the classpath of the CLI's runs). A
JVM whose classpath differs (a session with Delta's or S3's jars, a cluster, a Connect server)
finds the archive does not match and starts without it, silently (``-Xlog:cds*=off``), still
with C1 alone. A failed build leaves no archive, says why, and the suite runs without one.

``python -m cdc_platform_tests.jvm_startup ARCHIVE`` is the warm-up itself."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from cdc_platform.lib.config import REPO_ROOT
from cdc_platform.lib.spark.jars import DEFAULT_JARS_DIR

ARCHIVE_DIR = DEFAULT_JARS_DIR / "jvm"
QUIET = "-Xlog:cds*=off"  # every cds tag set: a JVM the archive does not fit says nothing
C1_ONLY = "-XX:TieredStopAtLevel=1"
WARM_UP_TIMEOUT_S = 600


def _java() -> str:
    """The java Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else "java"


def _key() -> str:
    """What the archive is valid for: the JDK, pyspark and the jars on its classpath (the JVM
    itself refuses an archive whose jars changed in size or time; so does the key)."""
    import pyspark

    java = subprocess.run([_java(), "-version"], capture_output=True, text=True, check=True)
    jar_dir = Path(pyspark.__file__).parent / "jars"
    jars = sorted(
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in jar_dir.glob("*.jar")
    )
    text = "\n".join([shutil.which(_java()) or _java(), java.stderr, pyspark.__version__, *jars])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _private(path: Path) -> bool:
    """Every JVM of the suite maps the archive: nobody but its owner may write it or its folder."""
    return all(not p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH) for p in (path.parent, path))


def ensure_archive() -> Path | None:
    """The archive for this JDK and pyspark, built now if missing; None if it cannot be built
    (the suite then runs without one)."""
    try:
        path = ARCHIVE_DIR / f"spark-{_key()}.jsa"
        if any(c.isspace() for c in str(path)):
            return None  # JAVA_TOOL_OPTIONS is split on whitespace
        if not path.is_file():
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            _build(path)
        return path if path.is_file() and _private(path) else None
    except (OSError, subprocess.SubprocessError) as e:
        print(f"jvm_startup: the suite's JVMs start without an archive: {e}", file=sys.stderr)
        return None


def _build(path: Path) -> None:
    print(f"jvm_startup: building {path} (once, about a minute)", file=sys.stderr)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_TOOL_OPTIONS"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cdc_platform_tests.jvm_startup", str(partial)],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=WARM_UP_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"the warm-up failed: {done.stderr[-2000:]}")
        os.replace(partial, path)  # whole or not at all: a JVM never maps a half-written one
    finally:
        partial.unlink(missing_ok=True)


def java_options(archive: Path | None) -> str:
    """The options every JVM of the suite starts with."""
    shared = f"-XX:SharedArchiveFile={archive} " if archive else ""
    return f"{shared}{C1_ONLY} {QUIET}"


@contextmanager
def full_jit() -> Iterator[None]:
    """Start a long-lived JVM (a test worker's shared session) with both JIT compilers: C1 alone
    starts faster, but the shared session plans and runs queries for the whole run, where C2's
    code pays back."""
    options = os.environ.get("JAVA_TOOL_OPTIONS")
    if options is not None:
        os.environ["JAVA_TOOL_OPTIONS"] = " ".join(o for o in options.split() if o != C1_ONLY)
    try:
        yield
    finally:
        if options is not None:
            os.environ["JAVA_TOOL_OPTIONS"] = options


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
