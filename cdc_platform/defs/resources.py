"""Dagster resources: the Spark session and the decryption keys.

Both are lazy: defining them (and importing this module) starts no JVM and reads no key.
Neither lets a run's config choose where Spark runs, its jars, its security settings or which
keyring is read: those are the deployment's (its environment, ``lib.spark.deployment.SparkDeployment``);
the Launchpad user is not trusted with keys (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from pydantic import Field, PrivateAttr

from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.spark.connect import connect_session_usable
from cdc_platform.lib.spark.deployment import RUN_TUNABLE, SparkDeployment, run_conf
from cdc_platform.lib.storage.stores import Location, Where

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

KEYRING_ENV_VAR = "CDC_KEYRING"

# Spark has one SparkContext per process, and Dagster runs each step with a *copy* of the
# resource object it was given, so which session a SparkResource started is process-wide state:
# it lets ``stop()`` on the object the caller holds stop the session a run's copy started.
_started_lock = threading.Lock()
_started: list[SparkSession] = []


class SparkResource(LazyPySparkResource):
    """A SparkSession created on first use and stopped when the run ends (if it started it).

    It is dagster-pyspark's ``LazyPySparkResource`` (``spark_session``, ``spark_context``,
    ``spark_config``: an op written for that resource runs with this one), with the session
    built where the deployment says instead of from the run's config (docs/engines.md says why).
    Where it runs comes from the deployment's environment (``SparkDeployment.from_env``):
    Spark Connect at ``$CDC_SPARK_REMOTE`` (a run then starts no JVM of its own), else the
    cluster at ``$CDC_SPARK_MASTER`` with its shared secret in ``$CDC_SPARK_AUTH_SECRET``, else
    ``local[2]``; other cluster settings go in the deployment's ``spark-defaults.conf``. A run
    may only tune ``spark_config`` (``lib.spark.deployment.RUN_TUNABLE``). The platform always adds
    what correctness and security need. A session that was already running when the resource
    was first used (a notebook, a test suite) is reused and never stopped by it.
    """

    spark_config: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Tuning a run may set, nothing else: {', '.join(sorted(RUN_TUNABLE))}.",
    )
    stop_at_end_of_run: bool = Field(
        default=True,
        description="Stop the session when the run ends; False keeps it for the next run "
        "(then call stop() when done).",
    )

    # The object stores whose settings this resource built its session with (None: it reused a
    # running session, whose settings it does not know).
    _storage: tuple[Location, ...] | None = PrivateAttr(default=None)

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False  # this subclass is the platform's, not Dagster's

    def _init_session(self) -> None:
        """dagster-pyspark's ``spark_session``: the deployment's session, as ``session()``."""
        self.session()

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Refused when the run starts, before any session exists: a run config that reads the
        environment, or Spark settings off the allowlist (the message names keys, no value)."""
        refuse_env_references(context)
        run_conf(self.spark_config)

    def session(self, warehouse: Where | None = None) -> SparkSession:
        """The session, built on first use where the deployment says, with the Hadoop settings
        of the code location's ``warehouse`` when it is an object store."""
        # A step after one whose Connect connection dropped (the server restarted) builds a
        # new session instead of failing on the broken one: the steps of a multi-table run
        # share this resource (landing_sensor: fleet).
        session = self._spark_session
        if session is not None and _is_connect(session) and not connect_session_usable(session):
            self._spark_session = None
        location = None if warehouse is None else Location.of(warehouse)
        storage = () if location is None or location.is_local else (location,)
        built = self._storage
        if self._spark_session is not None and built is not None:
            _refuse_missing_storage(storage, built)
        if self._spark_session is None:
            from pyspark.sql import SparkSession

            conf = run_conf(self.spark_config)
            deployment = SparkDeployment.from_env()
            with _started_lock:
                if deployment.remote:
                    # A Connect session is this process's own client of the server: reuse
                    # one a SparkResource started, else start (and later stop) a new one.
                    already_running = False
                    session = next((s for s in _started if _is_connect(s)), None)
                    if session is not None and not connect_session_usable(session):
                        _started.remove(session)  # its proven connection dropped
                        session = None
                    session = session or deployment.session(conf, storage=storage)
                else:
                    already_running = SparkSession.getActiveSession() is not None
                    session = deployment.session(conf, storage=storage)
                if not already_running and not any(s is session for s in _started):
                    _started.append(session)
            reused = already_running or deployment.remote is not None
            self._spark_session, self._storage = session, None if reused else storage
        return self._spark_session

    def stop(self) -> None:
        """Stop the session a SparkResource started in this process; never a session it only
        reused. Safe to call more than once (and when nothing was started)."""
        with _started_lock:
            while _started:
                _started.pop().stop()
        self._spark_session = None

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        session, self._spark_session = self._spark_session, None
        if session is None or not self.stop_at_end_of_run:
            return
        with _started_lock:
            if any(s is session for s in _started):
                _started.remove(session)
                session.stop()


def _refuse_missing_storage(needed: tuple[Location, ...], built: tuple[Location, ...]) -> None:
    """A session is built once: one started without the warehouse's object-store settings (an
    op asked for ``spark_session`` first) cannot reach the warehouse, and is refused by name."""
    if any(all(n != b for b in built) for n in needed):
        raise dg.Failure(
            "this run's Spark session was started without the settings of the warehouse's "
            "object store (an op asked for `spark_session` before the platform's steps): have "
            "that op call `spark.session(warehouse_root)`, or run it in a run of its own"
        )


def refuse_env_references(context: dg.InitResourceContext) -> None:
    """Dagster resolves ``{env: NAME}`` in any string of a run config: a Launchpad user could
    read the deployment's secrets into a field that is echoed back (a time, a table name, a
    reason). No run config of this platform needs one, so a run holding one is refused."""
    run = context.dagster_run
    found = _env_references(run.run_config if run is not None else {}, "")
    if found:
        raise dg.Failure(
            f"run config may not read environment variables (found {{env: ...}} at "
            f"{', '.join(found)}): the deployment's environment is not the Launchpad's"
        )


def _env_references(value: Any, where: str) -> list[str]:
    if isinstance(value, dict):
        if "env" in value and len(value) == 1:
            return [where or "the root"]
        return [p for k, v in value.items() for p in _env_references(v, f"{where}.{k}".strip("."))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _env_references(v, f"{where}[{i}]")]
    return []


def _is_connect(session: Any) -> bool:
    from cdc_platform.lib.spark.session import is_connect

    return is_connect(session)


class KeyringResource(dg.ConfigurableResource):
    """The decryption keys for encrypted landing files, read from the keyring JSON file named
    by ``$CDC_KEYRING`` (the deployment's environment; no run can point it elsewhere).

    The file must not be readable by group or others. Keys are never logged, put in metadata
    or shown in the Dagster UI.
    """

    _keyring: Keyring | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        refuse_env_references(context)

    def load(self) -> Keyring:
        if self._keyring is None:
            path = os.environ.get(KEYRING_ENV_VAR)
            self._keyring = Keyring.from_file(path) if path else Keyring.empty()
        return self._keyring
