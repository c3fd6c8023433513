"""Start and stop a Spark Connect server for the platform, from the installed pyspark package.

    python -m cdc_platform.connect_server start [--port 15002] [--master local[2]]
    python -m cdc_platform.connect_server status
    python -m cdc_platform.connect_server stop

``start`` runs ``pyspark/sbin/start-connect-server.sh`` (the Connect jar ships in
``pyspark/jars``) on loopback only, with the settings correctness needs (``lib.spark``: UTC,
TIMESTAMP_MICROS, no ``_SUCCESS`` files, exact column names), and returns once the server
accepts connections. Its Python workers run this interpreter with this package importable, so
``mapInArrow`` tasks (the landing-file decoders) can import ``cdc_platform``. Then point the
``spark`` resource at it: ``CDC_SPARK_REMOTE=sc://127.0.0.1:15002``.

The pid file and the server's log live in ``--state-dir`` (default ``.spark-connect``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from cdc_platform.lib.spark import check_java, connect_server_conf

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


def server_pid(state_dir: Path, port: int) -> int | None:
    """The server's pid if its pid file names a live process."""
    try:
        pid = int(pid_file(state_dir, port).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


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
) -> str:
    """Start the server (if it is not already running) and return its ``sc://`` URL."""
    check_java()
    state = Path(state_dir).resolve()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    url = f"sc://{host}:{port}"
    if server_pid(state, port) is not None and _listening(host, port):
        return url
    if _listening(host, port):
        raise RuntimeError(f"port {host}:{port} is in use by another process")
    settings = {
        **connect_server_conf(master, conf),
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        "spark.driver.memory": driver_memory,
        "spark.driver.host": host,
        "spark.driver.bindAddress": host,
    }
    args = [str(spark_home() / "sbin" / "start-connect-server.sh"), "--master", master]
    for key, value in settings.items():
        args += ["--conf", f"{key}={value}"]
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
    """Stop the server this state dir started on ``port``; True if one was running."""
    state = Path(state_dir).resolve()
    pid = server_pid(state, port)
    if pid is None:
        return False
    script = spark_home() / "sbin" / "stop-connect-server.sh"
    subprocess.run([str(script)], env=_env(state, port), check=False, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            break
        time.sleep(0.3)
    else:
        os.kill(pid, signal.SIGKILL)
    pid_file(state, port).unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cdc_platform.connect_server")
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (loopback by default)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    parser.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark conf"
    )
    args = parser.parse_args(argv)
    if args.command == "start":
        conf = dict(c.split("=", 1) for c in args.conf)
        url = start(args.port, args.host, args.master, conf, args.state_dir, args.driver_memory)
        print(f"Spark Connect server running: CDC_SPARK_REMOTE={url}")
    elif args.command == "stop":
        print("stopped" if stop(args.port, args.state_dir) else "not running")
    else:
        pid = server_pid(Path(args.state_dir), args.port)
        print(f"running (pid {pid}) on port {args.port}" if pid else "not running")
        return 0 if pid else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
