"""Spark Connect: a session that is a client of the platform's own server, proven to be it.

The server (``connect_server``) is where Spark runs; a client reaches it only with the token of
the owner-only auth file (``ConnectAuth``), checks the server's proof before sending anything,
and refuses a server that lacks a setting correctness needs (``build_connect_session``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cdc_platform.lib.errors import PlatformError
from cdc_platform.lib.spark import jars
from cdc_platform.lib.spark.session import (
    LOOPBACK,
    LOOPBACK_HOSTS,
    READ_CONF,
    REQUIRED_CONF,
    jar_conf,
    spark_conf,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CONNECT_AUTH_ENV = "CDC_SPARK_CONNECT_AUTH"
DEFAULT_CONNECT_AUTH = Path(".spark-connect") / "auth.json"


class ConnectSetupError(PlatformError, RuntimeError):
    """A Spark Connect session cannot be used: client packages missing, or the server lacks a
    setting correctness needs that a client cannot set."""


def connect_server_conf(
    master: str = "local[2]", conf: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The conf a Spark Connect server for the platform starts with (``connect_server``). The
    server is where Spark runs, so it carries the S3 connector's jars when they are fetched: a
    code location with its warehouse on S3 can then use it."""
    merged = spark_conf(master, conf)
    if jars.available(["s3"]):
        merged.update(jar_conf(master, ["s3"], merged))
    return {**merged, **READ_CONF}


# The server's proof secret: in its Spark conf, never sent by a client (``ConnectAuth``). Not
# named "secret": Spark would substitute its redacted form into the proof query. Authenticated
# clients may read it; nobody else reaches the server.
PROOF_CONF = "spark.cdc.connect.proof"
TOKEN_CONF = "spark.connect.authenticate.token"


@dataclass(frozen=True)
class ConnectAuth:
    """The two secrets of a platform Spark Connect server, in one owner-only JSON file.

    ``token``: the bearer token every client presents (``spark.connect.authenticate.token``):
    no other local process can run code on the server. ``proof``: a secret the server holds
    and no client ever sends; a client asks the server for ``sha256(proof + nonce)`` before it
    sends any work (and with it a table's keys), so a process that took the port of a stopped
    server is refused instead of trusted (docs/SECURITY.md)."""

    token: str = field(repr=False)
    proof: str = field(repr=False)

    @classmethod
    def renew(cls, path: Path) -> ConnectAuth:
        """New secrets in ``path`` (mode 600, replaced atomically), for a server about to start:
        a token a port squatter may have seen while the old server was down is dead with it."""
        auth = cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.unlink(missing_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"token": auth.token, "proof": auth.proof}, f)
        partial.replace(path)
        return auth

    @classmethod
    def load(cls, path: Path) -> ConnectAuth:
        """The file's secrets; refused if it is missing, not a regular file, readable by
        anyone but its owner, or malformed (the message never holds a secret)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConnectSetupError(
                f"Spark Connect auth file {path}: {exc.strerror}; start the server with"
                f" `python -m cdc_platform.connect_server start` and set {CONNECT_AUTH_ENV} to"
                " the auth.json of its state folder"
            ) from None
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
                raise ConnectSetupError(
                    f"Spark Connect auth file {path} must be a regular file of mode 600"
                    f" (is {stat.S_IMODE(st.st_mode):04o})"
                )
            try:
                raw = json.load(f)
                return cls(str(raw["token"]), str(raw["proof"]))
            except (ValueError, KeyError, TypeError):
                raise ConnectSetupError(f"Spark Connect auth file {path} is malformed") from None

    def server_properties(self) -> str:
        """The server's side, as a Spark properties file's text (never a command line, which
        every local user can read)."""
        return f"{TOKEN_CONF}={self.token}\n{PROOF_CONF}={self.proof}\n"


def connect_endpoint(remote: str) -> tuple[str, int, dict[str, str]]:
    """(host, port, parameters) of an ``sc://host:port/;k=v`` URL, refused where it would send
    the token in plain text off this machine, or carries a token of its own."""
    if not remote.startswith("sc://"):
        raise ConnectSetupError(f"Spark Connect URL {remote!r} must start with sc://")
    netloc, _, rest = remote[len("sc://") :].partition("/")
    params = dict(p.split("=", 1) for p in rest.split(";") if "=" in p)
    host, sep, port = netloc.rpartition(":")
    if not sep or not port.isdigit():
        host, port = netloc, "15002"
    if "token" in params:
        raise ConnectSetupError(
            f"the Spark Connect URL carries a token: the token comes from {CONNECT_AUTH_ENV}"
        )
    if host not in LOOPBACK_HOSTS and params.get("use_ssl", "").lower() != "true":
        raise ConnectSetupError(
            f"Spark Connect host {host!r} is not this machine: the token and the tables' keys"
            " would travel in plain text. Put TLS in front of the server and add ;use_ssl=true"
        )
    return host, int(port), params


def build_connect_session(
    remote: str,
    conf: Mapping[str, str] | None = None,
    app_name: str = "cdc_platform",
    auth: ConnectAuth | None = None,
) -> SparkSession:
    """A session on the Spark Connect server at ``remote`` (``sc://host:port``).

    No JVM starts in this process. With ``auth`` (every platform server has it), the client
    presents the token and checks the server's proof before anything else. The settings
    correctness needs are set on the session where a client may set them (time zone, Parquet
    timestamp type, ...); the others (driver JVM time zone, no ``_SUCCESS`` markers) must be
    the server's, and are checked: start the server with
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

    host, port, params = connect_endpoint(remote)
    if auth is None:
        session = SparkSession.builder.appName(app_name).remote(remote).getOrCreate()
    else:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        channel = _trusted_channel(host, port, params, auth.token)
        # What ``SparkSession.builder.remote(url)`` does: pyspark's functions build Connect
        # columns from here on.
        os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
        builder = ConnectSession.builder.appName(app_name).channelBuilder(channel)
        session = cast("SparkSession", builder.getOrCreate())
        _check_proof(session, remote, auth, channel)
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


def _check_proof(session: SparkSession, remote: str, auth: ConnectAuth, channel: Any) -> None:
    """The server computes ``sha256(proof + nonce)`` from its own conf (SQL variable
    substitution); a server without the proof secret cannot, and gets no work. The channel
    trusts its connection from here on, and refuses every call once it drops (a process that
    takes the port then would not have proved anything)."""
    nonce = secrets.token_hex(16)
    before = channel.connections
    row = session.sql(f"SELECT sha2(concat('${{{PROOF_CONF}}}', '{nonce}'), 256) AS p").first()
    want = hashlib.sha256((auth.proof + nonce).encode()).hexdigest()
    proved = row is not None and hmac.compare_digest(str(row[0]), want)
    if not proved or not channel.trust(before):
        session.stop()
        raise ConnectSetupError(
            f"the Spark Connect server at {remote} is not the platform's server of the auth"
            " file (it cannot prove it holds its secret): refusing to send it work"
        )


def connect_session_usable(session: SparkSession) -> bool:
    """False for a Connect session whose proven connection dropped (build a new one)."""
    builder = getattr(getattr(session, "_client", None), "_builder", None)
    return not getattr(builder, "broken", False)


def _trusted_channel(host: str, port: int, params: Mapping[str, str], token: str) -> Any:
    """A Spark Connect channel to exactly ``host:port`` with the token, whose calls are refused
    once the connection the proof was made on has dropped.

    pyspark sends a token without TLS only to the name ``localhost``, which gRPC may resolve to
    ``::1`` first, where any local user can listen while the server binds 127.0.0.1: this
    channel dials the address as given (``localhost`` means 127.0.0.1), with gRPC local
    credentials (the peer must be on this machine) or TLS (``use_ssl=true``)."""
    import grpc
    from pyspark.sql.connect.client import DefaultChannelBuilder

    target = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
    if host == "localhost":
        target = f"{LOOPBACK}:{port}"
    tls = params.get("use_ssl", "").lower() == "true"
    extra = "".join(f";{k}={v}" for k, v in params.items() if k != "use_ssl")

    class TrustedChannel(DefaultChannelBuilder):
        def __init__(self) -> None:
            super().__init__(f"sc://{target}/{extra}")
            self.connections = 0  # times the channel became READY
            self.ready = False
            self.trusted: int | None = None  # the connection the proof was answered on
            self.broken = False

        def trust(self, before: int) -> bool:
            """Trust the connection the proof was answered on, if it is still the one."""
            deadline = time.monotonic() + 2  # the state callbacks come from gRPC's thread
            while not self.ready and time.monotonic() < deadline:
                time.sleep(0.01)
            if not self.ready or self.connections != max(before, 1):
                return False
            self.trusted = self.connections
            return True

        def _state(self, state: grpc.ChannelConnectivity) -> None:
            self.ready = state == grpc.ChannelConnectivity.READY
            self.connections += self.ready
            if self.trusted is not None and (not self.ready or self.connections != self.trusted):
                self.broken = True

        def check(self) -> None:
            if self.broken:
                raise ConnectSetupError(
                    f"the connection to the Spark Connect server at {target} dropped after it"
                    " proved itself: no call goes to whatever listens there now"
                )

        def toChannel(self) -> grpc.Channel:
            creds = grpc.ssl_channel_credentials() if tls else grpc.local_channel_credentials()
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token)
            )
            raw = grpc.secure_channel(target, creds, options=self._channel_options)
            raw.subscribe(self._state, try_to_connect=False)
            return grpc.intercept_channel(raw, _guard(self.check), *self._interceptors)

    return TrustedChannel()


def _guard_class() -> type:
    import grpc

    class Guard(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
        grpc.StreamStreamClientInterceptor,
    ):
        """Runs ``check`` before every call of the channel (it raises to refuse the call)."""

        def __init__(self, check: Any) -> None:
            self.check = check

        def _intercept(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
            """Every kind of call alike (grpc passes a request or, streaming, an iterator)."""
            self.check()
            return continuation(client_call_details, request)

        intercept_unary_unary = intercept_unary_stream = _intercept  # type: ignore[assignment]
        intercept_stream_unary = intercept_stream_stream = _intercept  # type: ignore[assignment]

    return Guard


def _guard(check: Any) -> Any:
    """An interceptor running ``check`` first (the class is built where grpc is imported)."""
    return _guard_class()(check)
