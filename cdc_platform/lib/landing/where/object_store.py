"""A landing zone on S3 (or any S3-compatible store): listed by prefix, read pinned by ETag.

Why boto3 and not ``obstore`` (delta-rs' ``object_store``) or ``pyarrow.fs``: the landing zone
is written by someone else, so a key may be anything S3 allows. ``object_store`` refuses a whole
listing when one key has a ``..`` or empty segment (one hostile key would stop a table's
sensor), and ``pyarrow.fs`` gives no ETag and no ``start-after``. boto3 is S3's own client:
``ListObjectsV2`` with ``StartAfter`` (a tick lists what is new, not the history), the ETag
of every object, and ``GetObject`` with ``If-Match`` and ``Range``.

The options are ``landing_storage_options``, the same names as ``warehouse_storage_options``
(``aws_access_key_id``, ``aws_endpoint_url``, ...; secrets as ``{env: NAME}``); without them
boto3 finds credentials as every AWS tool does (environment, profile, instance role).

A file's path is its URI (``s3://bucket/prefix/<table>/year=.../<file>``), its name the key
below the root. Every request is counted in ``requests`` (the sensor benchmark prints them).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Collection, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, BinaryIO

from cdc_platform.lib.landing.decoding.codecs import LandingFileError
from cdc_platform.lib.landing.where import layout
from cdc_platform.lib.landing.where.layout import BAD_KEY, IN_SUBFOLDER, LandingFile
from cdc_platform.lib.landing.where.safe_open import CHANGED, OUTSIDE, FileId
from cdc_platform.lib.landing.where.zone import (
    HourListing,
    IncompleteSnapshotError,
    LandingUnavailableError,
    LandingZone,
    ListBudget,
)
from cdc_platform.lib.storage.stores import Location, StorageOptionError, hadoop_conf

# An object at most this big is fetched whole, in one pinned GET; a bigger one is read by
# pinned ranged GETs of this size as the format asks for its bytes (a Parquet footer first).
WHOLE_OBJECT_BYTES = 8 * 1024 * 1024
# The page size of a listing (S3's own maximum).
PAGE_KEYS = 1000

# Errors that say one object cannot be read, whoever asks: the file is set aside with the reason
# (re-admit it by file once it is readable). Any other error fails the run, which is retried.
_OBJECT_ERRORS = {
    "InvalidObjectState": (
        "archived (a Glacier storage class): restore the object, then re-admit the file"
    ),
    "InvalidRequest": (
        "the object cannot be read as stored (encrypted with a customer-provided key, say)"
    ),
}


def _object_error(operation: str, code: str, message: str) -> str | None:
    """Why one object's GET failed for reasons of its own, or None (then the store failed):
    only a GET, and a generic ``InvalidRequest`` only when it is about the object's encryption."""
    if operation != "get_object" or code not in _OBJECT_ERRORS:
        return None
    if code == "InvalidRequest" and "encrypt" not in message.lower():
        return None
    return _OBJECT_ERRORS[code]


# A late object's last-modified time may be hours before it is listed (a multipart upload's
# is when the upload began): the sweep looks again at hours touched this long before its mark.
SWEEP_MARGIN_NS = 6 * 3600 * 1_000_000_000

# Hadoop S3A setting (``stores.hadoop_conf``: the options' one reading) -> boto3 client argument.
_CLIENT_ARGS = {
    "fs.s3a.access.key": "aws_access_key_id",
    "fs.s3a.secret.key": "aws_secret_access_key",
    "fs.s3a.session.token": "aws_session_token",
    "fs.s3a.endpoint.region": "region_name",
    "fs.s3a.endpoint": "endpoint_url",
}


class S3Landing(LandingZone):
    """The landing zone below ``s3://bucket/prefix``; picklable (the client is made per process)."""

    native_reads = False  # Spark would read by path, unpinned: every file is read in Python
    sweep_margin_ns = SWEEP_MARGIN_NS

    def __init__(self, location: Location) -> None:
        if location.scheme != "s3":
            raise ValueError(
                f"{location.uri}: a landing zone on an object store must be on S3 or an "
                "S3-compatible store (s3://, with aws_endpoint_url for MinIO, Ceph or GCS's "
                "interoperability endpoint)"
            )
        self.location = location
        self.root = location.uri
        bucket, _, prefix = location.uri.removeprefix("s3://").partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.requests = 0
        self._client: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """What Spark ships to a task: the options read from the environment here, on the
        driver (an executor's environment need not have them), as the table's keys travel."""
        state = dict(self.__dict__)
        state["_client"], state["_lock"] = None, None
        state["location"] = Location(self.location.uri, self.location.storage_options or {})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._lock = threading.Lock()

    # -- the client ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    self._client = _client(self.location)
                except (StorageOptionError, ValueError) as exc:  # the deployment's: run fails
                    raise LandingUnavailableError(f"{self.root}: {exc}") from None
            return self._client

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
        """One request, counted; an unreachable store raises LandingUnavailableError."""
        return self._request(operation, lambda: self._send(operation, kwargs), kwargs)

    def _get(self, key: str, **kwargs: Any) -> bytes:
        """An object's bytes (``kwargs``: If-Match, Range), the body read inside the request's
        error handling: a connection dropped mid-body is the store's failure, not the file's."""

        def get() -> bytes:
            return self._send("get_object", {"Key": key, **kwargs})["Body"].read()

        return self._request("get_object", get, {"Key": key})

    def _send(self, operation: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        return getattr(self.client, operation)(Bucket=self.bucket, **kwargs)

    def _request(self, operation: str, send: Any, kwargs: dict[str, Any]) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        self.requests += 1
        try:
            return send()
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in ("PreconditionFailed", "412"):
                raise LandingFileError(CHANGED) from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"{self.root}: {kwargs.get('Key', '')} is gone") from None
            reason = _object_error(operation, code, str(error.get("Message", "")))
            if reason is not None:  # this object only (archived, a customer's own key)
                raise LandingFileError(reason) from None
            raise LandingUnavailableError(
                f"{operation} on {self.root} failed: {code} {error.get('Message', '')}".strip()
            ) from None
        except (BotoCoreError, OSError) as exc:  # refused, timed out, dropped mid-body
            raise LandingUnavailableError(
                f"{operation} on {self.root} failed: {type(exc).__name__}"
            ) from None

    def key_of(self, relative: str) -> str:
        """The bucket key of a name relative to the root."""
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def _list(self, prefix: str, start_after: str = "", end: str = "") -> Iterator[dict[str, Any]]:
        """Every object whose key starts with ``prefix`` (relative), after ``start_after`` and,
        given an ``end``, before it (the listing stops there)."""
        token: str | None = None
        last = self.key_of(end) if end else ""
        while True:
            page = self._page(prefix, token, start_after)
            for obj in page.get("Contents", ()):
                if last and obj["Key"] >= last:
                    return
                yield obj
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _page(self, prefix: str, token: str | None, after: str) -> dict[str, Any]:
        """One page of the listing of ``prefix`` (relative): the one ``token`` continues to,
        else the first after the key ``after`` (relative; empty: from the start)."""
        args: dict[str, Any] = {"Prefix": self.key_of(prefix), "MaxKeys": PAGE_KEYS}
        if token:
            args["ContinuationToken"] = token
        elif after:
            args["StartAfter"] = self.key_of(after)
        return self._call("list_objects_v2", **args)

    def _relative_key(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def _file(self, obj: dict[str, Any], set_aside: str | None = None) -> LandingFile:
        modified: datetime = obj["LastModified"]
        return LandingFile(
            f"{self.root}/{self._relative_key(obj['Key'])}",
            int(obj.get("Size", 0)),
            int(modified.timestamp() * 1_000_000) * 1000,
            set_aside,
            etag=str(obj.get("ETag", "")),
        )

    # -- listing ------------------------------------------------------------------------------

    def exists(self) -> bool:
        try:
            self._call("list_objects_v2", Prefix=self.key_of(""), MaxKeys=1)
        except LandingUnavailableError:
            return False
        return True

    def files_in_hour(self, table: str, hour: datetime) -> list[LandingFile]:
        found: list[LandingFile] = []
        for folder in layout.folder_spellings(table, hour):
            for obj in self._list(folder + "/"):
                file = self._hour_file(obj, len(folder) + 1)
                if file is not None:
                    found.append(file)
        return sorted(found)

    def files_in_hours(
        self, table: str, first: datetime, last: datetime
    ) -> dict[datetime, list[LandingFile]]:
        """One listing from the window's first key to its last (S3 lists in key order, and a
        padded hour folder sorts by time): a tick costs a page per 1000 recent objects, and no
        key outside the window's range (a future year, junk after ``year=``) is listed."""
        hours = list(layout.hours_between(first, last))
        if not hours:
            return {}
        spellings = [s for h in hours for s in layout.folder_spellings(table, h)]
        end = max(spellings) + "0"  # just past every key below the last folder ("/" + 1)
        by_hour = self._by_hour(self._list(table + "/", start_after=min(spellings), end=end))
        wanted = set(hours)
        return {h: files for h, files in by_hour.items() if h in wanted}

    def hour_files(
        self, table: str, after: str = "", budget: ListBudget | None = None
    ) -> HourListing:
        """The prefix listing of ``table/year=`` (a page per 1000 objects) from ``after`` on,
        until ``budget`` is spent. A folder cut by the budget is left to the next call, unless
        it is all this call listed (a folder of more keys than the budget lists is swept in
        parts, each part its own hour listing)."""
        objects, more = self._pages(table + "/year=", after, budget)
        if not more:
            return HourListing(self._by_hour(iter(objects)), None)
        if not objects:  # not even one page this time
            return HourListing({}, after)
        open_folder = self._folder_of(objects[-1])
        cut = len(objects)
        while cut > 0 and self._folder_of(objects[cut - 1]) == open_folder:
            cut -= 1
        kept = objects[:cut] if cut else objects
        return HourListing(self._by_hour(iter(kept)), self._relative_key(kept[-1]["Key"]))

    def files_of_hours(
        self, table: str, hours: Collection[datetime], budget: ListBudget | None = None
    ) -> tuple[dict[datetime, list[LandingFile]], set[datetime]]:
        """One prefix listing per day folder (each spelling) holding one of ``hours``, oldest
        day first, until ``budget`` is spent: a day is listed whole or not at all."""
        days: dict[tuple[str, ...], set[datetime]] = {}
        for hour in sorted(hours):
            day = (f.rsplit("/", 1)[0] + "/" for f in layout.folder_spellings(table, hour))
            days.setdefault(tuple(dict.fromkeys(day)), set()).add(hour)
        found: dict[datetime, list[LandingFile]] = {}
        listed: set[datetime] = set()
        for prefixes, day_hours in days.items():
            objects: list[dict[str, Any]] = []
            for prefix in prefixes:
                page, more = self._pages(prefix, "", budget)
                if more:
                    return found, listed
                objects += page
            by_hour = self._by_hour(iter(objects))
            found.update({h: by_hour.get(h, []) for h in day_hours})
            listed |= day_hours
        return found, listed

    def _pages(
        self, prefix: str, after: str, budget: ListBudget | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """(the objects under ``prefix`` after ``after``, whether more are left unlisted
        because ``budget`` was spent)."""
        objects: list[dict[str, Any]] = []
        token: str | None = None
        while budget is None or budget.take():
            page = self._page(prefix, token, after)
            objects += page.get("Contents", ())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return objects, False
        return objects, True

    def _folder_of(self, obj: dict[str, Any]) -> str:
        return "/".join(self._relative_key(obj["Key"]).split("/")[:5])

    def _by_hour(self, objects: Iterator[dict[str, Any]]) -> dict[datetime, list[LandingFile]]:
        """Listed objects as ``files_in_hour`` gives them, by hour: a key in an hour folder
        spelled as ``files_in_hour`` lists it (zero-padded, or not padded at all)."""
        out: dict[datetime, list[LandingFile]] = {}
        for obj in objects:
            parts = self._relative_key(obj["Key"]).split("/")
            hour = hour_of_key(parts[1:5])
            folder = "/".join(parts[:5])
            if hour is None or folder not in layout.folder_spellings(parts[0], hour):
                continue
            file = self._hour_file(obj, len(folder) + 1)
            if file is not None:
                out.setdefault(hour, []).append(file)
        return {h: sorted(files) for h, files in sorted(out.items())}

    def _hour_file(self, obj: dict[str, Any], folder_length: int) -> LandingFile | None:
        """A listed object of an hour folder (``folder_length``: its folder's relative key
        length, with the slash): marker names skipped, deeper keys and keys with an empty,
        ``.`` or ``..`` segment set aside."""
        rel = self._relative_key(obj["Key"])
        name = rel[folder_length:]
        if not name:  # the folder's own marker object (``hour=05/``)
            return None
        if any(part in ("", ".", "..") for part in rel.split("/")):
            return self._file(obj, BAD_KEY)
        if not layout.is_data_file(name.split("/")[0]):
            return None
        if "/" in name:
            return self._file(obj, IN_SUBFOLDER)
        return self._file(obj)

    def hours(self, table: str) -> list[datetime]:
        return list(self.hour_files(table).files)

    def table_names(self) -> list[str]:
        names: set[str] = set()
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Prefix": self.key_of(""), "Delimiter": "/"}
            if not self.prefix:
                args["Prefix"] = ""
            if token:
                args["ContinuationToken"] = token
            page = self._call("list_objects_v2", **args)
            for common in page.get("CommonPrefixes", ()):
                name = self._relative_key(common["Prefix"]).rstrip("/")
                if name and "/" not in name:
                    names.add(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(names)

    def all_files(self) -> dict[str, FileId]:
        found = {}
        for obj in self._list(""):
            rel = self._relative_key(obj["Key"])
            if not rel or rel.endswith("/"):  # a folder's marker object (the root's too)
                continue
            parts = rel.split("/")
            if any(part in ("", ".", "..") for part in parts):
                raise IncompleteSnapshotError(f"{self.root}/{rel}", BAD_KEY)
            if all(layout.is_data_file(part) for part in parts):
                file = self._file(obj)
                found[file.path] = file.file_id
        return dict(sorted(found.items()))

    def table_files(self, table: str) -> set[str]:
        keys = (self._relative_key(obj["Key"]) for obj in self._list(table + "/"))
        return {k for k in keys if not k.endswith("/")}  # not a folder's marker object

    # -- naming and reading -------------------------------------------------------------------

    def normalized(self, path: str) -> str:
        return path

    def relative(self, path: str) -> str:
        return path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path

    def open(self, path: str, expected: FileId | None) -> BinaryIO:
        key = self.key_of(refuse_outside(self.root, path))
        etag = expected.etag if expected is not None and expected.etag else None
        if etag is None:  # not listed (a discovery sample): pinned to what a HEAD sees now
            etag = str(self._call("head_object", Key=key)["ETag"])
        size = expected.size if expected is not None and expected.etag else None
        if size is None or size <= WHOLE_OBJECT_BYTES:
            return io.BytesIO(self._get(key, IfMatch=etag))

        def fetch(start: int, end: int) -> bytes:
            return self._get(key, IfMatch=etag, Range=f"bytes={start}-{end - 1}")

        raw = PinnedObject(fetch, size)
        return io.BufferedReader(raw, buffer_size=WHOLE_OBJECT_BYTES)  # type: ignore[arg-type]

    def check_unchanged(self, fh: BinaryIO, expected: FileId | None) -> None:
        raw = getattr(fh, "raw", None)
        if isinstance(raw, PinnedObject) and raw.changed:
            raise LandingFileError(CHANGED)

    def changed_since_listed(self, path: str, expected: FileId | None) -> bool:
        try:
            key = self.key_of(refuse_outside(self.root, path))
            now = self._call("head_object", Key=key)
        except (LandingFileError, FileNotFoundError):
            return True
        return expected is not None and bool(expected.etag) and now.get("ETag") != expected.etag


def _client(location: Location) -> Any:
    """A boto3 S3 client with the location's options (``stores.hadoop_conf`` reads them, so
    they mean here what they mean to Spark and delta-rs), retrying throttles and dropped
    connections a few times before the run fails."""
    import boto3.session
    from botocore.config import Config

    conf = hadoop_conf(location)
    args: dict[str, Any] = {a: conf[s] for s, a in _CLIENT_ARGS.items() if s in conf}
    style = "virtual" if conf.get("fs.s3a.path.style.access") == "false" else "path"
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        s3={"addressing_style": style if "endpoint_url" in args else "auto"},
    )
    return boto3.session.Session().client("s3", config=config, **args)


# -- an object read as listed ------------------------------------------------------------------


class PinnedObject(io.RawIOBase):
    """An object read by ranged GETs, each pinned to the listed ETag: if the object is
    overwritten while it is read, the next GET fails and ``changed`` is set, so the reader
    refuses the file instead of mixing two versions."""

    def __init__(self, fetch: Any, size: int) -> None:
        # ``fetch(start, end)``: the bytes [start, end) of the listed version, or raises.
        self._fetch, self._size, self._pos = fetch, size, 0
        self.changed = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        end = min(self._size, self._pos + len(buffer))
        if end <= self._pos:
            return 0
        try:
            data = self._fetch(self._pos, end)
        except LandingFileError:
            self.changed = True
            raise
        n = len(data)
        buffer[:n] = data
        self._pos += n
        return n


def hour_of_key(parts: Sequence[str]) -> datetime | None:
    """The hour named by ``year=/month=/day=/hour=`` parts (padded or not), or None."""
    if len(parts) != 4:
        return None
    values = []
    for part, name in zip(parts, ("year", "month", "day", "hour"), strict=True):
        label, _, digits = part.partition("=")
        if label != name or not (digits.isascii() and digits.isdigit()):
            return None
        if len(digits) > layout.DIGITS[name]:
            return None
        values.append(int(digits))
    try:
        return datetime(*values, tzinfo=UTC)
    except (ValueError, OverflowError):
        return None


def refuse_outside(zone_root: str, path: str) -> str:
    """The key of ``path`` below ``zone_root`` (``/``-separated); LandingFileError(OUTSIDE) for
    anything else: another bucket or prefix, or an empty, ``.`` or ``..`` segment."""
    if not path.startswith(zone_root + "/"):
        raise LandingFileError(OUTSIDE)
    rel = path[len(zone_root) + 1 :]
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise LandingFileError(OUTSIDE)
    return rel
