"""Where the warehouse lives, a local folder or an object store, and how each tool reaches it.

Three tools touch the warehouse, and each names a place its own way:

- delta-rs (commits, VACUUM, small reads): the URI (``s3://bucket/prefix``) plus its
  ``storage_options`` (``aws_region``, ``aws_endpoint_url``, ...).
- Spark (reads and writes the Parquet files): a Hadoop file-system URI (``s3a://bucket/prefix``),
  with the credentials as Hadoop settings (``spark.hadoop.fs.s3a.*``).
- The driver's own file operations (list what Spark wrote, read Parquet footers, delete what was
  never committed): a ``pyarrow.fs`` file system rooted at the location.

A ``Location`` holds the one URI and the options from the config and derives all three, so the
rest of the platform never branches on the scheme. A plain path is a ``Location`` too, and every
call on it is the same local call as before object stores existed.

Secrets stay out of files and logs: an option may be an ``EnvRef`` (``{env: NAME}`` in the config),
read from the environment only when a tool needs it, and a ``Location``'s ``repr`` shows option
names, never values.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from cdc_platform.lib.errors import PlatformError

if TYPE_CHECKING:
    import pyarrow.fs as pafs
    from pyspark.sql import DataFrame, DataFrameReader

# Schemes delta-rs and the Hadoop connectors both understand, as written in the config.
# ``s3a`` is what Hadoop calls S3; delta-rs takes either, so it is stored as ``s3``.
OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "abfss")
# An S3 or GCS bucket name, as loose as the oldest S3 buckets were allowed (letters, digits,
# dots, hyphens, underscores): never a user, password or port.
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")
# What Spark (Hadoop) calls each scheme.
_SPARK_SCHEMES = {"s3": "s3a", "gs": "gs", "abfss": "abfss"}


class StorageOptionError(PlatformError, RuntimeError):
    """A storage option cannot be given its value (its environment variable is not set)."""


@dataclass(frozen=True)
class EnvRef:
    """A storage option read from the environment variable ``name`` when it is used.

    The config says ``{env: NAME}``; the value never sits in the file or in the config object.
    """

    name: str

    def resolve(self, option: str) -> str:
        value = os.environ.get(self.name)
        if value is None:
            raise StorageOptionError(
                f"storage option '{option}' reads the environment variable {self.name},"
                " which is not set"
            )
        return value


OptionValue = str | EnvRef


@dataclass(frozen=True, repr=False)
class Location:
    """A folder of the warehouse: a local path or an object-store URI, with its storage options.

    ``uri`` is an absolute local path (``/data/warehouse``) or ``<scheme>://<bucket>/<prefix>``
    without a trailing slash. ``options`` are delta-rs storage options, as in the config
    (values or ``EnvRef``); ``storage_options`` gives them resolved.
    """

    uri: str
    options: Mapping[str, OptionValue] = field(default_factory=dict, hash=False)

    @classmethod
    def of(cls, where: Where, options: Mapping[str, OptionValue] | None = None) -> Location:
        """``where`` as a Location: a Location as it is, a URI, a ``file://`` URI or a path."""
        if isinstance(where, Location):
            if options is not None:
                raise ValueError("options are given twice: on the Location and as an argument")
            return where
        text = os.fspath(where)
        scheme = urlsplit(text).scheme.lower() if "://" in text else ""
        if scheme in OBJECT_STORE_SCHEMES:
            parts = urlsplit(text)
            if not parts.netloc:
                raise ValueError(f"{text!r} names no bucket or container")
            if scheme in ("s3", "s3a", "gs") and not _BUCKET.fullmatch(parts.netloc):
                # Never echoed: a netloc with '@' or ':' may carry credentials.
                raise ValueError(
                    f"a {scheme}:// URI names a bucket (letters, digits, '.', '-', '_'), with "
                    "no credentials or port in it: give those as storage options"
                )
            canonical = "s3" if scheme == "s3a" else scheme
            return cls(f"{canonical}://{parts.netloc}{parts.path.rstrip('/')}", dict(options or {}))
        if scheme == "file":
            parts = urlsplit(text)
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"{text!r}: a file URI names an absolute path, file:///...")
            text = parts.path
        elif scheme:
            raise ValueError(
                f"{text!r}: scheme '{scheme}' is not supported; use a path, file://, "
                + ", ".join(f"{s}://" for s in OBJECT_STORE_SCHEMES)
            )
        if options:
            raise ValueError(f"storage options are for object stores, not the local path {text!r}")
        return cls(os.path.abspath(text))

    @property
    def scheme(self) -> str:
        """``file`` for a local path, else the object store's scheme (``s3``, ``gs``, ``abfss``)."""
        return urlsplit(self.uri).scheme if "://" in self.uri else "file"

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def path(self) -> Path:
        """The local folder; an object store has none (the error names the URI)."""
        if not self.is_local:
            raise ValueError(f"{self.uri} is an object store, not a local path")
        return Path(self.uri)

    def __truediv__(self, relative: str) -> Location:
        """The location ``relative`` (``/``-separated) below this one, with the same options."""
        if self.is_local:
            return Location(os.path.join(self.uri, relative), self.options)
        return Location(f"{self.uri}/{relative.strip('/')}", self.options)

    @property
    def parent(self) -> Location:
        if self.is_local:
            return Location(os.path.dirname(self.uri), self.options)
        head, _, tail = self.uri.rpartition("/")
        if not tail or head.endswith(":/"):
            raise ValueError(f"{self.uri} is the root of its bucket")
        return Location(head, self.options)

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        # Option names only: a value may be a secret given programmatically.
        names = f", options={sorted(self.options)}" if self.options else ""
        return f"Location({self.uri!r}{names})"

    # -- delta-rs ------------------------------------------------------------------------------

    @property
    def storage_options(self) -> dict[str, str] | None:
        """The options for delta-rs, environment references read now; None for a local path
        (delta-rs is then called exactly as without options)."""
        if not self.options:
            return None
        return {k: v.resolve(k) if isinstance(v, EnvRef) else v for k, v in self.options.items()}

    # -- Spark ---------------------------------------------------------------------------------

    def spark_uri(self, relative: str = "") -> str:
        """What Spark reads or writes for ``relative`` below here: a local path as it is, an
        object store under its Hadoop scheme (``s3://`` becomes ``s3a://``)."""
        target = self / relative if relative else self
        if self.is_local:
            return target.uri
        _, rest = target.uri.split("://", 1)
        return f"{_SPARK_SCHEMES[self.scheme]}://{rest}"

    @property
    def url_path(self) -> str:
        """The path part of the URL Spark gives (``input_file_name()``) for a file below here,
        up to this location: the absolute path locally, the key prefix after the bucket."""
        if self.is_local:
            return self.uri
        return urlsplit(self.uri).path

    # -- the driver's file operations ----------------------------------------------------------

    def filesystem(self) -> pafs.FileSystem:
        """A ``pyarrow.fs`` file system rooted here (paths below it are ``/``-separated and
        relative). Locally Arrow's own; on an object store delta-rs' (``DeltaStorageHandler``),
        so it uses the same storage options, with the same meaning, as every commit."""
        import pyarrow.fs as pafs

        if self.is_local:
            return pafs.SubTreeFileSystem(self.uri, pafs.LocalFileSystem())
        from deltalake.fs import DeltaStorageHandler

        return pafs.PyFileSystem(DeltaStorageHandler(self.uri, self.storage_options))


Where = Location | str | os.PathLike[str]


# -- Spark's file paths --------------------------------------------------------------------------

# What Spark's file sources (Hadoop's ``globStatus``) read as a pattern in a path they are given
# (``SparkHadoopUtil.isGlobPath``): ``bad[1.parquet`` is no file name to them, and ``{a,b}`` may
# hold ``/`` and ``..`` (``x{/..}{/..}/y`` is expanded before ``..`` is resolved).
GLOB_CHARACTERS = "{}[]*?\\"
_GLOB_ESCAPES = str.maketrans({c: "\\" + c for c in GLOB_CHARACTERS})


def literal_path(path: str) -> str:
    """``path`` as Spark's file sources read it literally: each glob character escaped with a
    backslash (Hadoop's ``GlobPattern`` escapes); a path with none is returned as it is.

    Not Spark's ``__globPaths__ = false`` option: in Spark 4.2 a read of several paths with it
    lists every path once more for each path that has a glob character
    (``DataSource.checkAndGlobPathIfNecessary``), so such a file's rows would be read twice."""
    return path.translate(_GLOB_ESCAPES)


def read_parquet(reader: DataFrameReader, paths: Iterable[str]) -> DataFrame:
    """``reader.parquet`` of exactly the files or folders ``paths`` name (``literal_path``):
    every Spark read of a landing file or a Delta table's file goes through here."""
    return reader.parquet(*[literal_path(p) for p in paths])


# -- Spark's Hadoop settings ---------------------------------------------------------------------

# delta-rs option names (every alias object_store accepts, lower case) -> Hadoop S3A setting.
_S3A_SETTINGS: dict[str, tuple[str, ...]] = {
    "fs.s3a.access.key": ("aws_access_key_id", "access_key_id"),
    "fs.s3a.secret.key": ("aws_secret_access_key", "secret_access_key"),
    "fs.s3a.session.token": ("aws_session_token", "session_token", "aws_token", "token"),
    "fs.s3a.endpoint.region": ("aws_region", "region", "aws_default_region", "default_region"),
    "fs.s3a.endpoint": (
        "aws_endpoint_url",
        "aws_endpoint",
        "endpoint_url",
        "endpoint",
        "aws_endpoint_url_s3",
    ),
}
_VIRTUAL_HOSTED = ("aws_virtual_hosted_style_request", "virtual_hosted_style_request")
TEMPORARY_CREDENTIALS_PROVIDER = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"


def hadoop_conf(location: Location) -> dict[str, str]:
    """The Hadoop settings Spark needs to reach ``location`` the way delta-rs does.

    Only S3 has any: the keys, session token, region and endpoint go to their ``fs.s3a.*``
    settings, and a custom endpoint (MinIO, Ceph, ...) is addressed path-style unless the options
    ask for virtual-hosted requests, as delta-rs does. Options with no Hadoop meaning (delta-rs'
    own, like ``aws_conditional_put``) are delta-rs only. For ``gs://`` and ``abfss://`` Spark
    uses the credentials its cluster configures for the connector. Environment references are
    read now.
    """
    if location.scheme != "s3" or not location.options:
        return {}
    given = {k.lower(): k for k in location.options}
    resolved = location.storage_options or {}

    def value(aliases: Iterable[str]) -> str | None:
        key = next((given[a] for a in aliases if a in given), None)
        return resolved[key] if key is not None else None

    conf = {hk: v for hk, aliases in _S3A_SETTINGS.items() if (v := value(aliases)) is not None}
    if "fs.s3a.session.token" in conf:
        conf["fs.s3a.aws.credentials.provider"] = TEMPORARY_CREDENTIALS_PROVIDER
    endpoint = conf.get("fs.s3a.endpoint")
    if endpoint is not None:
        virtual = (value(_VIRTUAL_HOSTED) or "false").strip().lower() == "true"
        conf["fs.s3a.path.style.access"] = "false" if virtual else "true"
        if endpoint.lower().startswith("http://"):
            conf["fs.s3a.connection.ssl.enabled"] = "false"
    return conf


def spark_hadoop_conf(locations: Iterable[Location]) -> dict[str, str]:
    """``hadoop_conf`` of every location as Spark conf (``spark.hadoop.<setting>``)."""
    conf: dict[str, str] = {}
    for location in locations:
        conf.update({f"spark.hadoop.{k}": v for k, v in hadoop_conf(location).items()})
    return conf


def options_as_config(options: Mapping[str, OptionValue]) -> dict[str, str | dict[str, str]]:
    """Options in the config file's form (``{env: NAME}`` for a reference): what a Dagster
    resource can carry and show without ever holding a secret read from the environment."""
    return {k: {"env": v.name} if isinstance(v, EnvRef) else v for k, v in options.items()}
