"""Where the warehouse lives, a local folder or an object store, and how each tool reaches it.

Three tools touch the warehouse, and each names a place its own way:

- delta-rs (commits, VACUUM, small reads): the URI (``s3://bucket/prefix``) plus its
  ``storage_options`` (``aws_region``, ``aws_endpoint_url``, ...).
- Spark (reads and writes the Parquet files): a Hadoop file-system URI (``s3a://bucket/prefix``).
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import pyarrow.fs as pafs

# Schemes delta-rs and the Hadoop connectors both understand, as written in the config.
# ``s3a`` is what Hadoop calls S3; delta-rs takes either, so it is stored as ``s3``.
OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "abfss")
# What Spark (Hadoop) calls each scheme.
_SPARK_SCHEMES = {"s3": "s3a", "gs": "gs", "abfss": "abfss"}


class StorageOptionError(RuntimeError):
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
