"""Fixed cost per run: `dagster asset materialize` of a 100-event hour, local mode vs Spark Connect.

    python -m benchmarks.connect_fixed_cost [--remote sc://127.0.0.1:15002] [--hours 3]

Builds a throwaway config, landing zone (one 1,000-event hour of history, then 100-event
hours) and Dagster instance under a temp folder. Each measured hour is one whole CLI process,
timed from outside (`time` of the process), alternating local mode (the CLI starts its own
JVM) and Connect mode (`CDC_SPARK_REMOTE` set: the CLI starts no JVM). Without ``--remote``
it starts a Connect server on a free loopback port (warmed up by the history hour) and stops
it at the end. Prints each run's wall time and the asset's own ``seconds`` metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from benchmarks.harness.table import REPO_ROOT
from cdc_platform import connect_server
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform_tests.helpers import event, write_parquet_events

H0 = datetime(2024, 1, 1, tzinfo=UTC)


def make_hour(landing: Path, hour: datetime, n: int, rng: random.Random, seq0: int) -> None:
    rows = []
    for i in range(n):
        ts = hour + timedelta(milliseconds=rng.randrange(3_600_000))
        op = "INSERT" if i % 3 else "UPDATE"
        rows.append(event(op, seq0 + i, ts, rng.randrange(500), status=rng.choice("abc")))
    write_parquet_events(landing, "orders", hour, rows, name="part-0.parquet")


def run_cli(root: Path, partition: str, remote: str | None) -> tuple[float, float | None]:
    env = {
        **os.environ,
        "DAGSTER_HOME": str(root / "dagster_home"),
        "CDC_PLATFORM_CONFIG": str(root / "cdc_platform.yaml"),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("CDC_SPARK_REMOTE", None)
    if remote:
        env["CDC_SPARK_REMOTE"] = remote
        env.setdefault("CDC_SPARK_CONNECT_AUTH", str(REPO_ROOT / ".spark-connect" / "auth.json"))
    dagster = Path(sys.executable).parent / "dagster"
    cmd = [str(dagster), "asset", "materialize", "-m", "cdc_platform.definitions"]
    cmd += ["--select", "orders", "--partition", partition]
    started = time.monotonic()
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=root)
    wall = time.monotonic() - started
    return wall, asset_seconds(root, partition)


def asset_seconds(root: Path, partition: str) -> float | None:
    """The asset's own ``seconds`` metadata of the latest materialization of ``partition``."""
    code = (
        "import dagster as dg, json, sys\n"
        "i = dg.DagsterInstance.get()\n"
        "r = i.fetch_materializations(dg.AssetKey('orders'), limit=1).records[0]\n"
        "m = r.asset_materialization\n"
        "print(json.dumps([m.partition, m.metadata['seconds'].value]))\n"
    )
    env = {**os.environ, "DAGSTER_HOME": str(root / "dagster_home")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        return None
    got_partition, seconds = json.loads(out.stdout)
    return seconds if got_partition == partition else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--remote", help="a running server's sc:// URL (else one is started)")
    parser.add_argument("--hours", type=int, default=3, help="measured hours per mode")
    parser.add_argument("--events", type=int, default=100)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="cdc_connect_bench_"))
    (root / "dagster_home").mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", root / "dagster_home" / "dagster.yaml")
    (root / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: orders\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
    )
    rng = random.Random(3)
    hours = [H0 + timedelta(hours=h) for h in range(1 + 2 * args.hours)]
    make_hour(root / "landing", hours[0], 1000, rng, 1)
    for i, hour in enumerate(hours[1:]):
        make_hour(root / "landing", hour, args.events, rng, 10_000 + i * 1000)

    state = root / "spark-connect"
    port = None
    remote = args.remote
    try:
        if remote is None:
            port = connect_server.free_port()
            t = time.monotonic()
            remote = connect_server.start(port, state_dir=state)
            os.environ["CDC_SPARK_CONNECT_AUTH"] = str(connect_server.auth_file(state))
            print(f"started {remote} in {time.monotonic() - t:.1f} s")
        wall, inside = run_cli(root, hour_to_partition_key(hours[0]), remote)  # warm-up
        print(f"warm-up (1,000 events, connect): {wall:.1f} s, asset {inside} s")
        print(f"{'mode':8} {'partition':18} {'process s':>9} {'asset s':>8}")
        results: dict[str, list[float]] = {"local": [], "connect": []}
        for i, hour in enumerate(hours[1:]):
            mode = "connect" if i % 2 else "local"
            partition = hour_to_partition_key(hour)
            wall, inside = run_cli(root, partition, remote if mode == "connect" else None)
            results[mode].append(wall)
            print(f"{mode:8} {partition:18} {wall:9.1f} {inside if inside is not None else '?':>8}")
        for mode, walls in results.items():
            print(f"{mode}: median process wall {sorted(walls)[len(walls) // 2]:.1f} s")
    finally:
        if port is not None:
            connect_server.stop(port, state)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
