"""Encrypted, compressed CSV and Parquet landing files, end to end through the real pipeline.

Fixtures are built here from the spec with ``cryptography`` and ``zstandard`` directly (not with
the platform's own encoder): plaintext, then ZSTD, then AES-256-CBC with PKCS7 padding and the
16-byte IV in the first 16 bytes of the file. Every test materializes with the shared Spark
session and reads the Delta tables back from disk with ``deltalake``.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from deltalake import DeltaTable

from cdc_platform.defs.alerts.webhook import AlertWebhookResource
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.columns import STATE_COLUMNS
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.history.invariants import CHECK_NAMES, NO_QUARANTINE
from cdc_platform.lib.history.merge import TOUCHED_KEYS
from cdc_platform.lib.history.versions import TMAX
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform.lib.ledgers import quarantine
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize
from cdc_platform.lib.storage.stores import Location
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import history_rows

MS = timedelta(milliseconds=1)
HOUR = datetime(2024, 1, 1, 5, tzinfo=UTC)
CDC = ("cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp")
NULL = "__NULL__"
UNMOD = "__UNMOD__"
AES = "aes-256-cbc"

KEY = bytes(range(32))
OTHER_KEY = bytes(range(200, 232))
OLD_KEY = bytes(range(50, 82))
NEW_KEY = bytes(range(90, 122))
FILE_KEY = bytes(range(150, 182))


# -- fixtures written from the spec ---------------------------------------------------------------


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def aes_cbc(data: bytes, key: bytes, *, pad: bool = True) -> bytes:
    """IV (16 bytes) + AES-256-CBC(data); PKCS7-padded unless ``pad`` is False."""
    iv = os.urandom(16)
    if pad:
        padder = padding.PKCS7(128).padder()
        data = padder.update(data) + padder.finalize()
    enc = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return iv + enc.update(data) + enc.finalize()


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def encode(plain: bytes, compression: str, encryption: str, key: bytes | None = KEY) -> bytes:
    """ZSTD first (if asked), then AES (if asked): the order the SDK writes."""
    data = zstd(plain) if compression == "zstd" else plain
    if encryption == AES:
        assert key is not None
        data = aes_cbc(data, key)
    return data


def cell(value: Any) -> str:
    if value is None:
        return NULL
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def csv_bytes(header: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> bytes:
    """CSV as Fivetran writes it: a header row, quoted cells with doubled quotes, no escapes."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for r in rows:
        writer.writerow([cell(r.get(c)) for c in header])
    return buf.getvalue().encode()


def parquet_bytes(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([dict(r) for r in rows], schema=schema), buf)
    return buf.getvalue()


def land(lake: dict[str, Path], table: str, hour: datetime, name: str, data: bytes) -> Path:
    folder = hour_folder(lake["landing"], table, hour)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(data)
    return path


def rel(lake: dict[str, Path], path: Path) -> str:
    return os.path.relpath(path, lake["landing"])


def ev(op: str, seq: int, ts: datetime, **values: Any) -> dict[str, Any]:
    return {**values, "cdc_operation_type": op, "cdc_change_seq": seq, "cdc_commit_timestamp": ts}


def csv_table(
    name: str, columns: Mapping[str, str], compression: str = "zstd", encryption: str = AES
) -> TableConfig:
    return TableConfig(
        name=name,
        primary_key=("id",),
        start=HOUR - timedelta(hours=24),
        format="csv",
        compression=compression,
        encryption=encryption,
        null_string=NULL,
        unmodified_string=UNMOD,
        columns=dict(columns),
    )


def run(
    spark, lake: dict[str, Path], table: TableConfig, hour: datetime, keyring: Keyring | None
) -> MaterializationOutcome:
    return materialize(spark, table, lake["landing"], lake["warehouse"], [hour], keyring)


def history(lake: dict[str, Path], table: str) -> list[dict[str, Any]]:
    return history_rows(TablePaths.of(lake["warehouse"], table).history)


def current_quarantine(lake: dict[str, Path], table: str) -> list[quarantine.QuarantinedFile]:
    return quarantine.current(TablePaths.of(lake["warehouse"], table).quarantine)


def by_key_start(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(rows, key=lambda r: (r["id"], r["_fivetran_start"]))


def version(id_: int, start: datetime, end: datetime, **values: Any) -> dict[str, Any]:
    return {
        "id": id_,
        **values,
        "_fivetran_start": start,
        "_fivetran_end": end,
        "_fivetran_active": end == TMAX,
    }


# -- 1. docs/HISTORY_MODE.md example B (unmodified cells), from an encrypted ZSTD CSV ---------

SEED_COLUMNS = {"id": "long", "col1": "string", "col2": "long"}
T1 = datetime(2024, 1, 1, 5, 0, 0, 0, tzinfo=UTC)
T2 = datetime(2024, 1, 1, 5, 10, 0, 250_000, tzinfo=UTC)
T3 = datetime(2024, 1, 1, 6, 1, 0, 1_000, tzinfo=UTC)
T4 = datetime(2024, 1, 1, 6, 2, 30, 500_000, tzinfo=UTC)
T5 = datetime(2024, 1, 1, 6, 3, 0, 999_000, tzinfo=UTC)


def test_seed_000_update_files_from_encrypted_zstd_csv(spark, lake):
    t = csv_table("seed000", SEED_COLUMNS)
    keyring = Keyring.from_mapping({"tables": {t.name: b64(KEY)}})
    # The header is not in config order: readers must follow it.
    header = ["col2", "cdc_change_seq", "id", "cdc_operation_type", "col1", "cdc_commit_timestamp"]
    existing = [
        ev("INSERT", 1, T1, id=1, col1="abc", col2=1),
        ev("UPDATE", 2, T2, id=1, col1="pqr", col2=2),
        ev("INSERT", 3, T2, id=2, col1="mno", col2=3),
    ]
    updates = [
        ev("UPDATE", 4, T3, id=1, col1="xyz", col2=UNMOD),
        ev("UPDATE", 5, T4, id=2, col1=UNMOD, col2=1000),
        ev("UPDATE", 6, T5, id=1, col1="def", col2=UNMOD),
    ]
    h1, h2 = HOUR, HOUR + timedelta(hours=1)
    land(lake, t.name, h1, "part-1.csv.zst.aes", encode(csv_bytes(header, existing), "zstd", AES))
    first = run(spark, lake, t, h1, keyring)
    assert first.events_new == 3 and not first.quarantined

    raw = csv_bytes(header, updates)
    assert raw.count(UNMOD.encode()) == 3  # the update file really carries the sentinel
    land(lake, t.name, h2, "part-1.csv.zst.aes", encode(raw, "zstd", AES))
    second = run(spark, lake, t, h2, keyring)
    assert second.events_new == 3 and not second.quarantined

    # docs/HISTORY_MODE.md example B, the final table.
    expected = [
        version(1, T1, T2 - MS, col1="abc", col2=1),
        version(1, T2, T3 - MS, col1="pqr", col2=2),
        version(2, T2, T4 - MS, col1="mno", col2=3),
        version(1, T5, TMAX, col1="def", col2=2),
        version(1, T3, T5 - MS, col1="xyz", col2=2),
        version(2, T4, TMAX, col1="mno", col2=1000),
    ]
    assert by_key_start(history(lake, t.name)) == by_key_start(expected)
    assert current_quarantine(lake, t.name) == []
    # Decrypted key values stay out of the Delta log: an encrypted table's commits list none
    # (a plaintext table's small runs do, for the checks' scope: test_invariant_checks.py).
    commits = DeltaTable(str(TablePaths.of(lake["warehouse"], t.name).history.path)).history()
    assert len(commits) >= 2 and not [c for c in commits if TOUCHED_KEYS in c]


# -- 2. every format x compression x encryption gives the same table -------------------------------

T0 = datetime(2024, 3, 1, 10, 0, tzinfo=UTC)
S = timedelta(seconds=1)
WIDE_COLUMNS = {
    "id": "long",
    "name": "string",
    "amount": "double",
    "flag": "boolean",
    "payload": "binary",
    "seen_at": "timestamp",
}
WIDE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("name", pa.string()),
        pa.field("amount", pa.float64()),
        pa.field("flag", pa.bool_()),
        pa.field("payload", pa.binary()),
        pa.field("seen_at", pa.timestamp("us", tz="UTC")),
        pa.field("cdc_operation_type", pa.string()),
        pa.field("cdc_change_seq", pa.int64()),
        pa.field("cdc_commit_timestamp", pa.timestamp("us", tz="UTC")),
    ]
)
TRICKY = 'a\\"b,c\nline 2 \\n'  # backslash is not an escape; quote, comma, newline inside a cell
SEEN = T0 + timedelta(seconds=5, microseconds=123_456)
WIDE_EVENTS = [
    ev(
        "INSERT",
        1,
        T0 + S,
        id=1,
        name="plain",
        amount=1.5,
        flag=True,
        payload=b"\x00\x01\xff",
        seen_at=T0,
    ),
    ev("INSERT", 2, T0 + S, id=2, name=TRICKY, amount=None, flag=None, payload=None, seen_at=None),
    ev(
        "UPDATE",
        3,
        T0 + 2 * S,
        id=1,
        name="changed",
        amount=2.25,
        flag=False,
        payload=b"",
        seen_at=SEEN,
    ),
    ev("DELETE", 4, T0 + 3 * S, id=2),
    ev(
        "UPDATE",
        5,
        T0 + 4 * S,
        id=1,
        name="changed",
        amount=2.25,
        flag=False,
        payload=b"",
        seen_at=SEEN,
    ),
    ev("INSERT", 6, T0 + 4 * S, id=3, name="", amount=-0.5, flag=True, payload=b"bin", seen_at=T0),
]
WIDE_EXPECTED = [
    version(
        1,
        T0 + S,
        T0 + 2 * S - MS,
        name="plain",
        amount=1.5,
        flag=True,
        payload=b"\x00\x01\xff",
        seen_at=T0,
    ),
    version(
        1, T0 + 2 * S, TMAX, name="changed", amount=2.25, flag=False, payload=b"", seen_at=SEEN
    ),
    version(2, T0 + S, T0 + 3 * S, name=TRICKY, amount=None, flag=None, payload=None, seen_at=None),
    version(3, T0 + 4 * S, TMAX, name="", amount=-0.5, flag=True, payload=b"bin", seen_at=T0),
]
WIDE_TYPES = {
    "id": pa.int64(),
    "name": pa.string(),
    "amount": pa.float64(),
    "flag": pa.bool_(),
    "payload": pa.binary(),
    "seen_at": pa.timestamp("us", tz="UTC"),
    "_fivetran_start": pa.timestamp("us", tz="UTC"),
    "_fivetran_end": pa.timestamp("us", tz="UTC"),
    "_fivetran_active": pa.bool_(),
    "_fivetran_synced": pa.timestamp("us", tz="UTC"),
}


# Every value of each setting, and every pair of two settings' values, once: four runs
# instead of eight (each codec alone is covered by test_codecs.py, without Spark).
@pytest.mark.parametrize(
    ("file_format", "compression", "encryption"),
    [
        ("parquet", "none", "none"),
        ("parquet", "zstd", AES),
        ("csv", "none", AES),
        ("csv", "zstd", "none"),
    ],
)
def test_every_encoding_gives_the_same_history(spark, lake, file_format, compression, encryption):
    name = f"wide_{file_format}_{compression}_{encryption.replace('-', '_')}"
    t = TableConfig(
        name=name,
        primary_key=("id",),
        start=HOUR - timedelta(hours=24),
        format=file_format,
        compression=compression,
        encryption=encryption,
        null_string=NULL if file_format == "csv" else None,
        columns=WIDE_COLUMNS if file_format == "csv" else {},
    )
    if file_format == "csv":  # change columns first: the header, not the config, gives the order
        plain = csv_bytes([*CDC, *WIDE_COLUMNS], WIDE_EVENTS)
    else:
        plain = parquet_bytes(WIDE_EVENTS, WIDE_SCHEMA)
    # two files in one hour folder, so the events are merged across files
    land(lake, name, HOUR, f"part-a.{file_format}", encode(plain, compression, encryption))
    # a second file: seq 3 delivered again, and a visibly identical event under a new seq
    later = [WIDE_EVENTS[2], {**WIDE_EVENTS[4], "cdc_change_seq": 7}]
    plain_b = (
        csv_bytes([*WIDE_COLUMNS, *CDC], later)
        if file_format == "csv"
        else parquet_bytes(later, WIDE_SCHEMA)
    )
    land(lake, name, HOUR, f"part-b.{file_format}", encode(plain_b, compression, encryption))
    keyring = Keyring.from_mapping({"tables": {name: b64(KEY)}}) if encryption == AES else None

    result = run(spark, lake, t, HOUR, keyring)

    assert result.quarantined == ()
    assert (result.files_read, result.events_read, result.events_new) == (2, 8, 7)
    assert by_key_start(history(lake, name)) == by_key_start(WIDE_EXPECTED)
    schema = DeltaTable(str(TablePaths.of(lake["warehouse"], name).history)).schema().to_arrow()
    types = {f.name: pa.field(f).type for f in schema}
    # the merge's state columns follow the contract's columns
    assert [types.pop(c) for c in STATE_COLUMNS] == [
        pa.bool_(),
        pa.timestamp("us", tz="UTC"),
        pa.list_(pa.string()),
    ]
    assert types == WIDE_TYPES
    assert [f.name for f in schema][: len(WIDE_TYPES)] == list(WIDE_TYPES)


# -- 3. file keys and key rotation -------------------------------------------------------------------


def test_file_key_wins_and_rotated_table_keys_all_load(spark, lake):
    t = csv_table("rotation", SEED_COLUMNS)
    header = [*SEED_COLUMNS, *CDC]
    files = {
        "part-old.csv.zst.aes": (OLD_KEY, ev("INSERT", 1, T1, id=1, col1="old", col2=1)),
        "part-new.csv.zst.aes": (NEW_KEY, ev("INSERT", 2, T1, id=2, col1="new", col2=2)),
        "part-own.csv.zst.aes": (FILE_KEY, ev("INSERT", 3, T1, id=3, col1="own", col2=3)),
    }
    paths = {
        name: land(lake, t.name, HOUR, name, encode(csv_bytes(header, [row]), "zstd", AES, key))
        for name, (key, row) in files.items()
    }
    own = rel(lake, paths["part-own.csv.zst.aes"])
    keyring = Keyring.from_mapping(
        {"tables": {t.name: [b64(OLD_KEY), b64(NEW_KEY)]}, "files": {own: b64(FILE_KEY)}}
    )
    # the file's own key is tried before the table's keys, which keep their listed order
    assert keyring.keys_for(t.name, own) == [FILE_KEY, OLD_KEY, NEW_KEY]
    assert keyring.keys_for(t.name, rel(lake, paths["part-new.csv.zst.aes"])) == [OLD_KEY, NEW_KEY]

    result = run(spark, lake, t, HOUR, keyring)

    assert result.quarantined == ()
    assert result.events_new == 3
    assert sorted((r["id"], r["col1"]) for r in history(lake, t.name)) == [
        (1, "old"),
        (2, "new"),
        (3, "own"),
    ]


def test_file_key_alone_is_enough_and_is_not_shadowed_by_a_wrong_table_key(spark, lake):
    """A file with its own key loads even though the table key cannot decrypt it."""
    t = csv_table("file_key", SEED_COLUMNS)
    header = [*SEED_COLUMNS, *CDC]
    own = land(
        lake,
        t.name,
        HOUR,
        "part-1.csv.zst.aes",
        encode(
            csv_bytes(header, [ev("INSERT", 1, T1, id=1, col1="x", col2=1)]), "zstd", AES, FILE_KEY
        ),
    )
    keyring = Keyring.from_mapping(
        {"tables": {t.name: b64(OTHER_KEY)}, "files": {rel(lake, own): b64(FILE_KEY)}}
    )
    result = run(spark, lake, t, HOUR, keyring)
    assert result.quarantined == () and result.events_new == 1


# -- 4. bad input is set aside, the rest applied; a fixed file comes in -------------------------------

BAD_HEADER = [*SEED_COLUMNS, *CDC]
GOOD_ROWS = [ev("INSERT", 1, T1, id=1, col1="good", col2=1)]
LATE_ROWS = [
    ev("INSERT", 2, T1, id=2, col1="two", col2=2),
    ev("INSERT", 3, T2, id=3, col1="three", col2=3),
]


def _bad_padding(plain: bytes, key: bytes) -> bytes:
    """Valid ZSTD, encrypted without PKCS7: the filler's last byte is 0, never valid padding."""
    data = zstd(plain)
    return aes_cbc(data + b"\x00" * (16 - len(data) % 16), key, pad=False)


def _corrupt_zstd(plain: bytes, key: bytes) -> bytes:
    """A ZSTD frame whose magic number survives but whose header and blocks are garbage."""
    data = zstd(plain)
    return aes_cbc(data[:4] + b"\xff" * (len(data) - 4), key)


def _cells(rows: Sequence[Mapping[str, Any]], extra_in_row: int) -> bytes:
    text = csv_bytes(BAD_HEADER, rows).decode().split("\n")
    text[extra_in_row] += ",surplus"  # line 0 is the header
    return "\n".join(text).encode()


def _bad_value(rows: Sequence[Mapping[str, Any]], row: int) -> bytes:
    rows = [dict(r) for r in rows]
    rows[row - 1]["col2"] = "abc"
    return csv_bytes(BAD_HEADER, rows)


LATE_PLAIN = csv_bytes(BAD_HEADER, LATE_ROWS)
# case -> (bad file bytes, reason substring, bad row or None)
BAD_CASES = {
    "wrong_key": (lambda: encode(LATE_PLAIN, "zstd", AES, OTHER_KEY), "wrong key", None),
    "no_key": (lambda: encode(LATE_PLAIN, "zstd", AES, KEY), "no decryption key", None),
    "truncated": (lambda: encode(LATE_PLAIN, "zstd", AES, KEY)[:-5], "truncated", None),
    "bad_padding": (lambda: _bad_padding(LATE_PLAIN, KEY), "bad padding", None),
    "corrupt_zstd": (lambda: _corrupt_zstd(LATE_PLAIN, KEY), "corrupt ZSTD", None),
    "cell_count": (
        lambda: encode(_cells(LATE_ROWS, 2), "zstd", AES, KEY),
        "row 2: expected 6 cells, found 7",
        2,
    ),
    "bad_cast": (
        lambda: encode(_bad_value(LATE_ROWS, 2), "zstd", AES, KEY),
        "row 2, column 'col2': the value is not a valid long",  # never the plaintext
        2,
    ),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_file_is_set_aside_and_comes_in_once_fixed(spark, lake, case):
    make_bad, reason, bad_row = BAD_CASES[case]
    t = csv_table(f"bad_{case}", SEED_COLUMNS)
    good = land(
        lake,
        t.name,
        HOUR,
        "part-1.csv.zst.aes",
        encode(csv_bytes(BAD_HEADER, GOOD_ROWS), "zstd", AES),
    )
    bad = land(lake, t.name, HOUR, "part-2.csv.zst.aes", make_bad())
    bad_bytes = bad.read_bytes()
    if case == "no_key":  # only the good file has a key: there is no table key at all
        ring: dict[str, Any] = {"files": {rel(lake, good): b64(KEY)}}
    else:
        ring = {"tables": {t.name: b64(KEY)}}

    result = run(spark, lake, t, HOUR, Keyring.from_mapping(ring))

    assert [q.file for q in result.quarantined] == [rel(lake, bad)]
    q = result.quarantined[0]
    assert reason in q.reason, q.reason
    assert q.row == bad_row
    assert q.partition == hour_to_partition_key(HOUR)
    assert result.events_new == 1
    assert [(r["id"], r["col1"]) for r in history(lake, t.name)] == [(1, "good")]
    assert bad.read_bytes() == bad_bytes  # set aside in place, never rewritten or deleted
    assert [(e.file, e.reason, e.row) for e in current_quarantine(lake, t.name)] == [
        (q.file, q.reason, q.row)
    ]

    # Fix it: re-deliver a good file under the same name (or, for a missing key, add the key).
    if case == "no_key":
        ring["files"][rel(lake, bad)] = b64(KEY)
    else:
        bad.write_bytes(encode(LATE_PLAIN, "zstd", AES, KEY))
    again = run(spark, lake, t, HOUR, Keyring.from_mapping(ring))

    assert again.quarantined == ()
    assert again.events_new == 2
    assert [(r["id"], r["col1"]) for r in history(lake, t.name)] == [
        (1, "good"),
        (2, "two"),
        (3, "three"),
    ]
    assert current_quarantine(lake, t.name) == []


# -- 5. keys never leak ----------------------------------------------------------------------------


def _key_spellings(*keys: bytes) -> list[str]:
    out = []
    for k in keys:
        out += [b64(k), k.hex(), repr(k), repr(k)[2:-1], k.decode("latin-1")]
        out += [base64.urlsafe_b64encode(k).decode(), b64(k).rstrip("=")]
    return out


def test_keys_never_leak_after_a_wrong_key(spark, lake):
    t = csv_table("leak", SEED_COLUMNS)
    land(
        lake,
        t.name,
        HOUR,
        "part-1.csv.zst.aes",
        encode(csv_bytes(BAD_HEADER, GOOD_ROWS), "zstd", AES, OTHER_KEY),
    )
    keyring = Keyring.from_mapping(
        {"tables": {t.name: b64(KEY)}, "files": {"x/y.csv": b64(FILE_KEY)}}
    )

    result = run(spark, lake, t, HOUR, keyring)

    assert len(result.quarantined) == 1
    texts = {
        "str(result)": str(result),
        "repr(result)": repr(result),
        "reasons": " ".join(q.reason for q in result.quarantined),
        "stored reasons": " ".join(q.reason for q in current_quarantine(lake, t.name)),
        "spark conf": repr(spark.sparkContext.getConf().getAll()),
        "str(keyring)": f"{keyring} {keyring!r} {keyring!s:>10}",
    }
    for where, text in texts.items():
        for spelling in _key_spellings(KEY, OTHER_KEY, FILE_KEY):
            assert spelling not in text, f"key material in {where}"


# -- 6. the Dagster asset and its checks -------------------------------------------------------------


def test_dagster_asset_reports_quarantine_and_fails_only_that_check(
    spark, lake, tmp_path, monkeypatch
):
    t = csv_table("dagster_csv", SEED_COLUMNS)
    platform = PlatformConfig(
        landing_root=lake["landing"], warehouse_root=Location.of(lake["warehouse"]), tables=(t,)
    )
    land(
        lake,
        t.name,
        HOUR,
        "part-1.csv.zst.aes",
        encode(csv_bytes(BAD_HEADER, GOOD_ROWS), "zstd", AES),
    )
    land(lake, t.name, HOUR, "part-2.csv.zst.aes", encode(LATE_PLAIN, "zstd", AES, OTHER_KEY))
    keyring_path = tmp_path / "keyring.json"
    keyring_path.write_text(json.dumps({"tables": {t.name: [b64(KEY)]}}))
    keyring_path.chmod(0o600)
    monkeypatch.setenv("CDC_KEYRING", str(keyring_path))  # the deployment's, never a run's
    defs = build_table_definitions(platform, t)
    instance = dg.DagsterInstance.ephemeral()

    result = dg.materialize(
        [defs.asset, defs.checks],
        partition_key=hour_to_partition_key(HOUR),
        resources={
            "spark": SparkResource(
                stop_at_end_of_run=False,
                spark_config={
                    "spark.sql.shuffle.partitions": "2",
                    "spark.default.parallelism": "2",
                },
            ),
            "keyring": KeyringResource(),
            "alert_webhook": AlertWebhookResource(),
        },
        instance=instance,
        raise_on_error=False,
    )

    mats = result.get_asset_materialization_events()
    assert len(mats) == 1
    metadata = mats[0].materialization.metadata
    assert metadata["files_quarantined"].value == 1
    assert metadata["events_new"].value == 1
    quarantined = metadata["quarantined"]
    assert isinstance(quarantined, dg.JsonMetadataValue)
    listed = quarantined.value
    assert isinstance(listed, Sequence)
    assert [q["file"] for q in listed] == [
        f"{t.name}/year=2024/month=01/day=01/hour=05/part-2.csv.zst.aes"
    ]
    assert "wrong key" in listed[0]["reason"]

    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert set(evaluations) == set(CHECK_NAMES)
    assert evaluations[NO_QUARANTINE].passed is False
    assert {n for n, e in evaluations.items() if not e.passed} == {NO_QUARANTINE}
    assert [(r["id"], r["col1"]) for r in history(lake, t.name)] == [(1, "good")]

    as_json = json.dumps({k: v.value for k, v in metadata.items()}, default=str)
    checks_json = json.dumps(
        [{k: v.value for k, v in e.metadata.items()} for e in evaluations.values()], default=str
    )
    logs = " ".join(str(e) for e in instance.all_logs(result.run_id))
    for spelling in _key_spellings(KEY, OTHER_KEY):
        assert spelling not in as_json
        assert spelling not in checks_json
        assert spelling not in logs


def test_bad_file_replaced_by_a_redelivery_under_a_new_name_leaves_the_quarantine(spark, lake):
    """The bad file is removed by an operator and re-delivered fixed under another name."""
    t = csv_table("redelivered", SEED_COLUMNS)
    keyring = Keyring.from_mapping({"tables": {t.name: b64(KEY)}})
    land(
        lake,
        t.name,
        HOUR,
        "part-1.csv.zst.aes",
        encode(csv_bytes(BAD_HEADER, GOOD_ROWS), "zstd", AES),
    )
    bad = land(lake, t.name, HOUR, "part-2.csv.zst.aes", encode(LATE_PLAIN, "zstd", AES, OTHER_KEY))
    first = run(spark, lake, t, HOUR, keyring)
    assert [q.file for q in first.quarantined] == [rel(lake, bad)]

    bad.unlink()
    land(lake, t.name, HOUR, "part-2-redelivered.csv.zst.aes", encode(LATE_PLAIN, "zstd", AES))
    again = run(spark, lake, t, HOUR, keyring)

    assert again.quarantined == () and again.events_new == 2
    assert [r["id"] for r in history(lake, t.name)] == [1, 2, 3]
    assert current_quarantine(lake, t.name) == []
