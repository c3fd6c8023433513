"""Building the SparkSession the platform needs, with its non-negotiable settings.

UTC everywhere (history timestamps must not shift with the host's zone), Parquet timestamps as
TIMESTAMP_MICROS (Spark's INT96 default is unreadable as a timestamp by some Delta readers), no
``_SUCCESS`` or Parquet summary (``_metadata``) files, and Python workers that run this very
interpreter so they can import ``cdc_platform``.

Security settings stand with them and cannot be overridden (docs/SECURITY.md): shuffle and
spill files are encrypted (``spark.io.encryption.enabled``: they hold decrypted rows), and so is
Spark's RPC traffic, which carries the I/O encryption keys (``spark.authenticate`` +
``spark.network.crypto.enabled``). In local mode the secret is generated per application; on
YARN and Kubernetes too; a standalone cluster needs ``spark.authenticate.secret`` set to its
shared secret. A local session binds to the loopback interface only.

Where Spark runs is the deployment's fact (``deployment.SparkDeployment``, from the
environment), and so is any other setting (``spark-defaults.conf`` in ``$SPARK_CONF_DIR``); a
run may only tune the few knobs of ``deployment.RUN_TUNABLE``. A Spark Connect session is
``connect``'s.

A warehouse on an object store (``storage.Location``) adds the Hadoop settings its storage
options map to (``spark.hadoop.fs.s3a.*`` for S3) and, for S3, the connector's jars
(``hadoop-aws`` and the AWS SDK bundle, fetched once by ``make jars``: ``lib/spark/jars.py``).
``delta_conf`` is what a session needs to use Delta's own JVM library on the tables.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shlex
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_platform.lib.errors import PlatformError
from cdc_platform.lib.spark import jars
from cdc_platform.lib.storage.stores import Location, spark_hadoop_conf

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

REQUIRED_CONF: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
    "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
    "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "spark.hadoop.parquet.summary.metadata.level": "NONE",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # The platform writes some expressions as SQL text with backticked names (``columns.quote``):
    # a backticked name must stay a name, never become a regular expression.
    "spark.sql.parser.quotedRegexColumnNames": "false",
    # Security: never overridable. Shuffle and spill files hold decrypted rows; the I/O
    # encryption keys travel over Spark's RPC, so it is authenticated and encrypted.
    "spark.io.encryption.enabled": "true",
    "spark.authenticate": "true",
    "spark.network.crypto.enabled": "true",
}

DEFAULT_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.adaptive.enabled": "true",
    # A merge's plan has many columns; Spark warns each time it shortens one for a log line.
    "spark.sql.debug.maxToStringFields": "1000",
    # Reading more than 32 files (a backfill's landing files, a change log or history of many
    # files) lists them in a Spark job of one task per file by default: 6 s for 720 local files
    # on 2 cores, 0.7 s in 16 tasks. 16 tasks still list an object store's files in parallel.
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "16",
    # A long-lived driver (the test session, a Spark Connect server, an in-process run
    # that applies a backfill) keeps the plan and metrics of every SQL execution, job and
    # stage for the UI by default (1000 each). With many-column plans that filled a 2 GiB
    # heap after ~11k stages, and aggregations then failed with AGGREGATE_OUT_OF_MEMORY.
    "spark.sql.ui.retainedExecutions": "20",
    "spark.ui.retainedJobs": "50",
    "spark.ui.retainedStages": "50",
    "spark.ui.retainedTasks": "5000",
    "spark.ui.dagGraph.retainedRootRDDs": "50",
}

# A local driver's heap when the deployment sets none: a share of the machine's memory, within
# these bounds (``default_driver_memory``).
DRIVER_MEMORY_SHARE = 6  # a sixth: the shipped dagster.yaml runs up to 4 runs at once
DRIVER_MEMORY_MIN_MB = 1024
DRIVER_MEMORY_MAX_MB = 8 * 1024


def default_driver_memory(env: Mapping[str, str] | None = None) -> str | None:
    """``spark.driver.memory`` for a local session whose deployment sets none: a sixth of the
    machine's memory (of the container's limit where that is lower), between 1 and 8 GiB.

    Why: the local driver *is* the executor, so its heap holds every task's rows, the cached
    frames and what a join builds, and Spark's default is 1 GiB whatever the machine has. A
    bulk hour (2M events over 1M keys) ran that out of memory, or spent minutes collecting
    garbage, on a machine with 23 GiB free. A sixth, because each run is a process with its own
    JVM and the shipped dagster.yaml runs up to four at once (4 GiB each on 24 GiB, what the
    bulk hour needs); the cap keeps a big host from handing one run a huge heap (more is the
    deployment's call).

    None when the deployment already says (``spark.driver.memory`` in the ``spark-defaults.conf``
    of ``$SPARK_CONF_DIR`` or ``$SPARK_HOME/conf``, ``$SPARK_DRIVER_MEMORY``, or
    ``--driver-memory`` in ``$PYSPARK_SUBMIT_ARGS``) or the memory cannot be read: Spark's own
    default then applies. A run's ``spark_config`` still wins over this (``deployment.RUN_TUNABLE``).
    Computed when a session is built, never at import."""
    env = os.environ if env is None else env
    if _deployment_sets_driver_memory(env):
        return None
    total = _machine_memory_bytes()
    if total is None:
        return None
    mb = total // DRIVER_MEMORY_SHARE // (1024 * 1024)
    return f"{max(DRIVER_MEMORY_MIN_MB, min(DRIVER_MEMORY_MAX_MB, mb))}m"


def _deployment_sets_driver_memory(env: Mapping[str, str]) -> bool:
    if env.get("SPARK_DRIVER_MEMORY"):
        return True
    submit = env.get("PYSPARK_SUBMIT_ARGS", "")
    if "--driver-memory" in submit or "spark.driver.memory" in submit:
        return True
    folders = [env.get("SPARK_CONF_DIR")]
    home = env.get("SPARK_HOME")
    if home:
        folders.append(os.path.join(home, "conf"))
    for folder in filter(None, folders):
        try:
            text = Path(folder, "spark-defaults.conf").read_text()
        except OSError:
            continue
        if any(re.match(r"\s*spark\.driver\.memory[\s=:]", line) for line in text.splitlines()):
            return True
    return False


def _machine_memory_bytes() -> int | None:
    """Physical memory, or the cgroup's memory limit where lower (a container)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total if total > 0 else None


# Spark's log settings: warnings and errors to stderr, minus the two start-up notices that hold
# for every local session (no native Hadoop library is needed for local files).
LOG4J2_PROPERTIES = Path(__file__).with_name("log4j2.properties")
LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class JavaMissingError(PlatformError, RuntimeError):
    """Spark needs a Java runtime; raised before anything else is attempted."""


def check_java() -> None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and os.path.exists(os.path.join(java_home, "bin", "java")):
        return
    if shutil.which("java") is None:
        raise JavaMissingError(
            "Java not found: install a Java 17 runtime (e.g. `apt-get install openjdk-17-jre-headless`) "
            "or set JAVA_HOME"
        )


def spark_conf(
    master: str, conf: Mapping[str, str] | None = None, storage: Iterable[Location] = ()
) -> dict[str, str]:
    """The effective configuration: defaults, then the Hadoop settings of the object stores in
    ``storage`` (environment references read now), then the caller's, then what correctness
    needs. The caller's conf wins over the derived settings (a cluster's own credentials)."""
    storage = list(storage)
    merged = {**DEFAULT_CONF, "spark.master": master}
    memory = default_driver_memory() if is_local(master) else None
    if memory:  # sized from this machine unless the deployment said (spark-defaults.conf)
        merged["spark.driver.memory"] = memory
    merged.update(spark_hadoop_conf(storage))
    merged.update(conf or {})
    if is_local(master) and any(location.scheme == "s3" for location in storage):
        # A cluster's classpath is the deployment's (its nodes, or its own connector).
        merged.update(jar_conf(master, ["s3"], merged))
    merged.update(REQUIRED_CONF)
    # Executors run $PYSPARK_PYTHON where set (a cluster's nodes keep Python elsewhere), else
    # this very interpreter, which has every package the platform needs.
    merged.setdefault("spark.pyspark.python", os.environ.get("PYSPARK_PYTHON") or sys.executable)
    merged.setdefault("spark.pyspark.driver.python", sys.executable)
    if "log4j" not in merged["spark.driver.extraJavaOptions"]:
        merged["spark.driver.extraJavaOptions"] += (
            f" -Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()}"
        )
    return merged


def jar_conf(
    master: str, jar_sets: Iterable[jars.JarSet], conf: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The settings that put the fetched jars of ``jar_sets`` on Spark's classpath (added to
    what ``conf`` already lists). A local session takes them on the driver's classpath: the
    JVM reads them in place, where ``spark.jars`` would copy 700 MB into every new session's
    work folder. Elsewhere ``spark.jars`` ships them to the executors."""
    conf = conf or {}
    files = [str(p) for p in jars.paths(jar_sets)]
    key, sep = (
        ("spark.driver.extraClassPath", os.pathsep) if is_local(master) else ("spark.jars", ",")
    )
    listed = [p for p in conf.get(key, "").split(sep) if p]
    return {key: sep.join([*listed, *(f for f in files if f not in listed)])}


DELTA_SQL_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def delta_conf(master: str = "local[2]") -> dict[str, str]:
    """What a session needs to read and maintain the tables with Delta's own JVM library
    (delta-spark: ``DESCRIBE HISTORY``, time travel, ``OPTIMIZE``, ``VACUUM``): its jars and its
    SQL extension and catalog. ``jars.JarsMissingError`` says what to run when the jars are
    not fetched. The platform's own session does not need them (docs/engines.md)."""
    return {**jar_conf(master, ["delta"]), **DELTA_SQL_CONF}


def is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def build_spark_session(
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    app_name: str = "cdc_platform",
    storage: Iterable[Location] = (),
) -> SparkSession:
    """Create (or reuse) the session; the import is here so that importing the package stays light.

    ``storage``: the object stores the session reads and writes (``spark_conf``)."""
    check_java()
    # PySpark takes the workers' interpreter from this variable when the context starts.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if is_local(master):
        # Read by the JVM at launch: a local session listens on the loopback interface only.
        os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    from pyspark.sql import SparkSession

    merged = spark_conf(master, conf, storage)
    hidden = {k: v for k, v in merged.items() if SECRET_CONF.search(k)}
    builder = SparkSession.builder.appName(app_name)
    for key, value in merged.items():
        if key not in hidden:
            builder = builder.config(key, value)
    with _secret_properties(hidden):
        session = builder.getOrCreate()
    quiet_logs(session)
    if not is_local(master):
        ship_package(session)
    return session


# Spark's own redaction pattern: settings whose names say they hold a secret.
SECRET_CONF = re.compile(r"(?i)secret|password|token|access[.]?key")


@contextmanager
def _secret_properties(hidden: Mapping[str, str]) -> Iterator[None]:
    """While a JVM starts, hand it the secret settings in a properties file only this user can
    read (deleted once it has started): pyspark puts builder settings on the spark-submit and
    java command lines, which every local user can read (``ps``). ``--load-spark-defaults``
    keeps the deployment's ``spark-defaults.conf`` loaded as well."""
    if not hidden:
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="cdc-spark-"))  # mode 700
    props = folder / "secret.properties"
    fd = os.open(props, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(properties_text(hidden))
    before = os.environ.get("PYSPARK_SUBMIT_ARGS")
    os.environ["PYSPARK_SUBMIT_ARGS"] = (
        f"--properties-file {shlex.quote(str(props))} --load-spark-defaults pyspark-shell"
    )
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYSPARK_SUBMIT_ARGS", None)
        else:
            os.environ["PYSPARK_SUBMIT_ARGS"] = before
        shutil.rmtree(folder, ignore_errors=True)


def properties_text(settings: Mapping[str, str]) -> str:
    """``settings`` as the text of a Java properties file (Spark's ``--properties-file``), each
    key and value read back as given."""
    return "".join(
        f"{_escape_property_key(k)}={_escape_property(v)}\n" for k, v in settings.items()
    )


def _escape_property(value: str) -> str:
    """A value as Java's Properties reads it back (backslashes, line breaks, leading space)."""
    out = value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return "\\" + out if out[:1].isspace() else out


def _escape_property_key(key: str) -> str:
    """A key as Java's Properties reads it back: what would end it (``=``, ``:``, white space)
    or start a comment (``#``, ``!``) escaped."""
    out = _escape_property(key).removeprefix("\\")
    return re.sub(r"([=:#!\s])", lambda m: "\\" + {"\t": "t", "\f": "f"}.get(m[1], m[1]), out)


def package_zip(folder: Path | None = None) -> Path:
    """This installed ``cdc_platform`` package as a zip, named by its content's hash (built
    once per version of the code). Executors import the platform from it, never from their
    working directory or whatever their Python path happens to hold.

    Kept in a folder only this user can write (``private_temp_folder``): a zip reused from a
    name in the shared temporary folder could be one another local user put there, and its
    code would run on every executor."""
    import zipfile

    root = Path(__file__).resolve().parents[2]  # the cdc_platform package folder
    sources = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".properties"}
    )
    digest = hashlib.sha256()
    for p in sources:
        digest.update(str(p.relative_to(root.parent)).encode() + b"\0" + p.read_bytes())
    out = (folder or private_temp_folder()) / f"cdc_platform-{digest.hexdigest()[:16]}.zip"
    if not out.exists():
        partial = out.with_suffix(f".{os.getpid()}.tmp")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as z:
            for p in sources:
                z.write(p, p.relative_to(root.parent).as_posix())
        partial.replace(out)  # atomic: a concurrent run never ships a half-written zip
    return out


def private_temp_folder() -> Path:
    """``<temp>/cdc_platform-<uid>``, created with mode 700: reused only while it is a real
    folder (no symlink) of this user's, of mode 700, so nobody else can have put a file in it.
    Else (another user took the name, or its mode let others in) a new private folder of this
    process, removed when it exits."""
    folder = Path(tempfile.gettempdir()) / f"cdc_platform-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        if (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid()
            and stat.S_IMODE(st.st_mode) == 0o700
        ):
            return folder
    except OSError:
        pass
    own = Path(tempfile.mkdtemp(prefix="cdc_platform-"))  # mode 700, a new name
    atexit.register(shutil.rmtree, own, True)
    return own


def ship_package(session: SparkSession) -> None:
    """Send the platform's code to a cluster's executors (``addPyFile``: on their Python path
    ahead of site-packages). Not needed in local mode, where tasks run this interpreter."""
    zip_path = package_zip()
    if any(Path(f).name == zip_path.name for f in session.sparkContext.listFiles):
        return  # a reused session already has this version
    session.sparkContext.addPyFile(str(zip_path))


# -- Spark Connect ---------------------------------------------------------------------------------

# Column names are matched exactly, as the platform quotes and compares them (``columns.col``).
READ_CONF: dict[str, str] = {"spark.sql.caseSensitive": "true"}


def is_connect(session: SparkSession) -> bool:
    """True for a Spark Connect session (no SparkContext, no RDDs, no JVM in this process)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def quiet_logs(session: SparkSession, level: str = "WARN") -> None:
    """Set the driver's log level where this process owns the driver (not over Connect)."""
    if not is_connect(session):
        session.sparkContext.setLogLevel(level)


ADAPTIVE = "spark.sql.adaptive.enabled"
BROADCAST_THRESHOLD = "spark.sql.autoBroadcastJoinThreshold"
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
WHOLE_STAGE_CODEGEN = "spark.sql.codegen.wholeStage"
# Which projections, predicates and orderings Spark compiles (``FALLBACK``, the default) or
# evaluates interpreted (``NO_CODEGEN``). Spark marks it internal; see ``interpreted``.
CODEGEN_FACTORY_MODE = "spark.sql.codegen.factoryMode"
# What ``interpreted`` sets: no generated code at all (a session over few rows may start so).
INTERPRETED_CONF = {WHOLE_STAGE_CODEGEN: "false", CODEGEN_FACTORY_MODE: "NO_CODEGEN"}


@contextmanager
def persisted(df: DataFrame) -> Iterator[DataFrame]:
    """``df`` kept by the executors (memory, spilling to disk) for the block's Spark jobs."""
    from pyspark import StorageLevel

    df = df.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        yield df
    finally:
        df.unpersist()


@contextmanager
def interpreted(spark: SparkSession) -> Iterator[None]:
    """Code generation off for the block, for queries over a few thousand rows: compiling a
    plan's generated code then costs more than running it interpreted. Whole-stage code (a
    small hour's fold: about 0.6 s of 1.9 s), and the projections, predicates and orderings
    each operator still compiles without it (``NO_CODEGEN``: a small hour 7.8 -> 5.6 s, its
    checks 3.2 -> 1.9 s). The results are the same either way: Spark runs its own expression
    tests in both modes. ``NO_CODEGEN`` is a setting Spark calls internal: it has no public
    switch for this."""
    with conf_restored(spark, *INTERPRETED_CONF):
        for key, value in INTERPRETED_CONF.items():
            spark.conf.set(key, value)
        yield


@contextmanager
def conf_restored(spark: SparkSession, *keys: str) -> Iterator[None]:
    """The session's ``keys`` settings as they were, whatever the run or the checks set
    (``pipeline.plan_whole_if_small``, ``invariants.run_checks``)."""
    before = {k: spark.conf.get(k, None) for k in keys}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)
