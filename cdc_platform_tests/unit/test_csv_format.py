"""CSV landing files as Fivetran (jackson CsvSchema) writes them."""

from __future__ import annotations

import base64
import csv
import io
import os
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.codecs import (
    LandingFileError,
    decode_file,
    encode_file_bytes,
    open_decoded_stream,
)
from cdc_platform.lib.landing.decoding.formats.csv import arrow_type, read_csv_events

CDC = ["cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"]
TS = "2024-01-01T05:06:07.123Z"


def table(
    columns: dict[str, str],
    null_string: str | None = "null-ft",
    unmodified_string: str | None = "unmod-ft",
):
    # A CSV table declares its key's type: a test of casts alone keys on its first column.
    key = "id" if "id" in columns else next(iter(columns))
    return TableConfig(
        name="orders",
        primary_key=(key,),
        start=datetime(2024, 1, 1, tzinfo=UTC),
        format="csv",
        null_string=null_string,
        unmodified_string=unmodified_string,
        columns=columns,
    )


def jackson_csv(header: list[str], rows: list[list[str]]) -> bytes:
    """Quote only when needed, double the quote, never escape a backslash."""
    out = io.StringIO()
    writer = csv.writer(
        out, quoting=csv.QUOTE_MINIMAL, doublequote=True, escapechar=None, lineterminator="\n"
    )
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue().encode()


def read(header, rows, columns, **kw) -> pa.Table:
    return read_csv_events(jackson_csv(header, rows), table(columns, **kw), source="t.csv")


def error(header, rows, columns, **kw) -> LandingFileError:
    with pytest.raises(LandingFileError) as info:
        read(header, rows, columns, **kw)
    return info.value


SIMPLE = {"id": "long", "name": "string", "amount": "double"}


def test_header_order_is_read_not_assumed():
    header = [
        "cdc_commit_timestamp",
        "name",
        "cdc_change_seq",
        "id",
        "cdc_operation_type",
        "amount",
    ]
    rows = [[TS, "a", "7", "1", "INSERT", "1.5"], [TS, "b", "8", "2", "UPDATE", "2.5"]]
    tbl = read(header, rows, SIMPLE)
    assert tbl.column_names == ["name", "id", "amount", *CDC, "_cdc_unmodified"]
    assert tbl.column("id").to_pylist() == [1, 2]
    assert tbl.column("name").to_pylist() == ["a", "b"]
    assert tbl.column("cdc_change_seq").to_pylist() == [7, 8]
    assert tbl.column("cdc_operation_type").to_pylist() == ["INSERT", "UPDATE"]
    assert tbl.schema.field("cdc_commit_timestamp").type == pa.timestamp("us", tz="UTC")
    assert tbl.schema.field("_cdc_unmodified").type == pa.list_(pa.string())


def test_columns_missing_from_header_are_absent():
    tbl = read(["id", *CDC], [["1", "INSERT", "1", TS]], SIMPLE)
    assert tbl.column_names == ["id", *CDC, "_cdc_unmodified"]


def test_backslash_is_literal_and_quoting():
    values = [
        'a\\"b',
        "C:\\path\\",
        "x,y",
        'say "hi"',
        "line1\nline2",
        "cr\r\nlf",
        "\\",
        '\\"',
        "",
        " pad ",
    ]
    rows = [[str(i), v, "INSERT", str(i), TS] for i, v in enumerate(values)]
    raw = jackson_csv(["id", "name", *CDC], rows)
    assert b'"a\\""b"' in raw and b"C:\\path\\," in raw  # what the writer produced
    tbl = read_csv_events(raw, table(SIMPLE), "t.csv")
    assert tbl.column("name").to_pylist() == values
    assert tbl.column("id").to_pylist() == list(range(len(values)))


def test_null_string_and_empty_cells():
    rows = [["1", "null-ft", "null-ft", "INSERT", "1", TS], ["2", "", "3", "INSERT", "2", TS]]
    tbl = read(["id", "name", "amount", *CDC], rows, SIMPLE)
    assert tbl.column("name").to_pylist() == [None, ""]
    assert tbl.column("amount").to_pylist() == [None, 3.0]


def test_empty_null_string_makes_empty_cells_null():
    rows = [["1", "", "", "INSERT", "1", TS], ["2", "x", "1", "INSERT", "2", TS]]
    tbl = read(["id", "name", "amount", *CDC], rows, SIMPLE, null_string="")
    assert tbl.column("name").to_pylist() == [None, "x"]
    assert tbl.column("amount").to_pylist() == [None, 1.0]


def test_no_null_string_keeps_everything():
    rows = [["1", "null", "INSERT", "1", TS]]
    tbl = read(["id", "name", *CDC], rows, SIMPLE, null_string=None, unmodified_string=None)
    assert tbl.column("name").to_pylist() == ["null"]
    assert tbl.column("_cdc_unmodified").to_pylist() == [[]]


def test_unmodified_string():
    header = ["id", "name", "amount", "flag", *CDC]
    cols = {**SIMPLE, "flag": "boolean"}
    rows = [
        ["1", "unmod-ft", "2.5", "unmod-ft", "UPDATE", "1", TS],
        ["2", "b", "unmod-ft", "true", "UPDATE", "2", TS],
        ["3", "c", "1", "false", "INSERT", "3", TS],
        ["4", "unmod-ft", "unmod-ft", "unmod-ft", "UPDATE", "4", TS],
        ["5", "null-ft", "unmod-ft", "null-ft", "UPDATE", "5", TS],
    ]
    tbl = read(header, rows, cols)
    assert tbl.column("_cdc_unmodified").to_pylist() == [
        ["name", "flag"],
        ["amount"],
        [],
        ["name", "amount", "flag"],
        ["amount"],
    ]
    assert tbl.column("name").to_pylist() == [None, "b", "c", None, None]
    assert tbl.column("amount").to_pylist() == [2.5, None, 1.0, None, None]
    assert tbl.column("flag").to_pylist() == [None, True, False, None, None]


def test_unmodified_follows_header_order():
    header = ["amount", "id", "name", *CDC]
    tbl = read(header, [["unmod-ft", "1", "unmod-ft", "UPDATE", "1", TS]], SIMPLE)
    assert tbl.column("_cdc_unmodified").to_pylist() == [["amount", "name"]]


@given(st.lists(st.binary(max_size=40) | st.none(), max_size=30))
@settings(max_examples=60, deadline=None)
def test_base64_binary_round_trip(values):
    rows = [
        [str(i), "null-ft" if v is None else base64.b64encode(v).decode(), "INSERT", str(i), TS]
        for i, v in enumerate(values)
    ]
    tbl = read(["id", "payload", *CDC], rows, {"id": "long", "payload": "binary"})
    assert tbl.schema.field("payload").type == pa.binary()
    assert tbl.column("payload").to_pylist() == values


def test_bad_base64():
    rows = [["1", "YWJj", "INSERT", "1", TS], ["2", "YW=j", "INSERT", "2", TS]]
    err = error(["id", "payload", *CDC], rows, {"id": "long", "payload": "binary"})
    assert err.row == 2
    assert str(err) == "row 2, column 'payload': 'YW=j' is not valid base64 (binary)"


ALL_TYPES = {
    "s": "string",
    "l": "long",
    "i": "int",
    "sh": "short",
    "d": "double",
    "f": "float",
    "b": "boolean",
    "ts": "timestamp",
    "dt": "date",
    "bin": "binary",
    "dec": "decimal(10,2)",
    "big": "decimal(38,0)",
}


def test_every_type_cast():
    header = list(ALL_TYPES) + CDC
    row1 = [
        "text",
        "-9223372036854775808",
        "2147483647",
        "-32768",
        "-2.2250738585072014E-308",
        "1.5",
        "true",
        "2007-12-03T10:15:30.123Z",
        "2007-12-03",
        base64.b64encode(b"\x00\xff").decode(),
        "-12345678.90",
        "99999999999999999999999999999999999999",
        "INSERT",
        "9223372036854775807",
        TS,
    ]
    row2 = ["null-ft"] * len(ALL_TYPES) + ["DELETE", "2", "2024-01-01T00:00:00Z"]
    tbl = read(header, [row1, row2], ALL_TYPES)
    expected_types = {
        "s": pa.string(),
        "l": pa.int64(),
        "i": pa.int32(),
        "sh": pa.int16(),
        "d": pa.float64(),
        "f": pa.float32(),
        "b": pa.bool_(),
        "ts": pa.timestamp("us", tz="UTC"),
        "dt": pa.date32(),
        "bin": pa.binary(),
        "dec": pa.decimal128(10, 2),
        "big": pa.decimal128(38, 0),
    }
    for name, typ in expected_types.items():
        assert tbl.schema.field(name).type == typ, name
        assert arrow_type(ALL_TYPES[name]) == typ
    first = tbl.slice(0, 1).to_pylist()[0]
    assert first["s"] == "text"
    assert first["l"] == -(2**63)
    assert first["i"] == 2**31 - 1
    assert first["sh"] == -32768
    assert first["d"] == -2.2250738585072014e-308
    assert first["f"] == 1.5
    assert first["b"] is True
    assert first["ts"] == datetime(2007, 12, 3, 10, 15, 30, 123000, tzinfo=UTC)
    assert first["dt"] == date(2007, 12, 3)
    assert first["bin"] == b"\x00\xff"
    assert first["dec"] == Decimal("-12345678.90")
    assert first["big"] == Decimal("9" * 38)
    assert first["cdc_change_seq"] == 2**63 - 1
    second = tbl.slice(1, 1).to_pylist()[0]
    assert all(second[name] is None for name in ALL_TYPES)


def test_booleans_and_special_floats():
    rows = [
        [str(i), b, d, "INSERT", str(i), TS]
        for i, (b, d) in enumerate(
            [("true", "NaN"), ("false", "Infinity"), ("TRUE", "-Infinity"), ("0", "1E+3")]
        )
    ]
    tbl = read(
        ["id", "flag", "amount", *CDC], rows, {"id": "long", "flag": "boolean", "amount": "double"}
    )
    assert tbl.column("flag").to_pylist() == [True, False, True, False]
    amounts = tbl.column("amount").to_pylist()
    assert amounts[0] != amounts[0] and amounts[1:] == [float("inf"), float("-inf"), 1000.0]


def test_timestamps_z_offset_naive_and_fractions():
    cells = [
        "2024-01-01T05:06:07Z",
        "2024-01-01T05:06:07.123Z",
        "2024-01-01T06:06:07+01:00",
        "2024-01-01T00:36:07.5-04:30",
        "2024-01-01T05:06:07",
        "2024-01-01 05:06:07.250",
        "2024-01-01T05:06:07.123456789Z",
        "2024-01-01",
        "0001-01-01T00:00:00Z",
    ]
    expected = [
        datetime(2024, 1, 1, 5, 6, 7, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, 123000, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, 500000, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, 250000, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, 123456, tzinfo=UTC),
        datetime(2024, 1, 1, tzinfo=UTC),
        datetime(1, 1, 1, tzinfo=UTC),
    ]
    rows = [[str(i), c, "INSERT", str(i), c] for i, c in enumerate(cells)]
    tbl = read(["id", "at", *CDC], rows, {"id": "long", "at": "timestamp"})
    for name in ("at", "cdc_commit_timestamp"):
        assert tbl.schema.field(name).type == pa.timestamp("us", tz="UTC")
        got = [v.astimezone(timezone(timedelta(0))) for v in tbl.column(name).to_pylist()]
        assert got == expected, name


def test_bad_cell_count_names_the_row():
    header = ["id", "name", "amount", *CDC]
    good = [["1", "a", "1", "INSERT", "1", TS]] * 16
    raw = jackson_csv(header, good) + b"17,b,2,INSERT,17\n" + b"18,c,3,INSERT,18,x,y\n"
    with pytest.raises(LandingFileError) as info:
        read_csv_events(raw, table(SIMPLE), "t.csv")
    assert str(info.value) == "row 17: expected 6 cells, found 5"
    assert info.value.row == 17


def test_bad_cell_count_after_quoted_newlines():
    header = ["id", "name", *CDC]
    raw = jackson_csv(header, [["1", "multi\nline\nvalue", "INSERT", "1", TS]]) + b"2,b,INSERT\n"
    with pytest.raises(LandingFileError) as info:
        read_csv_events(raw, table(SIMPLE), "t.csv")
    assert (str(info.value), info.value.row) == ("row 2: expected 5 cells, found 3", 2)


def test_too_many_cells():
    raw = (
        jackson_csv(["id", *CDC], [["1", "INSERT", "1", TS]])
        + b"2,INSERT,2,"
        + TS.encode()
        + b",extra\n"
    )
    with pytest.raises(LandingFileError, match=r"^row 2: expected 4 cells, found 5$"):
        read_csv_events(raw, table(SIMPLE), "t.csv")


@pytest.mark.parametrize(
    ("column", "typ", "bad", "message"),
    [
        ("amount", "double", "abc", "row 3, column 'amount': 'abc' is not a valid double"),
        ("amount", "long", "1.5", "row 3, column 'amount': '1.5' is not a valid long"),
        ("amount", "short", "40000", "row 3, column 'amount': '40000' is not a valid short"),
        ("amount", "int", "2147483648", "row 3, column 'amount': '2147483648' is not a valid int"),
        ("amount", "boolean", "yes", "row 3, column 'amount': 'yes' is not a valid boolean"),
        (
            "amount",
            "date",
            "2024-02-30",
            "row 3, column 'amount': '2024-02-30' is not a valid date",
        ),
        (
            "amount",
            "timestamp",
            "yesterday",
            "row 3, column 'amount': 'yesterday' is not a valid timestamp",
        ),
        (
            "amount",
            "decimal(5,2)",
            "12345.6",
            "row 3, column 'amount': '12345.6' is not a valid decimal(5,2)",
        ),
    ],
)
def test_bad_cast_names_row_and_column(column, typ, bad, message):
    good = {
        "double": "1",
        "long": "1",
        "short": "1",
        "int": "1",
        "boolean": "true",
        "date": "2024-01-01",
        "timestamp": TS,
        "decimal(5,2)": "1.25",
    }[typ]
    rows = [[str(i), good, "INSERT", str(i), TS] for i in range(1, 6)]
    rows[2][1] = bad
    rows[4][1] = bad  # only the first bad row is reported
    err = error(["id", column, *CDC], rows, {"id": "long", column: typ})
    assert str(err) == message
    assert err.row == 3


def test_bad_cdc_values():
    rows = [["1", "INSERT", "1", TS], ["2", "INSERT", "two", TS]]
    err = error(["id", *CDC], rows, SIMPLE)
    assert str(err) == "row 2, column 'cdc_change_seq': 'two' is not a valid long"
    rows = [["1", "INSERT", "1", "not a time"]]
    err = error(["id", *CDC], rows, SIMPLE)
    assert str(err) == "row 1, column 'cdc_commit_timestamp': 'not a time' is not a valid timestamp"


def test_bad_cast_found_in_a_large_file():
    rows = [[str(i), str(i * 0.5), "INSERT", str(i), TS] for i in range(50_000)]
    rows[31_337][1] = "oops"
    err = error(["id", "amount", *CDC], rows, SIMPLE)
    assert err.row == 31_338
    assert "column 'amount': 'oops'" in str(err)


def test_undeclared_header_column():
    err = error(["id", "x", *CDC], [["1", "2", "INSERT", "1", TS]], SIMPLE)
    # by position: the header of a file that is not the table's may be anything (a secret)
    assert str(err) == (
        "column #2 of the header is not a column the config declares"
        " (its name is not shown: the file may not be this table's)"
    )
    assert err.row is None


def test_missing_cdc_column():
    err = error(["id", "cdc_operation_type", "cdc_change_seq"], [["1", "INSERT", "1"]], SIMPLE)
    assert "cdc_commit_timestamp" in str(err)
    assert err.row is None


def test_duplicate_header_column():
    err = error(["id", "id", *CDC], [["1", "1", "INSERT", "1", TS]], SIMPLE)
    assert "twice" in str(err)


def test_empty_file_and_header_only():
    with pytest.raises(LandingFileError, match="no CSV header"):
        read_csv_events(b"", table(SIMPLE), "t.csv")
    tbl = read(["id", "name", *CDC], [], SIMPLE)
    assert tbl.num_rows == 0
    assert tbl.column_names == ["id", "name", *CDC, "_cdc_unmodified"]
    assert tbl.schema.field("id").type == pa.int64()


def test_quoted_header_and_crlf_and_bom():
    raw = (
        b'\xef\xbb\xbf"id","name",cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\r\n1,"a\r\nb",INSERT,1,'
        + TS.encode()
        + b"\r\n"
    )
    tbl = read_csv_events(raw, table(SIMPLE), "t.csv")
    assert tbl.column("id").to_pylist() == [1]
    assert tbl.column("name").to_pylist() == ["a\r\nb"]


def test_file_like_input_matches_bytes():
    header = ["name", "id", "amount", *CDC]
    rows = [
        [f"n{i},\n{i}", str(i), "unmod-ft" if i % 3 else "1.5", "UPDATE", str(i), TS]
        for i in range(20_000)
    ]
    raw = jackson_csv(header, rows)
    a = read_csv_events(raw, table(SIMPLE), "t.csv")
    b = read_csv_events(io.BytesIO(raw), table(SIMPLE), "t.csv")
    assert a.equals(b)
    assert a.column("_cdc_unmodified").to_pylist()[:3] == [[], ["amount"], ["amount"]]


def test_decoded_encrypted_compressed_csv(tmp_path):
    key = os.urandom(32)
    raw = jackson_csv(["id", "name", *CDC], [["1", "C:\\x\\", "INSERT", "1", TS]])
    p = tmp_path / "part-1.csv.zst.aes"
    p.write_bytes(encode_file_bytes(raw, "zstd", "aes-256-cbc", key))
    tbl = read_csv_events(decode_file(str(p), "zstd", "aes-256-cbc", [key]), table(SIMPLE), str(p))
    assert tbl.column("name").to_pylist() == ["C:\\x\\"]


def test_all_naive_and_all_offset_timestamp_columns():
    rows = [
        ["1", "2024-01-01T05:06:07", "INSERT", "1", "2024-01-01T06:06:07+01:00"],
        ["2", "2024-01-01", "INSERT", "2", "2024-01-01T05:06:07.1Z"],
    ]
    tbl = read(["id", "at", *CDC], rows, {"id": "long", "at": "timestamp"})
    assert tbl.column("at").to_pylist() == [
        datetime(2024, 1, 1, 5, 6, 7, tzinfo=UTC),
        datetime(2024, 1, 1, tzinfo=UTC),
    ]
    assert tbl.column("cdc_commit_timestamp").to_pylist() == [
        datetime(2024, 1, 1, 5, 6, 7, tzinfo=UTC),
        datetime(2024, 1, 1, 5, 6, 7, 100000, tzinfo=UTC),
    ]


def test_streamed_decoding_into_the_reader(tmp_path):
    key = os.urandom(32)
    rows = [[str(i), f"v{i}\\", "INSERT", str(i), TS] for i in range(30_000)]
    raw = jackson_csv(["id", "name", *CDC], rows)
    p = tmp_path / "part-2.csv.zst.aes"
    p.write_bytes(encode_file_bytes(raw, "zstd", "aes-256-cbc", key))
    with open_decoded_stream(str(p), "zstd", "aes-256-cbc", [key]) as stream:
        tbl = read_csv_events(stream, table(SIMPLE), str(p))
    assert tbl.equals(read_csv_events(raw, table(SIMPLE), str(p)))
    assert tbl.column("name")[29_999].as_py() == "v29999\\"


def test_bad_timestamp_among_mixed_spellings_names_its_own_row():
    """The one parser every format shares: mixed zones parse, the bad cell's row is named."""
    cells = ["2024-01-01T05:00:00Z", "2024-01-01 05:00:00", "2024-01-01T07:00:00+02:00", "soon"]
    rows = [[str(i), c, "INSERT", str(i), c] for i, c in enumerate(cells)]
    err = error(["id", "at", *CDC], rows, {"id": "long", "at": "timestamp"})
    assert (err.row, str(err)) == (4, "row 4, column 'at': 'soon' is not a valid timestamp")


def test_encrypted_table_reasons_never_quote_a_cell():
    secret = "not-a-number-SECRETPLAINTEXT"
    enc = TableConfig(
        name="orders",
        primary_key=("id",),
        start=datetime(2024, 1, 1, tzinfo=UTC),
        format="csv",
        encryption="aes-256-cbc",
        columns={"id": "long", "b": "binary"},
    )
    for header, row in ((["id", *CDC], [secret]), (["id", "b", *CDC], ["1", f"{secret}!"])):
        data = jackson_csv(header, [[*row, "INSERT", "1", TS]])
        with pytest.raises(LandingFileError) as info:
            read_csv_events(data, enc, source="t.csv")
        assert "SECRET" not in str(info.value)
        assert str(info.value).startswith("row 1, column ")
