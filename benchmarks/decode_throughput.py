"""Decode throughput of landing files: plain Parquet vs ZSTD+AES Parquet vs ZSTD+AES CSV.

The same N change events are written three ways across ``--files`` files in a temp landing zone.
For each encoding it times

* the Spark path the pipeline runs: ``inspect_files`` (pass 1, decode + validate every file in
  tasks) and ``read_events(...).count()`` (pass 2, decode + conform into Arrow batches), on a
  ``local[2]`` session from ``build_spark_session``;
* the pure per-file work without Spark, in this process: decrypt + decompress
  (``decode_file``), then parse (``LandingReader.load``, which decodes again and parses).

Throughput is plaintext bytes (the Parquet file, or the CSV text, before ZSTD/AES) per second,
and rows per second; plain Parquet is the baseline. Best of ``--reps`` after one warm-up job.
Run: ``.venv/bin/python -m benchmarks.decode_throughput [--rows N] [--files F] [--reps R]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.codecs import decode_file, encode_file_bytes
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.reading.file_reader import LandingReader
from cdc_platform.lib.landing.reading.passes import (
    event_schema,
    inspect_files,
    read_events,
    unify_schema,
)
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.spark.session import build_spark_session

T = TypeVar("T")

START = datetime(2024, 1, 1, tzinfo=UTC)
KEY = bytes(range(32))
NULL = "__NULL__"
COLUMNS = {
    "id": "long",
    "customer": "string",
    "amount": "double",
    "status": "string",
    "note": "string",
    "receipt": "binary",
    "updated_at": "timestamp",
}
WORDS = np.array(
    [
        *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"),
        *("juliett", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo"),
        *("sierra", "tango", "uniform", "victor", "whiskey", "x-ray", "yankee", "zulu"),
    ]
)


@dataclass(frozen=True)
class Encoding:
    label: str
    table: TableConfig
    suffix: str


def make_events(n: int, seed: int = 7) -> pa.Table:
    """N events (~250 bytes a row as CSV): inserts, then updates and deletes of earlier ids."""
    rng = np.random.default_rng(seed)
    seq = np.arange(1, n + 1, dtype=np.int64)
    op = rng.choice(np.array(["INSERT", "UPDATE", "DELETE"]), size=n, p=[0.6, 0.35, 0.05])
    ids = np.where(op == "INSERT", seq, rng.integers(1, max(2, n // 2), size=n))
    ts_us = int(START.timestamp() * 1e6) + np.sort(rng.integers(0, 8 * 3600 * 10**6, size=n))
    note_words = WORDS[rng.integers(0, len(WORDS), size=(n, 18))]
    notes = [" ".join(row) for row in note_words]
    customers = [f"customer-{i:07d}" for i in rng.integers(0, 10**6, size=n)]
    receipts = [bytes(r) for r in rng.integers(0, 256, size=(n, 24), dtype=np.uint8)]
    is_delete = op == "DELETE"
    mask = pa.array(is_delete)

    def nulled(arr: pa.Array) -> pa.Array:
        # pyarrow.compute functions are generated at import: invisible to the type checker
        return pc.if_else(mask, pa.scalar(None, arr.type), arr)  # pyright: ignore[reportAttributeAccessIssue]

    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "customer": nulled(pa.array(customers)),
            "amount": nulled(pa.array(np.round(rng.uniform(1, 1000, size=n), 2))),
            "status": nulled(pa.array(rng.choice(np.array(["new", "paid", "shipped"]), size=n))),
            "note": nulled(pa.array(notes)),
            "receipt": nulled(pa.array(receipts, pa.binary())),
            "updated_at": nulled(pa.array(ts_us, pa.timestamp("us", tz="UTC"))),
            "cdc_operation_type": pa.array(op),
            "cdc_change_seq": pa.array(seq),
            "cdc_commit_timestamp": pa.array(ts_us, pa.timestamp("us", tz="UTC")),
        }
    )


def parquet_plain(tbl: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(tbl, buf)
    return buf.getvalue()


def csv_plain(tbl: pa.Table) -> bytes:
    """Fivetran-style CSV: header, NULL as the null_string, base64 binary, ISO timestamps."""
    cols = []
    for col in tbl.columns:
        if pa.types.is_binary(col.type):
            text = pa.array(
                [None if v is None else base64.b64encode(v).decode() for v in col.to_pylist()],
                pa.string(),
            )
        elif pa.types.is_timestamp(col.type):
            text = pc.strftime(col, "%Y-%m-%dT%H:%M:%SZ")  # pyright: ignore[reportAttributeAccessIssue]
        else:
            text = pc.cast(col, pa.string())
        cols.append(pc.fill_null(text, NULL))
    out = io.BytesIO()
    pacsv.write_csv(
        pa.table(cols, names=tbl.column_names),
        out,
        write_options=pacsv.WriteOptions(quoting_style="needed"),
    )
    return out.getvalue()


def write_landing(root: Path, enc: Encoding, tbl: pa.Table, n_files: int) -> tuple[list[str], int]:
    """Split into n_files hour folders; return the paths and the total plaintext bytes."""
    paths, plain_bytes = [], 0
    size = -(-tbl.num_rows // n_files)
    for i in range(n_files):
        part = tbl.slice(i * size, size)
        plain = csv_plain(part) if enc.table.format == "csv" else parquet_plain(part)
        plain_bytes += len(plain)
        t = enc.table
        data = encode_file_bytes(
            plain, t.compression, t.encryption, KEY if t.encryption != "none" else None
        )
        folder = hour_folder(root, t.name, START + timedelta(hours=i))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"part-{i:05d}{enc.suffix}"
        path.write_bytes(data)
        paths.append(str(path))
    return paths, plain_bytes


def best_of(reps: int, fn: Callable[[], T]) -> tuple[float, T]:
    """The fastest of ``reps`` timed runs (at least one), and the last run's result."""
    t0 = time.perf_counter()
    out = fn()
    best = time.perf_counter() - t0
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def rate(plain_bytes: int, rows: int, seconds: float) -> str:
    return f"{plain_bytes / 1e6 / seconds:8.1f} MB/s {rows / seconds / 1e3:8.0f} k rows/s"


@dataclass(frozen=True)
class Figures:
    enc: Encoding
    plain_bytes: int
    on_disk: int
    decode_s: float
    load_s: float
    inspect_s: float
    read_s: float


def measure(spark, root: Path, enc: Encoding, events: pa.Table, keyring: Keyring, args) -> Figures:
    """Write one encoding's files, then time decoding them without and with Spark."""
    paths, plain_bytes = write_landing(root, enc, events, args.files)
    on_disk = sum(os.path.getsize(p) for p in paths)
    reader = LandingReader(enc.table, root, keyring)

    # Without Spark: decrypt + decompress, then the full load (decode + parse).
    t_dec, _ = best_of(
        args.reps,
        lambda: (
            [decode_file(p, enc.table.compression, enc.table.encryption, [KEY]) for p in paths]
            if enc.table.is_encoded
            else [Path(p).read_bytes() for p in paths]
        ),
    )
    t_load, loaded = best_of(args.reps, lambda: [reader.load(p) for p in paths])
    rows = sum(t.num_rows for t in loaded)
    assert rows == args.rows, (rows, args.rows)

    # With Spark: pass 1 (inspect) and pass 2 (read + count), as the pipeline runs them.
    t_inspect, reports = best_of(args.reps, lambda: inspect_files(spark, reader, paths))
    assert all(r.ok for r in reports), [r.error for r in reports if not r.ok]
    fields, clashes = unify_schema(None, reports)
    assert not clashes, clashes
    schema = event_schema(fields)
    t_read, count = best_of(args.reps, lambda: read_events(spark, reader, paths, schema).count())
    assert count == args.rows, (count, args.rows)
    return Figures(enc, plain_bytes, on_disk, t_dec, t_load, t_inspect, t_read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()

    def table(name: str, fmt: str, compression: str, encryption: str) -> TableConfig:
        return TableConfig(
            name=name,
            primary_key=("id",),
            start=START,
            format=fmt,
            compression=compression,
            encryption=encryption,
            null_string=NULL if fmt == "csv" else None,
            columns=COLUMNS if fmt == "csv" else {},
        )

    encodings = [
        Encoding(
            "(a) Parquet, plain", table("plain_parquet", "parquet", "none", "none"), ".parquet"
        ),
        Encoding(
            "(b) Parquet, zstd+AES",
            table("enc_parquet", "parquet", "zstd", "aes-256-cbc"),
            ".parquet.zst.aes",
        ),
        Encoding(
            "(c) CSV, zstd+AES", table("enc_csv", "csv", "zstd", "aes-256-cbc"), ".csv.zst.aes"
        ),
    ]
    keyring = Keyring({e.table.name: (KEY,) for e in encodings}, {})

    t0 = time.perf_counter()
    events = make_events(args.rows)
    print(f"generated {args.rows:,} events in {time.perf_counter() - t0:.1f} s")
    spark = build_spark_session(
        "local[2]",
        {"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
        app_name="decode_throughput",
    )
    spark.sparkContext.parallelize(range(4), 2).map(lambda x: x).collect()  # start the workers

    with tempfile.TemporaryDirectory(prefix="decode_throughput_") as tmp:
        root = Path(tmp)
        results = []
        for enc in encodings:
            results.append(measure(spark, root, enc, events, keyring, args))

        print(
            f"\n{args.rows:,} events in {args.files} files each; local[2] Spark; best of "
            f"{args.reps}; MB = plaintext MB (10^6 bytes) before ZSTD/AES\n"
        )
        base_total = results[0].inspect_s + results[0].read_s
        for f in results:
            enc, plain, disk = f.enc, f.plain_bytes, f.on_disk
            t_dec, t_load, t_inspect, t_read = f.decode_s, f.load_s, f.inspect_s, f.read_s
            total = t_inspect + t_read
            print(f"{enc.label}: plaintext {plain / 1e6:.1f} MB, on disk {disk / 1e6:.1f} MB")
            print(
                f"  no Spark, {'decrypt+decompress' if enc.table.is_encoded else 'read the bytes    '}"
                f"  {t_dec:7.2f} s  {rate(plain, args.rows, t_dec)}"
            )
            print(
                f"  no Spark, decode+parse (load) {t_load:7.2f} s  {rate(plain, args.rows, t_load)}"
            )
            print(
                f"  Spark pass 1 inspect          {t_inspect:7.2f} s  "
                f"{rate(plain, args.rows, t_inspect)}"
            )
            print(
                f"  Spark pass 2 read+count       {t_read:7.2f} s  {rate(plain, args.rows, t_read)}"
            )
            print(
                f"  Spark pass 1 + 2              {total:7.2f} s  {rate(plain, args.rows, total)}"
                f"   x{total / base_total:.2f} the plain-Parquet time"
            )
    spark.stop()


if __name__ == "__main__":
    main()
