"""`make demo-s3`: the demo with its landing zone in a bucket of a local S3 server.

moto's S3 server (a dev dependency) runs on a free loopback port for the length of the demo;
the config is the demo's own with ``landing_root: s3://demo-landing/cdc`` and its
``landing_storage_options`` (the secret read from the environment, as a deployment's would be),
and the warehouse in ``data/warehouse-s3``. The demo then generates the sample files, uploads
them to the bucket and materializes every table from there (``demo.run``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cdc_platform.lib.config import REPO_ROOT

BUCKET = "demo-landing"
SECRET_ENV = "CDC_DEMO_S3_SECRET"


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_s3_server() -> Iterator[str]:
    """moto's S3 server on a free loopback port, in a process of its own; yields its endpoint.

    Not moto's ThreadedMotoServer inside the calling process: a delta-rs call that holds the
    GIL while it waits for the server (arro3's ``read_all`` does) would wait for ever on a
    server thread that needs the GIL to answer."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def demo_config(endpoint: str, folder: Path) -> Path:
    """The demo's config with its landing zone in the bucket; written to ``folder``."""
    text = (REPO_ROOT / "cdc_platform.yaml").read_text()
    landing = (
        f"landing_root: s3://{BUCKET}/cdc\n"
        "landing_storage_options:\n"
        f"  aws_endpoint_url: {endpoint}\n"
        "  aws_region: us-east-1\n"
        "  aws_access_key_id: demo\n"
        f"  aws_secret_access_key: {{env: {SECRET_ENV}}}\n"
    )
    for old, new in (
        ("landing_root: data/landing\n", landing),
        # Beside the demo's own warehouse: the config is in data/, and a relative path
        # resolves against the config's folder.
        ("warehouse_root: data/warehouse", "warehouse_root: warehouse-s3"),
    ):
        if old not in text:
            raise SystemExit(f"cdc_platform.yaml no longer says {old.strip()!r}: update {__file__}")
        text = text.replace(old, new)
    path = folder / "demo-s3.yaml"
    path.write_text(text)
    return path


def main() -> None:
    import boto3

    with local_s3_server() as endpoint:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="demo",
            aws_secret_access_key="demo",
        ).create_bucket(Bucket=BUCKET)
        data = REPO_ROOT / "data"
        data.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "CDC_PLATFORM_CONFIG": str(demo_config(endpoint, data)),
            SECRET_ENV: "demo",
        }
        print(f"landing zone: s3://{BUCKET}/cdc on a local S3 server ({endpoint})")
        done = subprocess.run([sys.executable, "-m", "cdc_platform.demo.run"], env=env)
    raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
