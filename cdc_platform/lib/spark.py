"""Building the SparkSession the platform needs, with its non-negotiable settings.

UTC everywhere (history timestamps must not shift with the host's zone), Parquet timestamps as
TIMESTAMP_MICROS (Spark's INT96 default is unreadable as a timestamp by some Delta readers), no
``_SUCCESS`` or Parquet summary (``_metadata``) files, and Python workers that run this very
interpreter so they can import ``cdc_platform``. Everything else (master, memory, cluster
settings) is the caller's choice.

Security defaults (the caller may override them): shuffle and spill files are encrypted
(``spark.io.encryption.enabled``: they hold decrypted rows), and so is Spark's RPC traffic,
which carries the I/O encryption keys (``spark.authenticate`` + ``spark.network.crypto.enabled``).
In local mode the secret is generated per application; on YARN and Kubernetes too; a standalone
cluster needs ``spark.authenticate.secret`` set to its shared secret. A local session binds to
the loopback interface only: no other host takes part, so none needs to reach it.

A warehouse on an object store (``storage.Location``) adds the Hadoop settings its storage
options map to (``spark.hadoop.fs.s3a.*`` for S3); reading and writing ``s3a://`` then needs only
the connector (``hadoop-aws`` and the AWS SDK bundle) on Spark's classpath.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_platform.lib.storage import Location, spark_hadoop_conf

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

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
}

DEFAULT_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.adaptive.enabled": "true",
    # Shuffle and spill files hold decrypted rows: keep them encrypted on local disk too.
    "spark.io.encryption.enabled": "true",
    # The I/O encryption keys travel over Spark's RPC: authenticate and encrypt it.
    "spark.authenticate": "true",
    "spark.network.crypto.enabled": "true",
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

# Spark's log settings: warnings and errors to stderr, minus the two start-up notices that hold
# for every local session (no native Hadoop library is needed for local files).
LOG4J2_PROPERTIES = Path(__file__).with_name("log4j2.properties")
LOOPBACK = "127.0.0.1"


class JavaMissingError(RuntimeError):
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
    merged = {**DEFAULT_CONF, "spark.master": master}
    merged.update(spark_hadoop_conf(storage))
    merged.update(conf or {})
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

    builder = SparkSession.builder.appName(app_name)
    for key, value in spark_conf(master, conf, storage).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    quiet_logs(session)
    if not is_local(master):
        ship_package(session)
    return session


def package_zip(folder: Path | None = None) -> Path:
    """This installed ``cdc_platform`` package as a zip, named by its content's hash (built
    once per version of the code). Executors import the platform from it, never from their
    working directory or whatever their Python path happens to hold."""
    import hashlib
    import tempfile
    import zipfile

    root = Path(__file__).resolve().parent.parent  # the cdc_platform package folder
    sources = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".properties"}
    )
    digest = hashlib.sha256()
    for p in sources:
        digest.update(str(p.relative_to(root.parent)).encode() + b"\0" + p.read_bytes())
    out = (folder or Path(tempfile.gettempdir())) / f"cdc_platform-{digest.hexdigest()[:16]}.zip"
    if not out.exists():
        partial = out.with_suffix(f".{os.getpid()}.tmp")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as z:
            for p in sources:
                z.write(p, p.relative_to(root.parent).as_posix())
        partial.replace(out)  # atomic: a concurrent run never ships a half-written zip
    return out


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


class ConnectSetupError(RuntimeError):
    """A Spark Connect session cannot be used: client packages missing, or the server lacks a
    setting correctness needs that a client cannot set."""


def is_connect(session: SparkSession) -> bool:
    """True for a Spark Connect session (no SparkContext, no RDDs, no JVM in this process)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def quiet_logs(session: SparkSession, level: str = "WARN") -> None:
    """Set the driver's log level where this process owns the driver (not over Connect)."""
    if not is_connect(session):
        session.sparkContext.setLogLevel(level)


def connect_server_conf(
    master: str = "local[2]", conf: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The conf a Spark Connect server for the platform starts with (``connect_server``)."""
    return {**spark_conf(master, conf), **READ_CONF}


def build_connect_session(
    remote: str, conf: Mapping[str, str] | None = None, app_name: str = "cdc_platform"
) -> SparkSession:
    """A session on the Spark Connect server at ``remote`` (``sc://host:port``).

    No JVM starts in this process. The settings correctness needs are set on the session where
    a client may set them (time zone, Parquet timestamp type, ...); the others (driver JVM time
    zone, no ``_SUCCESS`` markers) must be the server's, and are checked: start the server with
    ``python -m cdc_platform.connect_server start``. The caller's ``conf`` is applied where a
    client may set it; cluster settings belong to the server.
    """
    try:
        from pyspark.sql.connect.utils import check_dependencies

        check_dependencies()
    except ImportError as exc:
        raise ConnectSetupError(
            f"Spark Connect needs the client packages of pyspark[connect] ({exc}):"
            " pip install 'pyspark[connect]'"
        ) from None
    from pyspark.sql import SparkSession

    session = SparkSession.builder.remote(remote).appName(app_name).getOrCreate()
    required = {**REQUIRED_CONF, **READ_CONF}
    for key, value in {**(conf or {}), **required}.items():
        if session.conf.isModifiable(key):
            session.conf.set(key, value)
    wrong = {}
    for key, value in required.items():
        have = session.conf.get(key, None)
        # Spark adds its own JVM options around ours: ours must be among them.
        if have != value and not (key.endswith("JavaOptions") and value in (have or "")):
            wrong[key] = have
    if wrong:
        raise ConnectSetupError(
            f"the Spark Connect server at {remote} runs with {wrong}, not what the platform"
            f" needs ({ {k: required[k] for k in wrong} }): start it with"
            " `python -m cdc_platform.connect_server start`"
        )
    return session
