"""Dagster resources: the Spark session and the decryption keys.

Both are lazy: defining them (and importing this module) starts no JVM and reads no key.
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from pydantic import Field, PrivateAttr

from cdc_platform.lib.keyring import Keyring
from cdc_platform.lib.spark import build_spark_session

KEYRING_ENV_VAR = "CDC_KEYRING"


class SparkResource(LazyPySparkResource):
    """A SparkSession created on first use and stopped when the run ends (if it started it).

    ``master`` is ``local[2]`` by default; point it at ``spark://host:7077``, ``yarn`` or
    ``k8s://https://...`` and put cluster settings in ``spark_config``. The platform always
    adds what correctness needs (UTC session time zone, TIMESTAMP_MICROS Parquet output).
    """

    master: str = Field(default="local[2]", description="Spark master URL.")
    spark_config: dict[str, Any] = Field(default_factory=dict, description="Extra Spark conf.")
    app_name: str = "cdc_platform"
    stop_at_end_of_run: bool = Field(
        default=True, description="Stop the session when the run ends (tests share one instead)."
    )

    _owns_session: bool = PrivateAttr(default=False)

    def _init_session(self) -> None:
        if self._spark_session is None:
            from pyspark.sql import SparkSession

            # A session someone else started (a notebook, a test suite) is reused, never stopped.
            self._owns_session = SparkSession.getActiveSession() is None
            conf = {k: str(v) for k, v in self.spark_config.items()}
            self._spark_session = build_spark_session(self.master, conf, self.app_name)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._spark_session is not None and self.stop_at_end_of_run and self._owns_session:
            self._spark_session.stop()
        self._spark_session = None


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
