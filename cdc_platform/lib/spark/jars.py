"""Java jars Spark needs beyond pyspark's own, fetched once and used by file.

``cdc_platform/jars.lock`` pins each jar (Maven coordinate, sha256, size) in a set: ``delta``
(Delta's JVM library, for sessions that read or maintain the tables with delta-spark) and ``s3``
(hadoop-aws and its AWS SDK, for Spark on ``s3a://``). ``fetch`` downloads them from Maven
Central into the project's jar folder and checks every checksum; sessions are then given the
files (``spark.jars``), so no run touches the network and an air-gapped machine can be handed
the folder (docs/engines.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import sys
import tempfile
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cdc_platform.lib.errors import PlatformError

JarSet = Literal["delta", "s3"]
JAR_SETS: tuple[JarSet, ...] = ("delta", "s3")
LOCK_FILE = Path(__file__).resolve().parents[2] / "jars.lock"
JARS_DIR_ENV = "CDC_JARS_DIR"
MAVEN_REPO_ENV = "CDC_MAVEN_REPO"
MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2"
# The checkout's own folder (git-ignored) unless the deployment names another.
DEFAULT_JARS_DIR = Path(__file__).resolve().parents[3] / ".jars"


class JarsMissingError(PlatformError, RuntimeError):
    """A feature needs jars that are not in the jar folder; the message says what to run."""


@dataclass(frozen=True)
class Jar:
    jar_set: JarSet
    group: str
    artifact: str
    version: str
    sha256: str
    size: int

    @property
    def file_name(self) -> str:
        return f"{self.artifact}-{self.version}.jar"

    def url(self, repo: str) -> str:
        return f"{repo.rstrip('/')}/{self.group.replace('.', '/')}/{self.artifact}/{self.version}/{self.file_name}"


def locked(jar_sets: Iterable[JarSet] = JAR_SETS, lock_file: Path = LOCK_FILE) -> list[Jar]:
    """The lock file's jars of ``jar_sets``."""
    wanted = set(jar_sets)
    jars = []
    for line in lock_file.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        jar_set, coordinate, sha256, size = line.split("\t")
        group, artifact, version = coordinate.split(":")
        if jar_set not in JAR_SETS:
            raise ValueError(f"{lock_file}: unknown jar set {jar_set!r}")
        if jar_set in wanted:
            jars.append(Jar(jar_set, group, artifact, version, sha256, int(size)))  # type: ignore[arg-type]
    return jars


def jars_dir() -> Path:
    return Path(os.environ.get(JARS_DIR_ENV) or DEFAULT_JARS_DIR)


def paths(jar_sets: Iterable[JarSet], folder: Path | None = None) -> list[Path]:
    """The files of ``jar_sets`` in the jar folder, or ``JarsMissingError`` naming the command
    that fetches them. A file of the wrong size is as good as missing (an interrupted copy);
    checksums are checked when fetching, not at every session start."""
    folder = folder or jars_dir()
    jars = locked(jar_sets)
    writable = [folder / j.file_name for j in jars if _writable_by_others(folder / j.file_name)]
    if writable or _writable_by_others(folder):
        raise JarsMissingError(
            f"{folder}: jars (or their folder) that other users can write are not loaded into"
            " the driver, which holds decrypted rows and credentials: `chmod go-w` them, then"
            " `python -m cdc_platform.lib.spark.jars verify`"
        )
    missing = [j for j in jars if not _complete(folder / j.file_name, j)]
    if missing:
        names = ", ".join(sorted({j.jar_set for j in missing}))
        raise JarsMissingError(
            f"Spark needs the {names} jars, not found in {folder}: run `make jars` "
            f"(or `python -m cdc_platform.lib.spark.jars fetch`; {JARS_DIR_ENV} names another folder)"
        )
    return [folder / j.file_name for j in jars]


def available(jar_sets: Iterable[JarSet], folder: Path | None = None) -> bool:
    try:
        paths(jar_sets, folder)
    except JarsMissingError:
        return False
    return True


def fetch(
    jar_sets: Iterable[JarSet] = JAR_SETS, folder: Path | None = None, repo: str | None = None
) -> list[Path]:
    """Download the jars of ``jar_sets`` that the folder lacks; each must match its sha256
    before it is moved into place (a failed or tampered download leaves nothing behind)."""
    folder = folder or jars_dir()
    repo = repo or os.environ.get(MAVEN_REPO_ENV) or MAVEN_CENTRAL
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # whatever the umask: a session refuses a folder others can write
    out = []
    for jar in locked(jar_sets):
        target = folder / jar.file_name
        if not (_complete(target, jar) and _sha256(target) == jar.sha256):
            _download(jar, repo, target)
        out.append(target)
    return out


def _complete(path: Path, jar: Jar) -> bool:
    return path.is_file() and path.stat().st_size == jar.size and os.access(path, os.R_OK)


def _writable_by_others(path: Path) -> bool:
    return path.exists() and bool(path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def verify(jar_sets: Iterable[JarSet] = JAR_SETS, folder: Path | None = None) -> list[Path]:
    """Every jar of ``jar_sets`` present and matching its locked sha256 (for a folder copied
    to an air-gapped machine; sessions check only sizes, to start fast)."""
    files = paths(jar_sets, folder)
    for jar, path in zip(locked(jar_sets), files, strict=True):
        if _sha256(path) != jar.sha256:
            raise JarsMissingError(f"{path}: sha256 is not the locked {jar.sha256}: fetch it again")
    return files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(jar: Jar, repo: str, target: Path) -> None:
    url = jar.url(repo)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{jar.file_name}.")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            for block in iter(lambda: response.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != jar.sha256:
            raise RuntimeError(
                f"{url}: sha256 {digest.hexdigest()} is not the locked {jar.sha256}; not used"
            )
        tmp.chmod(0o644)  # readable by the account that runs the platform, writable by none
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_platform.lib.spark.jars",
        description="Fetch (or verify, or list) the jars pinned in cdc_platform/jars.lock.",
    )
    parser.add_argument("command", choices=["fetch", "verify", "path"])
    parser.add_argument("sets", nargs="*", metavar="{delta,s3}", help="default: every set")
    args = parser.parse_args(argv)
    unknown = set(args.sets) - set(JAR_SETS)
    if unknown:
        parser.error(f"unknown jar sets {sorted(unknown)}; choose from {list(JAR_SETS)}")
    jar_sets: list[JarSet] = args.sets or list(JAR_SETS)
    try:
        command = {"fetch": fetch, "verify": verify, "path": paths}[args.command]
        files = command(jar_sets)
    except (JarsMissingError, RuntimeError, OSError) as e:
        print(e, file=sys.stderr)
        return 1
    if args.command != "path":
        total = sum(f.stat().st_size for f in files) / 1e6
        print(f"{len(files)} jars ({', '.join(jar_sets)}), {total:.0f} MB, in {jars_dir()}")
    else:
        print(",".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
