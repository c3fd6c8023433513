"""Other users of the same machine: secret settings never reach a command line (which
any local user can read), Java properties files read back exactly as given, the package zip the
executors import is never one another user planted, the Spark Connect server's auth file is
private, and ``stop`` never signals a process that is not the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cdc_platform import connect_server
from cdc_platform.lib.spark.connect import ConnectAuth, ConnectSetupError


def test_the_auth_file_is_private_and_renewed_at_each_start(tmp_path):
    path = tmp_path / "auth.json"
    first = ConnectAuth.renew(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert ConnectAuth.load(path) == first
    second = ConnectAuth.renew(path)
    assert second.token != first.token and second.proof != first.proof
    assert first.token not in repr(first) and first.proof not in repr(first)
    path.chmod(0o644)
    with pytest.raises(ConnectSetupError, match="mode 600") as refused:
        ConnectAuth.load(path)
    assert second.token not in str(refused.value)
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(ConnectSetupError):
        ConnectAuth.load(link)


def test_stop_never_signals_a_process_that_is_not_the_server(tmp_path):
    """A stale pid file whose pid now belongs to another process (here a `sleep`, and this
    very test process): stop leaves it alone and says nothing was running."""
    port = connect_server.free_port()
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (bystander.pid, os.getpid()):
            connect_server.pid_file(tmp_path, port).write_text(f"{pid}\n")
            assert connect_server.server_pid(tmp_path, port) is None
            assert connect_server.stop(port, tmp_path) is False
            assert not connect_server.pid_file(tmp_path, port).exists()
        time.sleep(0.2)
        assert bystander.poll() is None  # still running: never signalled
    finally:
        bystander.kill()
        bystander.wait()


SECRET_PROBE = """
import os
from pathlib import Path
from cdc_platform.lib.spark.session import build_spark_session
secret = os.environ.pop("PROBE_SECRET")
session = build_spark_session(
    "local[1]", {"spark.hadoop.fs.s3a.secret.key": secret, "spark.ui.retainedJobs": "7"}, "probe"
)
lines = []
for proc in Path("/proc").iterdir():
    try:
        lines.append((proc / "cmdline").read_bytes().replace(b"\\0", b" ").decode())
    except (OSError, ValueError):
        pass
conf = session.sparkContext.getConf()
print("conf", conf.get("spark.hadoop.fs.s3a.secret.key") == secret, conf.get("spark.ui.retainedJobs"))
print("jvms", sum("SparkSubmit" in c for c in lines), "leaks", sum(secret in c for c in lines))
session.stop()
"""


def test_secret_settings_never_reach_a_command_line():
    """pyspark puts builder settings on the spark-submit and java command lines, which every
    local user reads with ``ps``: secret settings reach the JVM in a private properties file."""
    secret = "s3-secret-" + os.urandom(8).hex()
    out = subprocess.run(
        [sys.executable, "-c", SECRET_PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "PROBE_SECRET": secret,  # the environment: only this user reads it
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "conf True 7" in out.stdout  # the JVM has both settings
    jvms, leaks = out.stdout.split("jvms ")[1].split(" leaks ")
    assert int(jvms) >= 1 and int(leaks) == 0, out.stdout
    assert secret not in out.stderr


def _planted_zip(path: Path) -> bytes:
    """A package zip another local user could have put at ``path``: its code would run on
    every executor."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("cdc_platform/__init__.py", "PLANTED = True\n")
    return path.read_bytes()


def _is_the_real_package(path: Path) -> bool:
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        return "cdc_platform/lib/spark/session.py" in names and b"PLANTED" not in z.read(
            "cdc_platform/__init__.py"
        )


def test_the_shipped_package_zip_is_never_one_another_user_planted(tmp_path, monkeypatch):
    """The zip executors import the platform from is built in a folder only this user can
    write: a file at its name in the shared temporary folder, or in a folder of that name
    whose mode lets others in or that is a symlink, is never shipped."""
    import tempfile

    from cdc_platform.lib.spark import session as spark_lib

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    name = spark_lib.package_zip(elsewhere).name
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    planted = _planted_zip(shared / name)  # the old, predictable path

    got = spark_lib.package_zip()
    assert got != shared / name
    private = shared / f"cdc_platform-{os.getuid()}"
    assert got == private / name and _is_the_real_package(got)
    st = private.stat()
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert (shared / name).read_bytes() == planted  # untouched, and never used

    # A folder of the private name that others could write: its zip is not reused.
    private.chmod(0o777)
    _planted_zip(got)
    other = spark_lib.package_zip()
    assert other.parent != private and _is_the_real_package(other)
    assert other.parent.stat().st_mode & 0o777 == 0o700

    # The private name as a symlink to a folder of planted files: not followed.
    decoy = tmp_path / "decoy"
    decoy.mkdir(mode=0o700)
    _planted_zip(decoy / name)
    (private / name).unlink()
    private.rmdir()
    private.symlink_to(decoy)
    third = spark_lib.package_zip()
    assert third.parent not in (private, decoy) and _is_the_real_package(third)


def test_the_connect_servers_settings_never_reach_its_command_line(tmp_path):
    """``connect_server start --conf`` settings (an object store's keys), the master's URL and
    the auth secrets reach the server in a mode-600 file in a mode-700 folder; its command line
    (``ps`` shows it to every local user) holds only the file's path and the port."""
    secret, key_id = "s3-secret-" + os.urandom(8).hex(), "AKIA" + os.urandom(6).hex()
    master = "spark://user:master-pw-" + os.urandom(4).hex() + "@127.0.0.1:7077"
    conf = {
        "spark.hadoop.fs.s3a.secret.key": secret,
        "spark.hadoop.fs.s3a.access.key": key_id,
        "spark.hadoop.fs.s3a.endpoint": "http://minio.internal:9000",
    }
    state = tmp_path / "state"
    (state / "private").mkdir(parents=True, mode=0o755)  # an earlier, wider folder: tightened
    (state / "server.properties").write_text("left by an earlier version\n")
    port = connect_server.free_port()
    args = connect_server.server_command(port, master=master, conf=conf, state_dir=state)

    props = connect_server.properties_file(state.resolve())
    auth = json.loads(connect_server.auth_file(state).read_text())
    assert args[args.index("--properties-file") + 1] == str(props)
    assert [a for i, a in enumerate(args) if args[i - 1] == "--conf"] == [
        f"spark.connect.grpc.binding.port={port}"
    ]
    assert "--master" not in args
    line = " ".join(args)
    for value in [secret, key_id, master, "minio.internal", auth["token"], auth["proof"]]:
        assert value not in line
    text = props.read_text()
    for value in [secret, key_id, f"spark.master={master}", auth["token"], auth["proof"]]:
        assert value in text
    assert props.stat().st_mode & 0o777 == 0o600 and props.stat().st_uid == os.getuid()
    assert props.parent.stat().st_mode & 0o777 == 0o700
    assert not (state / "server.properties").exists()

    # A private folder that is a symlink (someone else's folder, say) is refused.
    props.unlink()
    props.parent.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    props.parent.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match="not a symlink"):
        connect_server.server_command(port, conf=conf, state_dir=state)
    assert not any(elsewhere.iterdir())


def test_a_properties_file_reads_back_every_key_and_value_as_given(spark):
    """``properties_text`` escapes what Java's ``Properties`` would read otherwise (the JVM's
    own parser reads it back here)."""
    from cdc_platform.lib.spark.session import properties_text

    settings = {
        "spark.a": "plain",
        "spark.b": " leading space",
        "spark.c": "back\\slash = and: colon # hash",
        "spark.d": "line\nbreak\rreturn",
        "odd key=with:all #the !marks\tand tab": "v",
        "#comment-like": "x",
        "!bang": "y",
        " spaced": "z",
        "spark.e": "",
    }
    jvm = spark.sparkContext._jvm
    props = jvm.java.util.Properties()
    props.load(jvm.java.io.StringReader(properties_text(settings)))
    assert {k: props.getProperty(k) for k in settings} == settings
    assert props.size() == len(settings)
