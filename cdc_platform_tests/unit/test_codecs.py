"""Decoding landing files: ZSTD and AES-256-CBC exactly as the Fivetran SDK ships batch files."""

from __future__ import annotations

import base64
import io
import os
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cdc_platform.lib.landing.decoding.codecs import (
    LandingFileError,
    compress_zstd,
    decode_file,
    encode_file_bytes,
    encrypt_bytes,
    open_decoded_stream,
)
from cdc_platform.lib.landing.decoding.formats import FORMATS
from cdc_platform.lib.landing.decoding.keyring import Keyring

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
KEY_C = os.urandom(32)
ALL_KEYS = (KEY_A, KEY_B, KEY_C)


# -- an independent encoder, written from the spec ------------------------------------------------


def spec_encrypt(plaintext: bytes, key: bytes, iv: bytes | None = None) -> bytes:
    """AES-256-CBC, PKCS5/PKCS7 padding, IV in the first 16 bytes of the file."""
    iv = iv or os.urandom(16)
    padder = padding.PKCS7(128).padder()
    padded = padder.update(plaintext) + padder.finalize()
    enc = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return iv + enc.update(padded) + enc.finalize()


def spec_encode(plaintext: bytes, compression: str, encryption: str, key: bytes) -> bytes:
    data = zstandard.ZstdCompressor().compress(plaintext) if compression == "zstd" else plaintext
    return spec_encrypt(data, key) if encryption == "aes-256-cbc" else data


def parquet_bytes() -> bytes:
    tbl = pa.table(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "name": ["a", None, "c"],
            "cdc_operation_type": ["INSERT", "UPDATE", "DELETE"],
            "cdc_change_seq": pa.array([1, 2, 3], pa.int64()),
            "cdc_commit_timestamp": pa.array([1, 2, 3], pa.timestamp("us", tz="UTC")),
        }
    )
    sink = io.BytesIO()
    pq.write_table(tbl, sink)
    return sink.getvalue()


def csv_bytes(rows: int = 3) -> bytes:
    lines = ["id,name,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp"]
    lines += [f'{i},"name, {i}",INSERT,{i},2024-01-01T05:06:07.123Z' for i in range(rows)]
    return ("\n".join(lines) + "\n").encode()


def write(tmp_path: Path, data: bytes, name: str = "file.bin") -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def assert_secret_free(message: str) -> None:
    for key in ALL_KEYS:
        assert base64.b64encode(key).decode() not in message
        assert key.hex() not in message
        assert repr(key) not in message
        assert repr(key)[2:-1] not in message


def decode_error(path: str, compression: str, encryption: str, keys, **kw) -> LandingFileError:
    with pytest.raises(LandingFileError) as info:
        decode_file(path, compression, encryption, keys, **kw)
    assert_secret_free(str(info.value))
    assert_secret_free(repr(info.value))
    return info.value


# -- round trips ----------------------------------------------------------------------------------

COMBOS = [(c, e) for c in ("none", "zstd") for e in ("none", "aes-256-cbc")]


@pytest.mark.parametrize(("compression", "encryption"), COMBOS)
@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_round_trip_every_combination(tmp_path, compression, encryption, kind):
    plain = parquet_bytes() if kind == "parquet" else csv_bytes(500)
    path = write(tmp_path, spec_encode(plain, compression, encryption, KEY_A))
    keys = [KEY_A] if encryption != "none" else []
    assert decode_file(path, compression, encryption, keys) == plain
    assert (
        decode_file(path, compression, encryption, keys, looks_like=FORMATS[kind].looks_like)
        == plain
    )
    with open_decoded_stream(path, compression, encryption, keys) as stream:
        assert stream.read() == plain
    if kind == "parquet":
        tbl = pq.read_table(pa.BufferReader(decode_file(path, compression, encryption, keys)))
        assert tbl.column("id").to_pylist() == [1, 2, 3]


@pytest.mark.parametrize(("compression", "encryption"), COMBOS)
def test_encode_file_bytes_matches_the_spec(tmp_path, compression, encryption):
    plain = csv_bytes(50)
    data = encode_file_bytes(
        plain, compression, encryption, KEY_B if encryption != "none" else None
    )
    path = write(tmp_path, data)
    keys = [KEY_B] if encryption != "none" else []
    assert decode_file(path, compression, encryption, keys) == plain
    if encryption == "none" and compression == "none":
        assert data == plain


def test_encrypt_bytes_is_the_spec_cipher():
    iv = bytes(range(16))
    for plain in (b"", b"x", b"y" * 15, b"z" * 16, b"w" * 1000):
        assert encrypt_bytes(plain, KEY_A, iv) == spec_encrypt(plain, KEY_A, iv)
    assert encrypt_bytes(b"abc", KEY_A)[:16] != encrypt_bytes(b"abc", KEY_A)[:16]  # random IV


def test_compress_zstd_round_trips():
    data = csv_bytes(100)
    assert zstandard.ZstdDecompressor().decompress(compress_zstd(data)) == data


def test_empty_plaintext_round_trips(tmp_path):
    for compression in ("none", "zstd"):
        path = write(tmp_path, spec_encode(b"", compression, "aes-256-cbc", KEY_A))
        assert os.path.getsize(path) == 32
        assert decode_file(path, compression, "aes-256-cbc", [KEY_A]) == b""


def test_large_file_streams_across_chunks(tmp_path):
    plain = os.urandom(300_000) * 10  # > 1 MiB read chunk, poorly compressible parts
    path = write(tmp_path, spec_encode(plain, "zstd", "aes-256-cbc", KEY_A))
    assert decode_file(path, "zstd", "aes-256-cbc", [KEY_A]) == plain
    with open_decoded_stream(path, "zstd", "aes-256-cbc", [KEY_A]) as stream:
        got = b"".join(iter(lambda: stream.read(12345), b""))
    assert got == plain


def test_multi_frame_and_no_content_size(tmp_path):
    plain = csv_bytes(2000)
    no_size = zstandard.ZstdCompressor(write_content_size=False)
    frames = no_size.compress(plain[:1000]) + zstandard.ZstdCompressor().compress(plain[1000:])
    cobj = no_size.compressobj()
    streamed = cobj.compress(plain) + cobj.flush()
    for compressed in (frames, streamed):
        path = write(tmp_path, spec_encrypt(compressed, KEY_A))
        assert decode_file(path, "zstd", "aes-256-cbc", [KEY_A]) == plain
        path = write(tmp_path, compressed)
        assert decode_file(path, "zstd", "none", []) == plain
        with open_decoded_stream(path, "zstd", "none", []) as stream:
            assert stream.read() == plain


# -- keys -----------------------------------------------------------------------------------------

REL = "orders/year=2024/month=01/day=01/hour=05/part-1.csv.zst.aes"


def keyring(tables: dict, files: dict | None = None) -> Keyring:
    def b64(v):
        return (
            [base64.b64encode(k).decode() for k in v]
            if isinstance(v, list)
            else base64.b64encode(v).decode()
        )

    return Keyring.from_mapping(
        {
            "tables": {t: b64(v) for t, v in tables.items()},
            "files": {p: b64(v) for p, v in (files or {}).items()},
        }
    )


def test_file_key_is_used_before_table_key(tmp_path):
    plain = csv_bytes()
    path = write(tmp_path, spec_encode(plain, "zstd", "aes-256-cbc", KEY_C))
    ring = keyring({"orders": KEY_A}, {REL: KEY_C})
    keys = ring.keys_for("orders", REL)
    assert keys == [KEY_C, KEY_A]
    assert decode_file(path, "zstd", "aes-256-cbc", keys) == plain


def test_table_key_used_when_file_key_is_wrong(tmp_path):
    plain = csv_bytes()
    path = write(tmp_path, spec_encode(plain, "zstd", "aes-256-cbc", KEY_A))
    keys = keyring({"orders": KEY_A}, {REL: KEY_C}).keys_for("orders", REL)
    assert decode_file(path, "zstd", "aes-256-cbc", keys) == plain


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_key_rotation_second_table_key(tmp_path, compression, kind):
    plain = parquet_bytes() if kind == "parquet" else csv_bytes()
    path = write(tmp_path, spec_encode(plain, compression, "aes-256-cbc", KEY_B))
    keys = keyring({"orders": [KEY_A, KEY_B]}).keys_for("orders", REL)
    assert keys == [KEY_A, KEY_B]
    assert decode_file(path, compression, "aes-256-cbc", keys) == plain
    with open_decoded_stream(path, compression, "aes-256-cbc", keys) as stream:
        assert stream.read() == plain


def test_key_rotation_many_wrong_keys_uncompressed(tmp_path):
    # with no compression, padding plus the start of the plaintext pick the key
    plain = csv_bytes()
    path = write(tmp_path, spec_encrypt(plain, KEY_C))
    wrong = [os.urandom(32) for _ in range(300)]
    assert decode_file(path, "none", "aes-256-cbc", [*wrong, KEY_C]) == plain


def test_no_wrong_key_is_taken_for_passing_the_padding_check_alone(tmp_path):
    """A wrong key passes the PKCS7 check about 1 time in 256: about 8 of these 2,000 would
    (a CI run once took one), and without a format to check the start none may be taken."""
    path = write(tmp_path, spec_encrypt(csv_bytes(), KEY_A))
    wrong = [os.urandom(32) for _ in range(2000)]
    err = decode_error(path, "none", "aes-256-cbc", wrong)
    assert "could not decrypt with any of the 2000 key(s)" in str(err)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_wrong_key(tmp_path, compression):
    path = write(tmp_path, spec_encode(csv_bytes(), compression, "aes-256-cbc", KEY_A))
    err = decode_error(path, compression, "aes-256-cbc", [KEY_B, KEY_C])
    assert str(err) == (
        "could not decrypt with any of the 2 key(s) for this file: wrong key or corrupt ciphertext (bad padding)"
    )
    assert err.row is None
    with pytest.raises(LandingFileError, match="could not decrypt with any of the 2 key"):
        open_decoded_stream(path, compression, "aes-256-cbc", [KEY_B, KEY_C])


def test_no_key(tmp_path):
    path = write(tmp_path, spec_encode(csv_bytes(), "zstd", "aes-256-cbc", KEY_A))
    err = decode_error(path, "zstd", "aes-256-cbc", [])
    assert str(err).startswith(
        "no decryption key for this file: add it to the keyring under files/"
    )
    err = decode_error(path, "zstd", "aes-256-cbc", [], table="orders", relative_path=REL)
    assert (
        str(err)
        == f"no decryption key for this file: add it to the keyring under files/{REL} or tables/orders"
    )


def test_key_of_wrong_size_is_reported_without_its_value(tmp_path):
    path = write(tmp_path, spec_encode(csv_bytes(), "zstd", "aes-256-cbc", KEY_A))
    err = decode_error(path, "zstd", "aes-256-cbc", [KEY_A[:16]])
    assert "16 bytes" in str(err)


# -- damaged files ---------------------------------------------------------------------------------


def test_truncated_shorter_than_iv_plus_block(tmp_path):
    data = spec_encode(csv_bytes(), "zstd", "aes-256-cbc", KEY_A)
    for size in (0, 10, 16, 31):
        path = write(tmp_path, data[:size])
        err = decode_error(path, "zstd", "aes-256-cbc", [KEY_A])
        assert str(err).startswith("truncated:")


def test_truncated_not_a_multiple_of_16(tmp_path):
    data = spec_encode(csv_bytes(), "zstd", "aes-256-cbc", KEY_A)
    path = write(tmp_path, data[:-3])
    err = decode_error(path, "zstd", "aes-256-cbc", [KEY_A])
    assert str(err) == f"truncated: ciphertext length {len(data) - 3 - 16} is not a multiple of 16"


@pytest.mark.parametrize(
    ("compression", "kind"), [("zstd", None), ("none", "csv"), ("none", "parquet")]
)
def test_bad_padding_flip_last_byte(tmp_path, compression, kind):
    plain = parquet_bytes() if kind == "parquet" else csv_bytes()
    data = bytearray(spec_encode(plain, compression, "aes-256-cbc", KEY_A))
    data[-1] ^= 0x01
    path = write(tmp_path, bytes(data))
    looks_like = FORMATS[kind].looks_like if kind else None
    err = decode_error(path, compression, "aes-256-cbc", [KEY_A], looks_like=looks_like)
    assert str(err).startswith("bad padding:")


def test_bad_padding_uncompressed_unknown_format_reads_as_no_key_fits(tmp_path):
    data = bytearray(spec_encrypt(os.urandom(100), KEY_A))  # nothing recognisable in the plaintext
    data[-1] ^= 0x01
    path = write(tmp_path, bytes(data))
    err = decode_error(path, "none", "aes-256-cbc", [KEY_A])
    assert "could not decrypt with any of the 1 key(s)" in str(err)
    assert "bad padding" in str(err)


def test_truncated_at_block_boundary_is_bad_padding(tmp_path):
    data = spec_encode(csv_bytes(200), "zstd", "aes-256-cbc", KEY_A)
    path = write(tmp_path, data[:-16])
    err = decode_error(path, "zstd", "aes-256-cbc", [KEY_A])
    assert str(err).startswith("bad padding:")


@pytest.mark.parametrize("encryption", ["none", "aes-256-cbc"])
def test_corrupt_zstd_frame(tmp_path, encryption):
    compressed = bytearray(zstandard.ZstdCompressor().compress(csv_bytes(200)))
    compressed[4] = 0xFF  # frame header descriptor with the reserved bit set
    data = spec_encrypt(bytes(compressed), KEY_A) if encryption != "none" else bytes(compressed)
    path = write(tmp_path, data)
    err = decode_error(path, "zstd", encryption, [KEY_A])
    assert str(err).startswith("corrupt ZSTD data: ")


def test_corrupt_zstd_payload_with_checksum(tmp_path):
    compressed = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(csv_bytes(2000)))
    compressed[len(compressed) // 2] ^= 0x55
    path = write(tmp_path, spec_encrypt(bytes(compressed), KEY_A))
    err = decode_error(path, "zstd", "aes-256-cbc", [KEY_A])
    assert str(err).startswith("corrupt ZSTD data: ")


def test_plain_file_that_is_not_zstd(tmp_path):
    path = write(tmp_path, csv_bytes())
    err = decode_error(path, "zstd", "none", [])
    assert str(err).startswith("corrupt ZSTD data: ")


@pytest.mark.parametrize("encryption", ["none", "aes-256-cbc"])
def test_truncated_zstd_stream(tmp_path, encryption):
    compressed = zstandard.ZstdCompressor().compress(csv_bytes(2000))[:-7]
    data = spec_encrypt(compressed, KEY_A) if encryption != "none" else compressed
    path = write(tmp_path, data)
    err = decode_error(path, "zstd", encryption, [KEY_A])
    assert str(err).startswith("truncated ZSTD stream:")
    with (
        open_decoded_stream(path, "zstd", encryption, [KEY_A]) as stream,
        pytest.raises(LandingFileError, match="truncated ZSTD stream"),
    ):
        stream.read()


def test_empty_zstd_input(tmp_path):
    path = write(tmp_path, b"")
    err = decode_error(path, "zstd", "none", [])
    assert str(err).startswith("truncated ZSTD stream:")


def test_unknown_modes_are_rejected(tmp_path):
    path = write(tmp_path, b"x")
    with pytest.raises(ValueError, match="unknown compression"):
        decode_file(path, "gzip", "none", [])
    with pytest.raises(ValueError, match="unknown encryption"):
        decode_file(path, "none", "rot13", [])


def test_landing_file_error_pickles_with_its_row():
    err = LandingFileError("row 3: bad", row=3, source="f.csv")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.reason, back.row, back.source) == (
        "row 3: bad",
        "row 3: bad",
        3,
        "f.csv",
    )
