"""The Dagster UI with 200 tables: what a person sees on the Jobs, Automation and asset pages.

Writes a config with ``--tables`` tables (every third with a current table), starts
``dagster-webserver`` on 127.0.0.1 against it (a throw-away DAGSTER_HOME with the project's
dagster.yaml; no daemon, so no sensor ticks and no runs), prints what the code location
defines (jobs the UI lists, sensors, schedules, asset groups) and takes a screenshot of each
page with headless Chromium (Debian: ``apt-get install -y chromium``). Look at the PNGs.

Run: ``.venv/bin/python -m benchmarks.ui_at_scale [--tables 200] [--out /tmp/ui_at_scale]``;
``--serve`` keeps the server up afterwards for a look in a browser (Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.deployment import graphql, wait_until_loaded
from benchmarks.harness.generate import table_names
from benchmarks.harness.table import REPO_ROOT
from cdc_platform import connect_server
from cdc_platform.lib.config import CONFIG_ENV_VAR

LOCATION = "/locations/cdc_platform.definitions"
# Page name -> path in the UI (Dagster 1.13); {table} is the config's first table.
PAGES = {
    "jobs": "/jobs",
    "automation": "/automation",  # sensors and schedules, one list
    "asset_catalog": "/assets",
    "asset_lineage": "/asset-groups",  # the global asset graph
    "asset": "/assets/{table}",
    "sensor": LOCATION + "/sensors/{table}_landing_sensor",
    "schedule": LOCATION + "/schedules/{table}_maintenance_schedule",
    "launchpad_maintenance": LOCATION + "/jobs/table_maintenance/playground",
    "launchpad_merge_plan": LOCATION + "/jobs/merge_plan/playground",
}


def write_config(folder: Path, n: int) -> Path:
    config = folder / "cdc_platform.yaml"
    tables = [
        {
            "name": name,
            "primary_key": ["id"],
            "start": "2024-01-01-00:00",
            **({"current_table": True} if i % 3 == 0 else {}),
        }
        for i, name in enumerate(table_names(n))
    ]
    config.write_text(
        yaml.safe_dump(
            {
                "landing_root": str(folder / "landing"),
                "warehouse_root": str(folder / "warehouse"),
                "tables": tables,
            },
            sort_keys=False,
        )
    )
    (folder / "landing").mkdir(exist_ok=True)
    return config


REPOSITORY_QUERY = """
query { repositoriesOrError { ... on RepositoryConnection { nodes {
  jobs { name isAssetJob }
  sensors { name }
  schedules { name }
  assetGroups { groupName }
  assetNodes { assetKey { path } }
} } } }"""


def summary(base: str) -> dict[str, Any]:
    (repo,) = graphql(base, REPOSITORY_QUERY)["repositoriesOrError"]["nodes"]
    # The UI hides Dagster's implicit asset jobs (__ASSET_JOB, __anonymous_asset_job_*).
    listed = sorted(j["name"] for j in repo["jobs"] if not j["name"].startswith("__"))
    return {
        "jobs listed": listed,
        "jobs (all, with hidden asset jobs)": len(repo["jobs"]),
        "sensors": len(repo["sensors"]),
        "schedules": len(repo["schedules"]),
        "asset groups": sorted(g["groupName"] for g in repo["assetGroups"]),
        "assets": len(repo["assetNodes"]),
    }


def screenshot(chromium: str, url: str, png: Path, profile: Path) -> float:
    started = time.monotonic()
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # root in a container has no user namespaces
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            "--window-size=1600,1000",
            "--virtual-time-budget=20000",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "ui_at_scale")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--serve", action="store_true", help="keep the server up afterwards")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="ui_at_scale_") as tmp_text:
        tmp = Path(tmp_text)
        home = tmp / "dagster_home"
        home.mkdir()
        shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
        config = write_config(tmp, args.tables)
        port = connect_server.free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "DAGSTER_HOME": str(home), CONFIG_ENV_VAR: str(config)}
        env.pop("CDC_ALERT_WEBHOOK_URL", None)
        log = tmp / "webserver.log"
        started = time.monotonic()
        with log.open("wb") as log_file:
            proc = subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("dagster-webserver")),
                    *("-h", "127.0.0.1", "-p", str(port)),
                    *("-w", str(REPO_ROOT / "workspace.yaml")),
                ],
                cwd=REPO_ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_until_loaded(base, proc, log)
            print(
                f"{args.tables} tables: code location loaded in {time.monotonic() - started:.1f} s"
            )
            # The "Join the Dagster community" dialog (shown on 127.0.0.1) would cover each page.
            graphql(base, "mutation { setNuxSeen }")
            for name, value in summary(base).items():
                print(f"  {name}: {value}")
            first = table_names(args.tables)[0]
            for name, page in PAGES.items():
                path = page.format(table=first)
                png = args.out / f"{name}.png"
                seconds = screenshot(args.chromium, base + path, png, tmp / "chromium")
                print(f"  {png} ({path}, {seconds:.1f} s)")
            if args.serve:
                print(f"serving {base} (Ctrl-C stops it)")
                proc.wait()
        except KeyboardInterrupt:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its children
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)


if __name__ == "__main__":
    main()
