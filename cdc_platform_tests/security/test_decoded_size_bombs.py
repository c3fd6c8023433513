"""Decompression and decoded-size bombs: a landing file that is small on disk and huge
decoded (a ZSTD stream of zeros, Parquet pages, dictionaries, nested and fixed-width values) is
refused having decoded at most the limit, is set aside while the rest of its hour is applied, and
costs a sample, not the process, in discovery; memory stays bounded through the command line."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from cdc_platform.lib.landing.decoding.formats.parquet import parquet_bytes
from cdc_platform.lib.landing.where.layout import (
    hour_folder,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events
from cdc_platform_tests.security.hostile_files import CSV, H5, TABLE, TS, land, logged_keys, reasons

MiB = 1 << 20


def zeros_bomb(expanded: int) -> bytes:
    """A ZSTD frame of zeros: ~32,700:1, with no content size in the header (streamed). Built
    1 MiB at a time, so making it does not raise the peak a memory test measures."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    block = bytes(MiB)
    out = bytearray()
    for _ in range(max(1, expanded // MiB)):
        out += cctx.compress(block)
    return bytes(out + cctx.flush())


def csv_zst(rows: list[tuple[Any, ...]]) -> bytes:
    lines = ["id,v,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp"]
    lines += [",".join(str(c) for c in r) for r in rows]
    return zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode())


def peak_growth_mib(setup: str, work: str) -> float:
    """Run ``setup`` then ``work`` in a Python process of its own and return how far ``work``
    raised that process's peak RSS (the memory a sensor's code server or a reading task would
    hold), in MiB. The growth, not the peak: what the imports cost differs between machines."""
    import subprocess
    import sys

    from cdc_platform.lib.config import REPO_ROOT

    peak = "import resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    script = f"{setup}\n{peak}{work}\n{peak}"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = (int(n) for n in out.stdout.split()[-2:])
    return (after - before) / 1024


def test_a_zstd_bomb_is_refused_having_decoded_at_most_the_limit() -> None:
    """128 MiB of zeros compress to a few kilobytes; the limit stops decoding at 16 MiB, and a
    sample of a stream decodes about what is read, whatever the file expands to."""
    growth = peak_growth_mib(
        "import io\n"
        "from cdc_platform.lib.landing.decoding.codecs import (\n"
        "    LandingFileError, decode_file, open_decoded_stream,\n"
        ")\n"
        "from cdc_platform_tests.security.test_decoded_size_bombs import zeros_bomb\n"
        "bomb = zeros_bomb(128 << 20)\n"
        "assert len(bomb) < 16 * 1024\n",
        "try:\n"
        "    decode_file(io.BytesIO(bomb), 'zstd', 'none', [], max_bytes=16 << 20)\n"
        "    raise SystemExit('not refused')\n"
        "except LandingFileError as exc:\n"
        "    assert 'decodes to more than 16 MiB' in str(exc), exc\n"
        "with open_decoded_stream(io.BytesIO(bomb), 'zstd', 'none', []) as s:\n"
        "    assert s.read(4) == bytes(4)\n",
    )
    # the 16 MiB allowed and a piece of output; 128 MiB of plaintext would show
    assert growth < 64, growth


def test_discovery_samples_a_bomb_without_expanding_it(tmp_path: Path) -> None:
    """The new-tables sensor (and a ``discover:`` config) sniffs a new folder's first file in
    the code server: a 1 MiB file that expands to 32 GiB costs a sample, not the process."""
    landing = tmp_path / "landing"
    folder = hour_folder(landing, "bombs", H5)
    folder.mkdir(parents=True)
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=False)
    with open(folder / "part-1.csv.zst", "wb") as fh, cctx.stream_writer(fh) as w:
        w.write(b"id,v,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n")
        zeros = b"\0" * (64 * MiB)
        for _ in range(512):  # 32 GiB of plaintext, about 1 MiB on disk
            w.write(zeros)
    assert (folder / "part-1.csv.zst").stat().st_size < 4 * MiB
    growth = peak_growth_mib(
        "from cdc_platform.lib.landing import discovery\n",
        f"found = discovery.describe({str(landing)!r}, 'bombs')\n"
        "assert (found.encoding.compression, found.encoding.format) == ('zstd', 'csv')\n",
    )
    assert growth < 64, growth


def test_a_bomb_among_good_files_is_set_aside_and_the_hour_applied(spark, lake) -> None:
    table = replace(CSV, max_file_bytes=8 * MiB)
    land(lake, "good.csv.zst", csv_zst([(1, "a", "INSERT", 1, "2024-01-01T05:01:00Z")]))
    land(lake, "bomb.csv.zst", zeros_bomb(64 * MiB))
    out = materialize(spark, table, lake["landing"], lake["warehouse"], [H5])
    assert out.events_read == 1
    assert "decodes to more than 8 MiB" in reasons(lake)["bomb.csv.zst"]
    assert logged_keys(lake) == [1]


def test_a_parquet_file_whose_row_groups_expand_past_the_limit_is_set_aside(spark, lake) -> None:
    """Parquet's own pages compress as well: the footer's sizes are checked before a page."""
    table = replace(TABLE, max_file_bytes=1 * MiB)
    n = 200_000
    rows = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "v": pa.array(["x" * 20] * n),
            "cdc_operation_type": pa.array(["INSERT"] * n),
            "cdc_change_seq": pa.array(range(n), pa.int64()),
            "cdc_commit_timestamp": pa.array([TS] * n, pa.timestamp("us", tz="UTC")),
        }
    )
    folder = hour_folder(lake["landing"], "t", H5)
    folder.mkdir(parents=True)
    pq.write_table(rows, folder / "big.parquet", compression="zstd")
    assert (folder / "big.parquet").stat().st_size < 1 * MiB
    write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 1, TS, 7, v="ok")], name="ok.parquet"
    )
    out = materialize(spark, table, lake["landing"], lake["warehouse"], [H5])
    assert "decodes to more than 1 MiB" in reasons(lake)["big.parquet"]
    assert out.events_read == 1 and logged_keys(lake) == [7]


def refused_at_16_mib_growing(bomb: Path) -> float:
    """``bomb`` loaded by a reader allowing 16 MiB, in a process of its own: it must be refused
    for its size; how far the load raised the process's peak RSS (MiB)."""
    return peak_growth_mib(
        "from dataclasses import replace\n"
        "from cdc_platform.lib.landing.reading.file_reader import LandingReader\n"
        "from cdc_platform.lib.landing.decoding.codecs import LandingFileError\n"
        "from cdc_platform_tests.security.hostile_files import TABLE\n"
        f"reader = LandingReader(replace(TABLE, max_file_bytes=16 << 20), {str(bomb.parent)!r})\n",
        "try:\n"
        f"    reader.load({str(bomb)!r})\n"
        "    raise SystemExit('decoded')\n"
        "except LandingFileError as exc:\n"
        "    assert 'decodes to more than 16 MiB' in str(exc), exc\n",
    )


def dictionary_bomb(rows: int, width: int = 1000, wide: str = "int64") -> pa.Table:
    """Events whose ``v`` is one ``width``-character string dictionary-encoded over ``rows``
    rows: a few MB on disk, a footer of about the same, ``rows * width`` bytes decoded. With
    ``wide="uint64"`` Spark cannot read it natively and it is decoded in Python."""
    return pa.table(
        {
            "id": pa.array(range(rows), pa.type_for_alias(wide)),
            "v": pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), ["x" * width]),
            "cdc_operation_type": pa.array(["INSERT"]).take(pa.array([0] * rows)),
            "cdc_change_seq": pa.array(range(rows), pa.int64()),
            "cdc_commit_timestamp": pa.array([TS] * rows, pa.timestamp("us", tz="UTC")),
        }
    )


def test_a_dictionary_bomb_is_refused_having_decoded_at_most_the_limit(tmp_path: Path) -> None:
    """A footer is the writer's word: 300,000 rows of one 1,000-character string pass the
    footer check (a few MB) and decode to 300 MB. The reader counts what the rows decode to,
    batch by batch, and stops at ``max_file_bytes`` having held about that much at most."""
    bomb = tmp_path / "bomb.parquet"
    pq.write_table(dictionary_bomb(300_000, wide="uint64"), bomb)
    footer = pq.ParquetFile(bomb).metadata
    assert parquet_bytes(footer) < 16 * MiB and bomb.stat().st_size < 4 * MiB
    assert refused_at_16_mib_growing(bomb) < 64


def nested_bomb(kind: str) -> pa.Table:
    """About 300 MB decoded in a few kB: one row listing a 1,000-character dictionary string
    300,000 times, 3,000 structs holding one 100 kB dictionary string, or 3,000 dictionary-
    encoded 100 kB fixed-size binaries."""
    if kind == "list":
        text = pa.DictionaryArray.from_arrays(pa.array([0] * 300_000, pa.int32()), ["x" * 1000])
        column: pa.Array = pa.ListArray.from_arrays(pa.array([0, 300_000], pa.int32()), text)
    else:
        value = "y" * 100_000
        inner = pa.DictionaryArray.from_arrays(pa.array([0] * 3000, pa.int32()), [value])
        if kind == "struct":
            column = pa.StructArray.from_arrays([inner], ["s"])
        else:
            column = pa.array([value.encode()] * 3000, pa.binary(100_000)).dictionary_encode()
    return pa.table({"id": pa.array(range(len(column)), pa.int64()), "v": column})


@pytest.mark.parametrize("kind", ["list", "struct", "fixed"])
def test_a_nested_or_fixed_width_bomb_is_refused_having_decoded_at_most_the_limit(
    tmp_path: Path, kind: str
) -> None:
    """Text kept as dictionaries inside lists and structs, and fixed-width values counted from
    the footer's value counts: each bomb decodes to about 300 MB and is refused at 16 MiB,
    having raised the reader's peak by far less."""
    bomb = tmp_path / "bomb.parquet"
    pq.write_table(nested_bomb(kind), bomb)
    assert bomb.stat().st_size < 4 * MiB and parquet_bytes(pq.read_metadata(bomb)) < 16 * MiB
    assert refused_at_16_mib_growing(bomb) < 64


def test_parquet_bombs_are_set_aside_through_the_cli_with_bounded_memory(tmp_path: Path) -> None:
    """Through ``dagster asset materialize``: two 1,000,000-row dictionary bombs (about 1 GB
    decoded each, 64 MiB allowed), one Spark reads natively, one decoded in Python (a uint64
    key), are set aside with the reason and the good file of their hour applies. The memory
    they cost is the growth of the largest Python process of the run's tree (the CLI with its
    Spark driver, Spark's Python workers) over a run of an hour of as many small files."""
    import shutil

    from cdc_platform.lib.config import REPO_ROOT, load_config

    config = tmp_path / "cdc_platform.yaml"
    config.write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        '  - name: t\n    primary_key: [id]\n    start: "2024-01-01-00:00"\n'
        "    max_file_bytes: 67108864\n"
    )
    platform = load_config(config)
    folder = hour_folder(platform.landing_path, "t", H5)
    folder.mkdir(parents=True)
    pq.write_table(dictionary_bomb(1_000_000), folder / "native.parquet")
    pq.write_table(dictionary_bomb(1_000_000, wide="uint64"), folder / "python.parquet")
    write_parquet_events(
        platform.landing_path, "t", H5, [ev("INSERT", 1, TS, 7, v="ok")], name="ok.parquet"
    )
    h6 = H5 + timedelta(hours=1)
    for i, name in enumerate(("a.parquet", "b.parquet", "ok.parquet")):
        events = [ev("INSERT", i + 2, h6, 10 + i, v="small")]
        write_parquet_events(platform.landing_path, "t", h6, events, name=name)
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "CDC_"))}
    env |= {"CDC_PLATFORM_CONFIG": str(config), "DAGSTER_HOME": str(home)}
    env["PYTHONPATH"] = str(REPO_ROOT)
    small = _cli_peak_mib(env, tmp_path, "2024-01-01-06:00")
    bombs = _cli_peak_mib(env, tmp_path, "2024-01-01-05:00")
    lake = {"warehouse": Path(str(platform.warehouse_root))}
    found = reasons(lake)
    assert set(found) == {"native.parquet", "python.parquet"}, found
    assert all("decodes to more than 64 MiB" in why for why in found.values()), found
    assert logged_keys(lake) == [7, 10, 11, 12]
    assert bombs - small < 256, (bombs, small)


def _cli_peak_mib(env: dict[str, str], cwd: Path, partition: str) -> float:
    """The peak resident MiB of the largest Python process of one ``dagster asset materialize``
    run and its descendants (the JVM left out), sampled every 0.2 s."""
    import subprocess
    import sys
    import time

    command = [str(Path(sys.executable).parent / "dagster"), "asset", "materialize"]
    command += ["-m", "cdc_platform.definitions", "--select", "t", "--partition", partition]
    log = cwd / f"cli-{partition}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, _largest_python_rss_mib(proc.pid))
            time.sleep(0.2)
    assert proc.returncode == 0, log.read_text()[-3000:]
    print(f"largest Python process of the run of {partition}: {peak:.0f} MiB")
    return peak


def _largest_python_rss_mib(pid: int) -> float:
    """Resident MiB of the largest of ``pid`` and its descendants, the JVM left out."""
    children: dict[int, list[int]] = {}
    rss: dict[int, float] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        children.setdefault(int(rest.split()[1]), []).append(int(entry))
        kib = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")]
        rss[int(entry)] = 0 if name == "java" or not kib else kib[0] / 1024
    largest, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        largest = max(largest, rss.get(p, 0))
        todo += children.get(p, [])
    return largest
