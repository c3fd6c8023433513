"""A landing zone cannot stop, crash or silently corrupt the platform (issue 31): decompression
bombs, folder shapes no exporter writes, files rewritten in place between the two reads, and
bytes that are no text. Each test drives the real path (the pipeline with a real Spark session,
the sensor's cursor, discovery) and fails without the change it covers."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from deltalake import DeltaTable

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.fleet import sensor_cursor
from cdc_platform.lib.landing import discovery
from cdc_platform.lib.landing.decoding.codecs import LandingFileError
from cdc_platform.lib.landing.decoding.formats.parquet import parquet_bytes
from cdc_platform.lib.landing.reading.file_reader import LandingReader, changed_files_named
from cdc_platform.lib.landing.reading.passes import event_schema
from cdc_platform.lib.landing.where.layout import (
    BAD_NAME,
    IN_SUBFOLDER,
    all_hour_folders,
    files_in_hour,
    fingerprint,
    hour_folder,
)
from cdc_platform.lib.landing.where.safe_open import CHANGED, FileId
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, write_parquet_events

H5 = datetime(2024, 1, 1, 5, tzinfo=UTC)
TS = datetime(2024, 1, 1, 5, 1, tzinfo=UTC)
TABLE = TableConfig(name="t", primary_key=("id",), start=H5 - timedelta(hours=24))
CSV = replace(
    TABLE,
    format="csv",
    compression="zstd",
    columns={"id": "long", "v": "string"},
    null_string="NULL",
)
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


def land(lake: dict[str, Path], name: str, data: bytes, table: str = "t") -> Path:
    folder = hour_folder(lake["landing"], table, H5)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def reasons(lake: dict[str, Path], table: str = "t") -> dict[str, str]:
    q = quarantine.current(TablePaths.of(lake["warehouse"], table).quarantine)
    return {e.file.rsplit("/", 1)[-1]: e.reason for e in q}


def logged_keys(lake: dict[str, Path], table: str = "t") -> list[Any]:
    log = TablePaths.of(lake["warehouse"], table).changelog
    return sorted(DeltaTable(log.uri).to_pyarrow_table(columns=["id"])["id"].to_pylist())


# -- 1. decompression bombs ------------------------------------------------------------------------


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
        "from cdc_platform_tests.test_hostile_landing import zeros_bomb\n"
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
        "from cdc_platform_tests.test_hostile_landing import TABLE\n"
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


# -- 2. folder shapes that stopped a sensor --------------------------------------------------------


@pytest.fixture(autouse=True)
def _remove_deep_folders(tmp_path: Path) -> Any:
    """pytest removes old temporary folders recursively: a 1,000-deep tree would overflow it."""
    yield
    import subprocess

    subprocess.run(["rm", "-rf", str(tmp_path)], check=False)


def odd_tree(landing: Path, table: str = "t") -> Path:
    """One real hour plus every shape that used to raise out of the walk."""
    write_parquet_events(landing, table, H5, [ev("INSERT", 1, TS, 1, v="a")], name="ok.parquet")
    base = landing / table
    (base / "year=10000000000" / "month=01" / "day=01" / "hour=00").mkdir(parents=True)
    (base / "year=2024" / "month=99999999999999999999" / "day=01").mkdir(parents=True)
    loop = base / "year=2024" / "month=01" / "day=01" / "hour=07"
    loop.symlink_to(loop)  # a link to itself: ELOOP when followed
    (base / "year=2024" / "month=01" / "day=02").symlink_to("day=02")
    hour = hour_folder(landing, table, H5)
    (hour / os.fsdecode(b"bad-\xff\xfe.parquet")).write_bytes(b"PAR1")
    deep = hour / "nest"
    deep.mkdir()
    # ~1,000 levels below the hour folder (past Python's recursion limit), a file at the bottom.
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(1000):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("f.parquet", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd), "wb") as fh:
            fh.write(b"x")
    finally:
        os.close(fd)
    return hour


def test_odd_folder_shapes_never_raise_out_of_the_walk_or_the_sensor(lake) -> None:
    odd_tree(lake["landing"])
    hours = [h for h, _ in all_hour_folders(lake["landing"], "t")]
    assert H5 in hours and all(h.year < 10000 for h in hours)
    files = files_in_hour(lake["landing"], "t", H5)
    by_reason = {f.set_aside for f in files}
    assert BAD_NAME in by_reason and IN_SUBFOLDER in by_reason
    assert len(fingerprint(files)) == 16
    # The sensor's first tick walks everything (a full sweep): it asks for the real hour.
    requests, state = sensor_cursor.evaluate(
        TABLE, lake["landing"], H5 + timedelta(hours=30), sensor_cursor.CursorState()
    )
    asked = {k for r in requests for k in r.partition_keys}
    assert H5.strftime("%Y-%m-%d-%H:00") in asked
    assert state.last_sweep_started is not None


def test_odd_folder_shapes_are_set_aside_and_the_hour_applied(spark, lake) -> None:
    odd_tree(lake["landing"])
    out = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H5])
    assert out.events_read == 1 and logged_keys(lake) == [1]
    got = reasons(lake)
    assert got["bad-\\xff\\xfe.parquet"] == BAD_NAME
    assert got["f.parquet"] == IN_SUBFOLDER


def test_a_new_table_folder_with_odd_shapes_is_discovered_without_raising(lake) -> None:
    odd_tree(lake["landing"], table="fresh")
    assert discovery.unlisted_tables(lake["landing"], []) == ["fresh"]
    found = discovery.describe(lake["landing"], "fresh")
    assert found.first_hour == H5 and "id" in dict(found.columns)


# -- 3. a file rewritten in place between the listing, pass 1 and pass 2 ---------------------------


def rewrite_in_place(path: Path, rows: list[dict[str, Any]]) -> None:
    """Same inode, same modification time: only the inode's change time can tell."""
    st = path.stat()
    tbl = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    pq.write_table(tbl, sink)
    with open(path, "r+b") as fh:
        fh.truncate(0)
        fh.write(sink.getvalue().to_pybytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino


BAD_ROWS = [ev("DELETE", 9, TS, None, v="no key"), ev("BOGUS", 10, TS, 2, v="no op")]


@pytest.mark.parametrize("encoded", [False, True], ids=["native", "decoded"])
def test_a_file_rewritten_in_place_after_inspection_is_set_aside_never_logged(
    spark, lake, monkeypatch, encoded
) -> None:
    from cdc_platform.lib.landing import batch

    table = TABLE
    victim = write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 1, TS, 1, v="a")], name="victim.parquet"
    )
    if encoded:  # a uint64 column, nanoseconds: not read natively, decoded in Python tasks
        pq.write_table(
            pa.table(
                {
                    "id": pa.array([1], pa.uint8()),
                    "v": ["a"],
                    "n": pa.array([1], pa.uint64()),
                    "cdc_operation_type": ["INSERT"],
                    "cdc_change_seq": pa.array([1], pa.int64()),
                    "cdc_commit_timestamp": pa.array([TS], pa.timestamp("ns", tz="UTC")),
                }
            ),
            victim,
        )
    write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 5, TS, 5, v="b")], name="other.parquet"
    )
    real_read = batch.read_events

    def rewrite_then_read(*args: Any, **kwargs: Any) -> Any:
        if victim.stat().st_size and not getattr(rewrite_then_read, "done", False):
            rewrite_then_read.done = True  # type: ignore[attr-defined]
            rewrite_in_place(victim, BAD_ROWS)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", rewrite_then_read)
    out = materialize(spark, table, lake["landing"], lake["warehouse"], [H5])
    assert reasons(lake)["victim.parquet"] == CHANGED
    assert logged_keys(lake) == [5] and out.events_read == 1
    assert [r["id"] for r in history_rows(TablePaths.of(lake["warehouse"], "t").history)] == [5]

    # Once the file is stable, its hour read again applies what inspection allows: nothing
    # of it (bad rows set it aside), the quarantine naming the row.
    monkeypatch.setattr(batch, "read_events", real_read)
    materialize(spark, table, lake["landing"], lake["warehouse"], [H5])
    assert "row 1: primary key column 'id' is null" in reasons(lake)["victim.parquet"]
    assert logged_keys(lake) == [5]


def test_pass_two_checks_rows_again_even_when_the_file_looks_unchanged(
    spark, lake, monkeypatch
) -> None:
    """A rewrite the file system cannot show (a coarse clock, a mount that reports times
    poorly): Spark's pass 2 validates every row again, within pass 1's rows and seq range."""
    from cdc_platform.lib.landing import batch

    monkeypatch.setattr(FileId, "matches", lambda self, st: self.ino == st.st_ino)
    victim = write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 1, TS, 1, v="a")], name="victim.parquet"
    )
    write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 5, TS, 5, v="b")], name="other.parquet"
    )
    real_read = batch.read_events

    def rewrite_then_read(*args: Any, **kwargs: Any) -> Any:
        if not getattr(rewrite_then_read, "done", False):
            rewrite_then_read.done = True  # type: ignore[attr-defined]
            rewrite_in_place(victim, [ev("INSERT", 99, TS, 1, v="a")])  # seq out of range
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", rewrite_then_read)
    materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H5])
    assert reasons(lake)["victim.parquet"] == CHANGED
    assert logged_keys(lake) == [5]


def test_the_python_decoder_checks_rows_again_and_names_the_file(lake, monkeypatch) -> None:
    """The decoded path's pass 2 (run here in process, as a Spark task runs it)."""
    monkeypatch.setattr(FileId, "matches", lambda self, st: self.ino == st.st_ino)
    header = b"id,v,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
    path = land(lake, "victim.csv", header + b"1,a,INSERT,1,2024-01-01T05:01:00Z\n")
    table = replace(CSV, compression="none")
    (listed,) = files_in_hour(lake["landing"], "t", H5)
    reader = LandingReader(table, lake["landing"])
    reader.expect({listed.path: listed.file_id})
    report = reader.inspect(str(path))
    assert report.ok and (report.num_rows, report.seq_min, report.seq_max) == (1, 1, 1)
    schema = event_schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])
    for rewritten in (
        b"NULL,x,DELETE,1,2024-01-01T05:01:00Z\n",  # a null key
        b"1,a,INSERT,1,2024-01-01T05:01:00Z\n2,b,INSERT,1,2024-01-01T05:01:00Z\n",  # a row more
        b"1,a,INSERT,7,2024-01-01T05:01:00Z\n",  # another seq
    ):
        st = path.stat()
        with open(path, "r+b") as fh:
            fh.truncate(0)
            fh.write(header + rewritten)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(LandingFileError) as err:
            list(reader.read_conformed(str(path), schema, report))
        assert changed_files_named(err.value) == {reader.relative(str(path))}


# -- 4. bytes that are no text ---------------------------------------------------------------------


def invalid_utf8_file(path: Path, key: int = 1) -> None:
    text = pa.array([b"\xff\xfe not text"], pa.binary()).view(pa.string())
    pq.write_table(
        pa.table(
            {
                "id": pa.array([key], pa.int64()),
                "v": text,
                "cdc_operation_type": ["INSERT"],
                "cdc_change_seq": pa.array([1], pa.int64()),
                "cdc_commit_timestamp": pa.array([TS], pa.timestamp("us", tz="UTC")),
            }
        ),
        path,
    )


def test_text_that_is_not_utf8_sets_the_file_aside_naming_row_and_column(spark, lake) -> None:
    folder = hour_folder(lake["landing"], "t", H5)
    folder.mkdir(parents=True)
    invalid_utf8_file(folder / "bad.parquet")
    write_parquet_events(
        lake["landing"], "t", H5, [ev("INSERT", 2, TS, 2, v="ok")], name="ok.parquet"
    )
    out = materialize(spark, TABLE, lake["landing"], lake["warehouse"], [H5])
    assert reasons(lake)["bad.parquet"] == "row 1, column 'v': text that is not valid UTF-8"
    assert out.events_read == 1 and logged_keys(lake) == [2]


def test_file_stats_of_bytes_that_are_no_text_give_no_bounds(tmp_path: Path) -> None:
    from cdc_platform.lib.storage import delta

    invalid_utf8_file(tmp_path / "f.parquet")
    stats = delta.file_stats(pq.ParquetFile(tmp_path / "f.parquet").metadata)
    assert stats["numRecords"] == 1 and "v" not in stats["maxValues"]


def test_odd_folder_shapes_through_the_asset_and_its_ledger(spark, tmp_path) -> None:
    """The asset records every listed file in the applied-files ledger: a name that is not
    UTF-8 is recorded escaped (a Delta string holds UTF-8 only), and the run succeeds."""

    from cdc_platform.lib.config import load_config
    from cdc_platform.lib.ledgers import applied_files

    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        "  - {name: t, primary_key: [id], start: '2023-12-31-05:00'}\n"
    )
    odd_tree(tmp_path / "landing")
    platform = load_config(tmp_path / "cdc_platform.yaml")
    materialize_through_the_asset(platform)
    recorded = {
        f
        for f, _, _ in applied_files.applied(
            applied_files.ledger_path(platform.warehouse_root, "t")
        )
    }
    assert "t/year=2024/month=01/day=01/hour=05/bad-\\xff\\xfe.parquet" in recorded


def test_a_file_set_aside_as_changed_is_not_recorded_as_applied(spark, tmp_path, monkeypatch):
    """A chmod (or a rewrite keeping size and mtime) moves only the change time: the sensor's
    fingerprint does not see it, so the ledger must not claim the file was read, or its hour
    would never be asked for again (the pending hour is re-requested instead)."""

    from cdc_platform.lib.config import load_config
    from cdc_platform.lib.fleet import sensor_cursor
    from cdc_platform.lib.landing import batch
    from cdc_platform.lib.ledgers import applied_files

    (tmp_path / "cdc_platform.yaml").write_text(
        "landing_root: landing\nwarehouse_root: warehouse\ntables:\n"
        "  - {name: t, primary_key: [id], start: '2023-12-31-05:00', retry_backoff_seconds: 60}\n"
    )
    platform = load_config(tmp_path / "cdc_platform.yaml")
    landing = platform.landing_path
    victim = write_parquet_events(
        landing, "t", H5, [ev("INSERT", 1, TS, 1, v="a")], name="v.parquet"
    )
    write_parquet_events(landing, "t", H5, [ev("INSERT", 5, TS, 5, v="b")], name="o.parquet")
    real_read = batch.read_events

    def chmod_then_read(*args: Any, **kwargs: Any) -> Any:
        os.chmod(victim, 0o640)  # the permissions cron: only the ctime moves
        return real_read(*args, **kwargs)

    monkeypatch.setattr(batch, "read_events", chmod_then_read)
    materialize_through_the_asset(platform)
    ledger = applied_files.ledger_path(platform.warehouse_root, "t")
    recorded = {f.rsplit("/", 1)[1] for f, _, _ in applied_files.applied(ledger)}
    assert recorded == {"o.parquet"}
    # The sensor's pending hour is then requested again.
    table = platform.table("t")
    state = sensor_cursor.CursorState(
        pending={"2024-01-01-05:00": sensor_cursor.Pending("fp", 0.0, 0.0, 0)}
    )
    applied = applied_files.applied_by_partition(ledger, ["2024-01-01-05:00"])
    requests, _ = sensor_cursor.reconcile(table, landing, datetime.now(UTC), state, applied, set())
    assert [r.partition_keys for r in requests] == [("2024-01-01-05:00",)]


def materialize_through_the_asset(platform: Any) -> None:
    """The hour 05:00 of table t through its Dagster asset (in process)."""
    import dagster as dg

    from cdc_platform.defs.tables import build_table_definitions
    from cdc_platform_tests.helpers import dagster_resources

    defs = build_table_definitions(platform, platform.table("t"))
    result = dg.materialize(
        [defs.asset],
        partition_key="2024-01-01-05:00",
        instance=dg.DagsterInstance.ephemeral(),
        resources=dagster_resources(),
    )
    assert result.success
