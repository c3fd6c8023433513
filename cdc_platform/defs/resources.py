"""Dagster resources: the Spark session and the decryption keys.

Both are lazy: defining them (and importing this module) starts no JVM and reads no key.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field, PrivateAttr

from cdc_platform.lib.config import parse_location
from cdc_platform.lib.keyring import Keyring
from cdc_platform.lib.spark import build_connect_session, build_spark_session
from cdc_platform.lib.storage import Location, options_as_config

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

KEYRING_ENV_VAR = "CDC_KEYRING"
SPARK_REMOTE_ENV_VAR = "CDC_SPARK_REMOTE"
SPARK_MASTER_ENV_VAR = "CDC_SPARK_MASTER"
SPARK_AUTH_SECRET_ENV_VAR = "CDC_SPARK_AUTH_SECRET"

# Spark has one SparkContext per process, and Dagster runs each step with a *copy* of the
# resource object it was given, so which session a SparkResource started is process-wide state:
# it lets ``stop()`` on the object the caller holds stop the session a run's copy started.
_started_lock = threading.Lock()
_started: list[SparkSession] = []


class SparkResource(dg.ConfigurableResource):
    """A SparkSession created on first use and stopped when the run ends (if it started it).

    ``master`` is ``local[2]`` by default; point it at ``spark://host:7077``, ``yarn`` or
    ``k8s://https://...`` and put cluster settings in ``spark_config``. The platform always
    adds what correctness needs (UTC session time zone, TIMESTAMP_MICROS Parquet output).
    ``remote`` (``sc://host:port``) is the alternative to ``master``: a session on a running
    Spark Connect server (``python -m cdc_platform.connect_server start``), so a run starts
    no JVM of its own; ``stop()`` then ends the session, never the server.
    A session that was already running when the resource was first used (a notebook, a test
    suite) is reused and never stopped by it.

    ``warehouse_root`` and ``warehouse_storage_options`` (as in the platform config; the code
    location fills them in for an object-store warehouse) give the session the Hadoop settings
    to reach it. Secrets are ``{env: NAME}`` references, read when the session starts, so the
    Dagster UI shows variable names only. Over Spark Connect the server's own settings apply.
    """

    master: str = Field(default="local[2]", description="Spark master URL.")
    remote: str | None = Field(
        default=None,
        description="Spark Connect URL (sc://host:port), instead of master; default: "
        f"${SPARK_REMOTE_ENV_VAR} if set when the code location loads, else local mode.",
    )
    spark_config: dict[str, Any] = Field(default_factory=dict, description="Extra Spark conf.")
    auth_secret: str | None = Field(
        default=None,
        description="The standalone cluster's shared secret (spark.authenticate.secret); "
        f"pass it as an EnvVar (default: ${SPARK_AUTH_SECRET_ENV_VAR}). Spark redacts it "
        "from its UI and event logs; the platform never logs it.",
    )
    app_name: str = "cdc_platform"
    warehouse_root: str | None = Field(
        default=None, description="An object-store warehouse the session reads and writes."
    )
    warehouse_storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Its storage options, as in the platform config (secrets as {env: NAME}).",
    )
    stop_at_end_of_run: bool = Field(
        default=True,
        description="Stop the session when the run ends; False keeps it for the next run "
        "(then call stop() when done).",
    )

    _session: Any = PrivateAttr(default=None)

    @property
    def spark_session(self) -> SparkSession:
        """The session, built on first access (``lib.spark.build_spark_session``)."""
        if self._session is None:
            from pyspark.sql import SparkSession

            with _started_lock:
                conf = {k: str(v) for k, v in self.spark_config.items()}
                if self.auth_secret:
                    conf["spark.authenticate.secret"] = self.auth_secret
                if self.remote:
                    # A Connect session is this process's own client of the server: reuse
                    # one a SparkResource started, else start (and later stop) a new one.
                    already_running = False
                    session = next((s for s in _started if _is_connect(s)), None)
                    session = session or build_connect_session(self.remote, conf, self.app_name)
                else:
                    already_running = SparkSession.getActiveSession() is not None
                    session = build_spark_session(
                        self.master, conf, self.app_name, storage=self.object_stores()
                    )
                if not already_running and not any(s is session for s in _started):
                    _started.append(session)
            self._session = session
        return self._session

    def object_stores(self) -> tuple[Location, ...]:
        """The warehouse as a ``Location`` if it is an object store (then Spark needs its
        Hadoop settings); none for a local folder."""
        if not self.warehouse_root:
            return ()
        where = "spark resource"
        options = self.warehouse_storage_options or None
        location = parse_location(self.warehouse_root, options, Path.cwd(), where, "warehouse_root")
        return () if location.is_local else (location,)

    def stop(self) -> None:
        """Stop the session a SparkResource started in this process; never a session it only
        reused. Safe to call more than once (and when nothing was started)."""
        with _started_lock:
            while _started:
                _started.pop().stop()
        self._session = None

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        session, self._session = self._session, None
        if session is None or not self.stop_at_end_of_run:
            return
        with _started_lock:
            if any(s is session for s in _started):
                _started.remove(session)
                session.stop()


def _is_connect(session: Any) -> bool:
    from cdc_platform.lib.spark import is_connect

    return is_connect(session)


def spark_resource_from_env(warehouse: Location | None = None) -> SparkResource:
    """The ``spark`` resource of the code location, from the environment (as ``EnvVar``s, so
    the UI shows where each setting comes from): Spark Connect at ``$CDC_SPARK_REMOTE`` if set;
    else the cluster at ``$CDC_SPARK_MASTER`` (e.g. ``spark://host:7077``) with the shared
    secret in ``$CDC_SPARK_AUTH_SECRET``; else local mode. With the object-store ``warehouse``
    it must reach, if any."""
    store: dict[str, Any] = {}
    if warehouse is not None and not warehouse.is_local:
        store = {
            "warehouse_root": warehouse.uri,
            "warehouse_storage_options": options_as_config(warehouse.options),
        }
    if os.environ.get(SPARK_REMOTE_ENV_VAR):
        return SparkResource(remote=dg.EnvVar(SPARK_REMOTE_ENV_VAR), **store)
    if os.environ.get(SPARK_MASTER_ENV_VAR):
        secret = (
            dg.EnvVar(SPARK_AUTH_SECRET_ENV_VAR)
            if os.environ.get(SPARK_AUTH_SECRET_ENV_VAR)
            else None
        )
        return SparkResource(master=dg.EnvVar(SPARK_MASTER_ENV_VAR), auth_secret=secret, **store)
    return SparkResource(**store)


class KeyringResource(dg.ConfigurableResource):
    """The decryption keys for encrypted landing files, read from a keyring JSON file.

    The file is named by ``path`` or else the ``CDC_KEYRING`` env var; it must not be readable
    by group or others. Keys are never logged, put in metadata or shown in the Dagster UI.
    """

    path: str | None = Field(
        default=None, description=f"Keyring file; default: ${KEYRING_ENV_VAR}."
    )
    _keyring: Keyring | None = PrivateAttr(default=None)

    def load(self) -> Keyring:
        if self._keyring is None:
            path = self.path or os.environ.get(KEYRING_ENV_VAR)
            self._keyring = Keyring.from_file(path) if path else Keyring.empty()
        return self._keyring
