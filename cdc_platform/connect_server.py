"""Start and stop a Spark Connect server for the platform, from the installed pyspark package.

    python -m cdc_platform.connect_server start [--port 15002] [--master local[2]]
    python -m cdc_platform.connect_server status
    python -m cdc_platform.connect_server stop

``start`` runs the server class through ``pyspark/sbin/spark-daemon.sh`` (the Connect jar ships in
``pyspark/jars``) on loopback only, with the settings correctness needs (``lib.spark.session``: UTC,
TIMESTAMP_MICROS, no ``_SUCCESS`` files, exact column names), and returns once the server
accepts connections. Its Python workers run this interpreter with this package importable, so
``mapInArrow`` tasks (the landing-file decoders) can import ``cdc_platform``. Then point the
``spark`` resource at it: ``CDC_SPARK_REMOTE=sc://127.0.0.1:15002`` and
``CDC_SPARK_CONNECT_AUTH=<state-dir>/auth.json``.

Every start writes new secrets to ``<state-dir>/auth.json`` (mode 600, ``lib.spark.connect.ConnectAuth``):
the token clients must present, and the proof the server gives them before they send it work.
The server takes them, and every other setting (the ``--conf`` ones, which may hold an object
store's keys, and the master's URL), from ``<state-dir>/private/server.properties`` (mode 600, in
a folder of mode 700), never its command line, which every local user can read (``ps``): that
holds the file's path and the port only. A host other than loopback is refused unless
``--allow-remote-clients`` says TLS is in front (docs/SECURITY.md).

The pid file and the server's log live in ``--state-dir`` (default ``.spark-connect``); ``stop``
signals the pid only if its command line is this server's, on this port.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from cdc_platform.lib.spark.connect import ConnectAuth, connect_server_conf
from cdc_platform.lib.spark.session import LOOPBACK_HOSTS, check_java, properties_text

DEFAULT_PORT = 15002
DEFAULT_HOST = "127.0.0.1"
DEFAULT_STATE_DIR = ".spark-connect"
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
REPO_ROOT = Path(__file__).resolve().parent.parent


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _env(state_dir: Path, port: int) -> dict[str, str]:
    pythonpath = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_PID_DIR": str(state_dir),
        "SPARK_LOG_DIR": str(state_dir / "logs"),
        "SPARK_IDENT_STRING": f"cdc_platform-{port}",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": ":".join(dict.fromkeys(pythonpath)),
        "TZ": "UTC",
    }


def pid_file(state_dir: Path, port: int) -> Path:
    # spark-daemon.sh's name for it: spark-<ident>-<class>-<instance>.pid
    return Path(state_dir) / f"spark-cdc_platform-{port}-{SERVER_CLASS}-1.pid"


def auth_file(state_dir: Path | str) -> Path:
    """The secrets clients read (``CDC_SPARK_CONNECT_AUTH``)."""
    return Path(state_dir) / "auth.json"


def properties_file(state_dir: Path | str) -> Path:
    """The server's settings, its secrets among them (mode 600, in a folder of mode 700)."""
    return Path(state_dir) / "private" / "server.properties"


def _private_folder(folder: Path) -> Path:
    """``folder``, created with mode 700, refused unless it is a real folder of this user's,
    and made 700 again if its mode was wider."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{folder} must be a folder of this user (not a symlink)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


def server_command(
    port: int = DEFAULT_PORT,
    host: str = DEFAULT_HOST,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    state_dir: Path | str = DEFAULT_STATE_DIR,
    driver_memory: str = "2g",
) -> list[str]:
    """The command that starts the server (``spark-daemon.sh submit``), after writing its
    settings to ``properties_file`` and new secrets to the auth file.

    Every setting is in the file, none on the command line (``ps`` shows it to every local
    user): ``--conf`` values may be an object store's keys, and a master's URL may carry
    credentials. The line holds the file's path and the port (``stop`` recognises the server
    by it). The deployment's ``spark-defaults.conf`` still applies beneath the file."""
    state = Path(state_dir).resolve()
    settings = {
        **connect_server_conf(master, conf),
        "spark.connect.grpc.binding.address": host,
        "spark.driver.memory": driver_memory,
        "spark.driver.host": host,
        "spark.driver.bindAddress": host,
    }
    (state / "server.properties").unlink(missing_ok=True)  # where earlier versions kept it
    props = properties_file(state)
    _private_folder(props.parent)
    props.unlink(missing_ok=True)
    fd = os.open(props, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(properties_text(settings))
        f.write(ConnectAuth.renew(auth_file(state)).server_properties())
    # What Spark's sbin/start-connect-server.sh does (pyspark 4.2's wheel ships no such script).
    daemon = spark_home() / "sbin" / "spark-daemon.sh"
    args = [str(daemon), "submit", SERVER_CLASS, "1", "--name", "Spark Connect server"]
    args += ["--properties-file", str(props), "--load-spark-defaults"]
    args += ["--conf", _port_arg(port)]
    return args


def _port_arg(port: int) -> str:
    return f"spark.connect.grpc.binding.port={port}"


def server_pid(state_dir: Path, port: int) -> int | None:
    """The server's pid if its pid file names a live process of this user that is this server
    on this port (its command line says so): a stale pid file whose pid was reused names none."""
    try:
        pid = int(pid_file(state_dir, port).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _is_our_server(pid, port) else None


def _is_our_server(pid: int, port: int) -> bool:
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = {a.decode(errors="replace") for a in cmdline}
    return owner == os.getuid() and SERVER_CLASS in args and _port_arg(port) in args


def _signal(pid: int, port: int, sig: signal.Signals) -> bool:
    """Signal ``pid`` only if it is still the server: through a pidfd, so the pid cannot be
    reused between the check and the signal."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if not _is_our_server(pid, port):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def log_files(state_dir: Path) -> list[Path]:
    return sorted((Path(state_dir) / "logs").glob("*.out"))


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(
    port: int = DEFAULT_PORT,
    host: str = DEFAULT_HOST,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    state_dir: Path | str = DEFAULT_STATE_DIR,
    driver_memory: str = "2g",
    timeout: float = 180.0,
    allow_remote_clients: bool = False,
) -> str:
    """Start the server (if it is not already running) and return its ``sc://`` URL.

    A host other than loopback is refused unless ``allow_remote_clients``: the token travels in
    every call, so remote clients need TLS in front of the server (docs/SECURITY.md)."""
    if host not in LOOPBACK_HOSTS and not allow_remote_clients:
        raise ValueError(
            f"--host {host} lets other machines reach the server: put TLS in front of it and"
            " pass --allow-remote-clients (docs/SECURITY.md)"
        )
    check_java()
    state = Path(state_dir).resolve()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    url = f"sc://{host}:{port}"
    if server_pid(state, port) is not None and _listening(host, port):
        return url
    if _listening(host, port):
        raise RuntimeError(f"port {host}:{port} is in use by another process")
    args = server_command(port, host, master, conf, state, driver_memory)
    subprocess.run(args, env=_env(state, port), check=True, stdout=subprocess.DEVNULL)
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if _listening(host, port):
            return url
        if time.monotonic() - started > 5 and server_pid(state, port) is None:
            break  # the daemon died (its pid file names no live process)
        time.sleep(0.5)
    tail = "".join(p.read_text(errors="replace")[-3000:] for p in log_files(state))
    stop(port, state)
    raise RuntimeError(f"Spark Connect server did not come up on {url}; its log ends:\n{tail}")


def stop(port: int = DEFAULT_PORT, state_dir: Path | str = DEFAULT_STATE_DIR) -> bool:
    """Stop the server this state dir started on ``port``; True if one was running. A pid is
    signalled only while its command line is this server's on this port (``server_pid``)."""
    state = Path(state_dir).resolve()
    pid = server_pid(state, port)
    if pid is None:
        pid_file(state, port).unlink(missing_ok=True)  # stale: its pid is no server of ours
        return False
    _signal(pid, port, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server_pid(state, port) == pid:
        time.sleep(0.3)
    if server_pid(state, port) == pid:
        _signal(pid, port, signal.SIGKILL)
    pid_file(state, port).unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cdc_platform.connect_server")
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (loopback by default)")
    parser.add_argument(
        "--allow-remote-clients",
        action="store_true",
        help="allow a non-loopback --host (only with TLS in front of the server)",
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark conf, given to the server in its private properties file (this"
        " command's own line shows it while it runs: keep secrets in spark-defaults.conf)",
    )
    args = parser.parse_args(argv)
    if args.command == "start":
        conf = dict(c.split("=", 1) for c in args.conf)
        url = start(
            args.port,
            args.host,
            args.master,
            conf,
            args.state_dir,
            args.driver_memory,
            allow_remote_clients=args.allow_remote_clients,
        )
        auth = auth_file(Path(args.state_dir).resolve())
        print(f"Spark Connect server running: CDC_SPARK_REMOTE={url} CDC_SPARK_CONNECT_AUTH={auth}")
    elif args.command == "stop":
        print("stopped" if stop(args.port, args.state_dir) else "not running")
    else:
        pid = server_pid(Path(args.state_dir), args.port)
        print(f"running (pid {pid}) on port {args.port}" if pid else "not running")
        return 0 if pid else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
