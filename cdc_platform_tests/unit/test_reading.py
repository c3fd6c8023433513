"""The landing reader on its own (no Spark): the timestamp and type spellings exporters use."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import pytest

from cdc_platform.lib.columns import TS_TYPE
from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.codecs import compress_zstd
from cdc_platform.lib.landing.decoding.formats import FORMATS
from cdc_platform.lib.landing.decoding.formats.base import LandingFormat
from cdc_platform.lib.landing.discovery import sniff_encoding
from cdc_platform.lib.landing.reading.file_reader import LandingReader
from cdc_platform.lib.landing.reading.passes import unify_schema

TABLE = TableConfig(name="x", primary_key=("id",), start=datetime(2024, 1, 1, tzinfo=UTC))
EXPECTED = datetime(2024, 1, 1, 5, 0, 0, 123000, tzinfo=UTC)


def _file(tmp_path: Path, ts: pa.Array, **extra: pa.Array) -> str:
    n = len(ts)
    path = tmp_path / "f.parquet"
    columns = {
        "id": list(range(n)),
        "cdc_operation_type": ["Insert"] * n,
        "cdc_change_seq": pa.array(range(n), pa.int32()),
    }
    pq.write_table(pa.table({**columns, "cdc_commit_timestamp": ts, **extra}), path)
    return str(path)


@pytest.mark.parametrize(
    "ts",
    [
        pa.array([datetime(2024, 1, 1, 5, 0, 0, 123000)], pa.timestamp("us")),  # naive = UTC
        pa.array([1704085200123000000], pa.timestamp("ns", tz="UTC")),  # pandas' nanoseconds
        pa.array([1704085200123], pa.timestamp("ms", tz="America/New_York")),
        pa.array(["2024-01-01T05:00:00.123Z"]),  # Fivetran's Parquet writes instants as strings
        pa.array(["2024-01-01T07:00:00.123+02:00"]),
        pa.array(["2024-01-01 05:00:00.123"]),
    ],
    ids=["naive", "ns", "zoned-ms", "iso-z", "iso-offset", "iso-naive"],
)
def test_commit_timestamps_in_any_spelling_become_utc_micros(tmp_path, ts):
    reader = LandingReader(TABLE, tmp_path)
    path = _file(tmp_path, ts)
    report = reader.inspect(path)
    assert report.ok, report.error
    schema = pa.schema(
        [pa.field("cdc_operation_type", pa.string()), pa.field("cdc_commit_timestamp", TS_TYPE)]
    )
    (batch,) = reader.read_conformed(path, schema)
    assert batch.column(0).to_pylist() == ["INSERT"]
    assert batch.column(1).to_pylist() == [EXPECTED]


def test_unparsable_timestamp_names_the_row(tmp_path):
    report = LandingReader(TABLE, tmp_path).inspect(
        _file(tmp_path, pa.array(["2024-01-01T05:00:00Z", "yesterday"]))
    )
    assert report.error == (
        "row 2, column 'cdc_commit_timestamp': 'yesterday' is not an ISO-8601 timestamp"
    )
    assert report.error_row == 2


def test_integer_widths_agree_and_untyped_columns_wait_for_a_type(tmp_path):
    reader = LandingReader(TABLE, tmp_path)
    a = reader.inspect(
        _file(tmp_path, pa.array([EXPECTED]), amount=pa.array([1], pa.int32()), note=pa.nulls(1))
    )
    fields, clashes = unify_schema(None, [a])
    assert {f.name: f.type for f in fields} == {
        "id": pa.int64(),
        "amount": pa.int64(),
    }  # note: no type yet
    assert clashes == {}


def test_which_file_of_a_first_batch_widens_a_key_never_depends_on_file_names(tmp_path):
    """The key column is new in a first batch with a text file and an integer file: under the
    default ``widen_types`` the integer file sets the type and the text file is set aside,
    whichever name sorts first (it was the first file by path that decided)."""
    ts = pa.array([datetime(2024, 1, 1, 5, tzinfo=UTC)], pa.timestamp("us", tz="UTC"))

    def write(folder: Path, name: str, key: pa.Array) -> str:
        change = {"cdc_operation_type": ["INSERT"], "cdc_change_seq": [1]}
        pq.write_table(pa.table({"id": key, **change, "cdc_commit_timestamp": ts}), folder / name)
        return str(folder / name)

    for text_name, int_name in (("a.parquet", "b.parquet"), ("b.parquet", "a.parquet")):
        folder = tmp_path / text_name
        folder.mkdir()
        reader = LandingReader(TABLE, folder)
        text = reader.inspect(write(folder, text_name, pa.array(["A-1"])))
        ints = reader.inspect(write(folder, int_name, pa.array([7])))
        fields, clashes = unify_schema(None, [text, ints], TABLE.may_widen)
        assert {f.name: f.type for f in fields}["id"] == pa.int64(), text_name
        assert list(clashes) == [text.path], text_name
        assert "widen_types" in clashes[text.path]


class _JsonLines(LandingFormat):
    """A format the platform does not ship, written the way a new format module would be."""

    name = "jsonl"
    title = "JSON Lines"
    suffix = ".jsonl"
    summary = "one JSON object per line"

    def looks_like(self, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{"

    def read(self, source, file) -> pa.Table:
        return pa_json.read_json(source)

    def describe(self, opener, compression):
        with opener() as fh:
            return [(f.name, str(f.type)) for f in pa_json.read_json(fh).schema], None


def test_a_format_is_one_landing_format_the_reader_has_no_format_of_its_own(tmp_path, monkeypatch):
    """What adding a format module amounts to: registered in FORMATS, its files are decoded,
    read, validated (the bad row named) and conformed like Parquet's and CSV's, with no
    branch anywhere else; a compressed one goes through the codecs first."""
    monkeypatch.setitem(FORMATS, "jsonl", _JsonLines())
    lines = [
        '{"id": 1, "cdc_operation_type": "insert", "cdc_change_seq": 1,'
        ' "cdc_commit_timestamp": "2024-01-01T05:00:00.123Z", "name": "a"}',
        '{"id": 2, "cdc_operation_type": "Upsert", "cdc_change_seq": 2,'
        ' "cdc_commit_timestamp": "2024-01-01T05:00:00.123Z", "name": "b"}',
    ]
    good, bad = tmp_path / "good.jsonl.zst", tmp_path / "bad.jsonl"
    good.write_bytes(compress_zstd((lines[0] + "\n").encode()))
    bad.write_text("\n".join(lines) + "\n")
    table = replace(TABLE, format="jsonl", compression="zstd")
    reader = LandingReader(table, tmp_path)
    report = reader.inspect(str(good))
    assert report.ok, report.error
    assert report.schema is not None and report.schema.field("id").type == pa.int64()
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("name", pa.string())])
    (batch,) = reader.read_conformed(str(good), schema)
    assert batch.to_pylist() == [{"id": 1, "name": "a"}]
    plain = LandingReader(replace(table, compression="none"), tmp_path).inspect(str(bad))
    assert plain.error == "row 2: cdc_operation_type 'UPSERT' is not INSERT, UPDATE or DELETE"
    assert sniff_encoding(good).format == "jsonl"


@pytest.mark.parametrize(
    ("name", "plain", "expected"),
    [
        ("part-1.zst", b"PAR1" + b"\0" * 64, ("parquet", "zstd", ())),
        ("part-1.zst", b"id,cdc_operation_type\n1,INSERT\n", ("csv", "zstd", ())),
        # not UTF-8 (Latin-1, a NUL): CSV unless the name says otherwise, marked as a guess
        ("part-1.zst", "id,name\n1,caf\xe9\n".encode("latin-1"), ("csv", "zstd", 1)),
        ("part-1.zst", b"id\x00,name\n", ("csv", "zstd", 1)),
        ("part-1.parquet.zst", b"\xff\xfe junk", ("parquet", "zstd", 1)),
    ],
)
def test_discovery_tells_a_compressed_files_format_from_its_plaintext(
    tmp_path, name, plain, expected
):
    path = tmp_path / name
    path.write_bytes(compress_zstd(plain))
    found = sniff_encoding(path)
    fmt, compression, guesses = expected
    assert (found.format, found.compression) == (fmt, compression)
    assert len(found.guessed) == guesses if isinstance(guesses, int) else found.guessed == ()
