"""Where the platform's Spark runs: a fact of the deployment, read from its environment.

``SparkDeployment.from_env`` chooses Spark Connect (``$CDC_SPARK_REMOTE``), a cluster
(``$CDC_SPARK_MASTER`` with ``$CDC_SPARK_AUTH_SECRET``) or ``local[2]``; a run may only tune
the few knobs of ``RUN_TUNABLE`` (``run_conf``), never choose where Spark runs (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.spark.connect import (
    CONNECT_AUTH_ENV,
    DEFAULT_CONNECT_AUTH,
    ConnectAuth,
    build_connect_session,
)
from cdc_platform.lib.spark.session import build_spark_session
from cdc_platform.lib.storage.stores import Location

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


# What a run's config may still set (the Launchpad user is not trusted with where Spark runs,
# its jars, Java options or security): tuning knobs whose values are numbers, sizes, booleans.
RUN_TUNABLE: frozenset[str] = frozenset(
    {
        "spark.sql.shuffle.partitions",
        "spark.default.parallelism",
        "spark.sql.adaptive.enabled",
        "spark.sql.autoBroadcastJoinThreshold",
        "spark.sql.files.maxPartitionBytes",
        "spark.driver.memory",
        "spark.executor.memory",
    }
)
_TUNABLE_VALUE = re.compile(r"-?[0-9]{1,18}[kmgt]?b?|true|false", re.IGNORECASE)

# The deployment's environment (docs/SECURITY.md: never a run's config).
SPARK_REMOTE_ENV = "CDC_SPARK_REMOTE"
SPARK_MASTER_ENV = "CDC_SPARK_MASTER"
SPARK_AUTH_SECRET_ENV = "CDC_SPARK_AUTH_SECRET"


class SparkConfigError(Refusal):
    """A Spark setting a run may not choose, or a deployment setting that cannot be used."""


def run_conf(conf: Mapping[str, Any]) -> dict[str, str]:
    """The Spark settings a run asked for, if each is a tuning knob of ``RUN_TUNABLE`` with a
    plain value; anything else is refused whole, naming the setting (never applied in part)."""
    refused = sorted(str(k) for k in conf if k not in RUN_TUNABLE)
    if refused:
        raise SparkConfigError(
            f"spark_config may only tune {sorted(RUN_TUNABLE)}; refused: {refused} (where Spark"
            " runs and its other settings are the deployment's: docs/SECURITY.md)"
        )
    out = {str(k): str(v).strip() for k, v in conf.items()}
    bad = sorted(k for k, v in out.items() if not _TUNABLE_VALUE.fullmatch(v))
    if bad:
        raise SparkConfigError(f"spark_config: {bad} must be a number, a size (4g) or a boolean")
    return out


@dataclass(frozen=True)
class SparkDeployment:
    """Where the platform's Spark runs and how it is reached: facts of the deployment, read
    from its environment (``from_env``), never from a run's config (docs/SECURITY.md).

    ``remote``: a Spark Connect server (``sc://host:port``), with the auth file its clients
    read (``connect_auth``); else ``master`` (``local[2]``, ``spark://host:7077`` with the
    cluster's ``auth_secret``, ``yarn``, ``k8s://...``)."""

    master: str = "local[2]"
    remote: str | None = None
    auth_secret: str | None = field(default=None, repr=False)
    connect_auth: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SparkDeployment:
        env = os.environ if env is None else env
        remote = env.get(SPARK_REMOTE_ENV) or None
        if remote:
            auth = env.get(CONNECT_AUTH_ENV)
            return cls(remote=remote, connect_auth=Path(auth) if auth else DEFAULT_CONNECT_AUTH)
        return cls(
            master=env.get(SPARK_MASTER_ENV) or "local[2]",
            auth_secret=env.get(SPARK_AUTH_SECRET_ENV) or None,
        )

    def session(
        self,
        conf: Mapping[str, str] | None = None,
        app_name: str = "cdc_platform",
        storage: Iterable[Location] = (),
    ) -> SparkSession:
        """A session where the deployment says, with ``conf`` (already checked by the caller)."""
        if self.remote:
            auth = ConnectAuth.load(self.connect_auth or DEFAULT_CONNECT_AUTH)
            return build_connect_session(self.remote, conf, app_name, auth)
        conf = dict(conf or {})
        if self.auth_secret:
            conf["spark.authenticate.secret"] = self.auth_secret
        return build_spark_session(self.master, conf, app_name, storage)
