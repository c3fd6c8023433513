"""Decoding landing files shipped the way Fivetran's destination SDK ships batch files.

A file is the plaintext (Parquet or CSV), optionally ZSTD-compressed, then optionally
encrypted with AES-256-CBC and PKCS5/PKCS7 padding, with the 16-byte IV in the first 16 bytes
of the file. Decoding runs inside Spark tasks: everything here is pure, streams the file in
chunks and keeps plaintext in memory only (never on disk).

Key rotation: a file may be tried with several keys. Picking the key is cheap: for each key
only the first and last cipher blocks are decrypted, to check the PKCS7 padding and that the
plaintext starts like a ZSTD frame (or a Parquet/CSV file); the whole file is then decoded
with the first plausible key, falling back to the next one if the ZSTD stream does not decode.

Decoding is bounded: a file whose plaintext would exceed ``max_bytes`` (the table's
``max_file_bytes``) stops decoding there and is refused, so a decompression bomb (zeros
compress about 32,700:1) costs at most that much memory, never the machine. ZSTD input is fed
to the decompressor in small pieces, so no single call can produce more than about 32 MiB.

Error messages never contain key material.
"""

from __future__ import annotations

import codecs as _text_codecs
import contextlib
import io
import os
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

import zstandard
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cdc_platform.lib.errors import PlatformError

# A file to decode: its path, or a file already opened (and checked) by the caller, which then
# owns it (``decode_file`` leaves it open; ``open_decoded_stream``'s stream closes it).
Source = str | BinaryIO

__all__ = [
    "DEFAULT_MAX_BYTES",
    "LandingFileError",
    "compress_zstd",
    "decode_file",
    "encode_file_bytes",
    "encrypt_bytes",
    "looks_like_text",
    "looks_like_zstd",
    "open_decoded_stream",
]

BLOCK = 16
KEY_BYTES = 32
CHUNK = 1 << 20  # bytes of ciphertext / compressed data read at a time
# Compressed bytes per decompressor call: ZSTD's best ratio (an RLE block) is about 32,768:1,
# so one call yields at most ~32 MiB; measured no slower than whole chunks.
ZSTD_PIECE = 1 << 10
# A landing file's plaintext is refused above this (the config's ``max_file_bytes`` default).
DEFAULT_MAX_BYTES = 2 << 30
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC = b"PAR1"
COMPRESSIONS = ("none", "zstd")
ENCRYPTIONS = ("none", "aes-256-cbc")


class LandingFileError(PlatformError):
    """A landing file cannot be decoded or parsed.

    ``reason`` is a human sentence (never key material); ``row`` is the 1-based data row of
    the file when one row is at fault, else None; ``source`` optionally names the file.
    ``str()`` is the reason alone (callers already know which file they were reading).
    """

    def __init__(self, reason: str, row: int | None = None, source: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.row = row
        self.source = source

    def __str__(self) -> str:
        return self.reason

    def __reduce__(self):  # keep all attributes across pickling (Spark task -> driver)
        return (type(self), (self.reason, self.row, self.source))


# -- encoding (test fixtures and the demo) ------------------------------------------------------


def compress_zstd(data: bytes) -> bytes:
    """One ZSTD frame holding ``data`` (content size recorded in the frame header)."""
    return zstandard.ZstdCompressor().compress(data)


def encrypt_bytes(plaintext: bytes, key: bytes, iv: bytes | None = None) -> bytes:
    """AES-256-CBC with PKCS7 padding; returns IV (16 bytes) + ciphertext, as the SDK writes."""
    _check_key(key, 0)
    iv = os.urandom(BLOCK) if iv is None else bytes(iv)
    if len(iv) != BLOCK:
        raise ValueError(f"the IV must be {BLOCK} bytes, got {len(iv)}")
    padder = padding.PKCS7(BLOCK * 8).padder()
    padded = padder.update(plaintext) + padder.finalize()
    encryptor = Cipher(algorithms.AES(bytes(key)), modes.CBC(iv)).encryptor()
    return iv + encryptor.update(padded) + encryptor.finalize()


def encode_file_bytes(
    plaintext: bytes, compression: str, encryption: str, key: bytes | None
) -> bytes:
    """A landing file's bytes: compress (if asked), then encrypt (if asked)."""
    _check_modes(compression, encryption)
    data = compress_zstd(plaintext) if compression == "zstd" else bytes(plaintext)
    if encryption == "aes-256-cbc":
        if key is None:
            raise ValueError("encryption 'aes-256-cbc' needs a key")
        data = encrypt_bytes(data, key)
    return data


# -- decoding -------------------------------------------------------------------------------------


def decode_file(
    path: Source,
    compression: str,
    encryption: str,
    keys: Sequence[bytes],
    *,
    looks_like: Callable[[bytes], bool] | None = None,
    table: str | None = None,
    relative_path: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> bytes:
    """The plaintext of a landing file, in memory.

    ``keys`` are the candidate AES keys in the order to try (ignored when not encrypted).
    ``looks_like`` (the format's ``LandingFormat.looks_like``), when given, sharpens the
    wrong-key check of uncompressed encrypted files; ``table``/``relative_path`` only improve
    the message when no key is available. A plaintext over ``max_bytes`` is refused (``too_large``). Raises
    LandingFileError with a clear reason.
    """
    _check_modes(compression, encryption)
    if encryption == "none":
        with _opened(path) as fh:
            return b"".join(_bounded(_plain_file_chunks(fh, compression), max_bytes))

    candidates = _candidate_keys(path, compression, keys, looks_like, table, relative_path)
    first_error: LandingFileError | None = None
    for key in candidates:
        try:
            with _opened(path) as fh:
                return b"".join(_bounded(_plain_chunks(fh, key, compression), max_bytes))
        except LandingFileError as exc:  # the ZSTD stream did not decode with this key
            first_error = first_error or exc
    assert first_error is not None
    raise first_error


def open_decoded_stream(
    path: Source,
    compression: str,
    encryption: str,
    keys: Sequence[bytes],
    *,
    looks_like: Callable[[bytes], bool] | None = None,
    table: str | None = None,
    relative_path: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> BinaryIO:
    """A read-only binary stream of the plaintext, decoded chunk by chunk as it is read.

    The key is chosen up front from the first and last cipher blocks (padding and magic
    number); a corrupt or truncated ZSTD stream, or a plaintext over ``max_bytes``, surfaces
    as LandingFileError from ``read``. Decoding is lazy: reading a sample decodes about that
    much (plus one ``ZSTD_PIECE``'s output), whatever the file expands to.
    Unlike ``decode_file`` there is no fallback to another key once reading has started.
    Close the stream (or use it as a context manager) to close the file.
    """
    _check_modes(compression, encryption)
    if compression == "none" and encryption == "none":
        return open(path, "rb") if isinstance(path, str) else path
    try:
        if encryption == "none":
            key = None
        else:
            key = _candidate_keys(path, compression, keys, looks_like, table, relative_path)[0]
    except BaseException:
        if not isinstance(path, str):
            path.close()
        raise
    fh = open(path, "rb") if isinstance(path, str) else path  # noqa: SIM115 - the stream owns it
    try:
        if key is None:
            chunks = _zstd_chunks(_file_chunks(fh, 0))
        else:
            chunks = _plain_chunks(fh, key, compression)
    except BaseException:
        fh.close()
        raise
    return io.BufferedReader(_ChunkStream(_bounded(chunks, max_bytes), fh), buffer_size=CHUNK)


def too_large(max_bytes: int) -> str:
    """The reason a file whose plaintext exceeds ``max_bytes`` is set aside."""
    return (
        f"decodes to more than {_size(max_bytes)} (the table's max_file_bytes): a decompression"
        " bomb, or a file larger than this table allows; decoding stopped there. If the file is"
        " genuine, raise max_file_bytes and materialize its hour again"
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n:,} bytes"


def _bounded(chunks: Iterator[bytes], max_bytes: int) -> Iterator[bytes]:
    """``chunks`` as they come, refused (``too_large``) once they add up to over ``max_bytes``."""
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            raise LandingFileError(too_large(max_bytes))
        yield chunk


def _plain_file_chunks(fh: BinaryIO, compression: str) -> Iterator[bytes]:
    """An unencrypted file's plaintext, chunk by chunk."""
    chunks = _file_chunks(fh, 0)
    return _zstd_chunks(chunks) if compression == "zstd" else chunks


# -- internals ------------------------------------------------------------------------------------


def _check_modes(compression: str, encryption: str) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"unknown compression {compression!r}; expected one of {list(COMPRESSIONS)}"
        )
    if encryption not in ENCRYPTIONS:
        raise ValueError(f"unknown encryption {encryption!r}; expected one of {list(ENCRYPTIONS)}")


def _check_key(key: object, index: int) -> None:
    if not isinstance(key, bytes | bytearray | memoryview) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, bytes | bytearray | memoryview) else None
        what = f"{size} bytes" if size is not None else f"a {type(key).__name__}"
        raise LandingFileError(
            f"decryption key #{index + 1} is {what}; AES-256 needs a {KEY_BYTES}-byte key"
        )


def _decrypt_block(key: bytes, previous: bytes, block: bytes) -> bytes:
    """CBC-decrypt one 16-byte block given the block (or IV) before it."""
    dec = Cipher(algorithms.AES(key), modes.CBC(previous)).decryptor()
    return dec.update(block) + dec.finalize()


def _padding_ok(last_block: bytes) -> bool:
    n = last_block[-1]
    return 1 <= n <= BLOCK and last_block[-n:] == bytes([n]) * n


def looks_like_zstd(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts a ZSTD frame (or a skippable frame)."""
    if head[:4] == ZSTD_MAGIC:
        return True
    # a skippable frame: magic 0x184D2A5? little-endian
    return len(head) >= 4 and head[1:4] == b"\x2a\x4d\x18" and head[0] & 0xF0 == 0x50


def looks_like_text(head: bytes) -> bool:
    """Whether ``head`` is UTF-8 text (a cut multi-byte character at its end is fine)."""
    try:
        _text_codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return b"\x00" not in head


def _plausible(head: bytes, compression: str, looks_like: Callable[[bytes], bool] | None) -> bool:
    """Whether the decrypted start of a file looks like what the file should hold."""
    if compression == "zstd":
        return looks_like_zstd(head)
    if looks_like is not None:
        return looks_like(head)
    return head[:4] == PARQUET_MAGIC or looks_like_text(head)


@contextlib.contextmanager
def _opened(source: Source) -> Iterator[BinaryIO]:
    """The file from its start: opened here (and closed) from a path; an open file as is."""
    if isinstance(source, str):
        with open(source, "rb") as fh:
            yield fh
    else:
        source.seek(0)
        yield source


def _candidate_keys(
    path: Source,
    compression: str,
    keys: Sequence[bytes],
    looks_like: Callable[[bytes], bool] | None,
    table: str | None,
    relative_path: str | None,
) -> list[bytes]:
    """The keys worth a full decode, best first; raises when no key can be right."""
    keys = list(keys)
    if not keys:
        raise LandingFileError(
            "no decryption key for this file: add it to the keyring under "
            f"files/{relative_path or '<path>'} or tables/{table or '<table>'}"
        )
    for i, key in enumerate(keys):
        _check_key(key, i)
    with _opened(path) as fh:
        size = fh.seek(0, os.SEEK_END)  # a file or an object's bytes (no descriptor)
        fh.seek(0)
        if size < 2 * BLOCK:
            raise LandingFileError(
                f"truncated: the file is {size} bytes, shorter than the {BLOCK}-byte IV plus one "
                f"{BLOCK}-byte cipher block"
            )
        if (size - BLOCK) % BLOCK:
            raise LandingFileError(
                f"truncated: ciphertext length {size - BLOCK} is not a multiple of {BLOCK}"
            )
        head = fh.read(3 * BLOCK)  # IV + up to two blocks
        fh.seek(size - 2 * BLOCK)
        tail = fh.read(2 * BLOCK)  # the block before the last (or the IV) + the last block
    iv = head[:BLOCK]
    single_block = size == 2 * BLOCK
    checked_format = compression == "zstd" or looks_like is not None

    # A key needs valid padding and a plausible start, with or without a format to check it
    # by: a wrong key passes the padding check alone about 1 time in 256, and its plaintext is
    # noise (a landing file holds Parquet or CSV text, ``_plausible``).
    fitting: list[bytes] = []
    bad_padding_only = False  # some key decrypts the start correctly but not the padding
    for key in keys:
        key = bytes(key)
        last = _decrypt_block(key, tail[:BLOCK], tail[BLOCK:])
        pad_ok = _padding_ok(last)
        first = _decrypt_block(key, iv, head[BLOCK : 3 * BLOCK])
        if single_block and pad_ok:
            first = first[: BLOCK - first[-1]]
        plausible = _plausible(first, compression, looks_like)
        if pad_ok and plausible:
            fitting.append(key)
        elif plausible and checked_format:
            bad_padding_only = True
    if fitting:
        return fitting
    if bad_padding_only:
        raise LandingFileError(
            "bad padding: the key decrypts the start of the file but its last block has no "
            "valid PKCS7 padding; the file is corrupt or was cut short at a 16-byte boundary"
        )
    raise LandingFileError(
        f"could not decrypt with any of the {len(keys)} key(s) for this file: "
        "wrong key or corrupt ciphertext (bad padding)"
    )


def _file_chunks(fh: BinaryIO, start: int) -> Iterator[bytes]:
    fh.seek(start)
    while True:
        chunk = fh.read(CHUNK)
        if not chunk:
            return
        yield chunk


def _decrypt_chunks(chunks: Iterator[bytes], key: bytes, iv: bytes) -> Iterator[bytes]:
    decryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).decryptor()
    unpadder = padding.PKCS7(BLOCK * 8).unpadder()
    for chunk in chunks:
        out = unpadder.update(decryptor.update(chunk))
        if out:
            yield out
    try:
        out = unpadder.update(decryptor.finalize()) + unpadder.finalize()
    except ValueError:
        raise LandingFileError(
            "bad padding: the last block has no valid PKCS7 padding after decryption; "
            "the file is corrupt, truncated, or the key is wrong"
        ) from None
    if out:
        yield out


def _zstd_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Decompress a stream of one or more ZSTD frames (content size in the header or not),
    ``ZSTD_PIECE`` compressed bytes per call so that no call's output is unbounded."""
    dctx = zstandard.ZstdDecompressor()
    frame = None  # the decompressor of the frame in progress
    frames = 0
    for chunk in chunks:
        view = memoryview(chunk)
        for start in range(0, len(view), ZSTD_PIECE):
            data = view[start : start + ZSTD_PIECE]
            while data:
                if frame is None:
                    frame = dctx.decompressobj()
                try:
                    out = frame.decompress(data)
                except zstandard.ZstdError as exc:
                    raise LandingFileError(f"corrupt ZSTD data: {exc}") from None
                if out:
                    yield out
                if frame.eof:
                    data = frame.unused_data
                    frame = None
                    frames += 1
                else:
                    data = b""
    if frame is not None:
        raise LandingFileError(
            "truncated ZSTD stream: the data ends inside a frame (the file was cut short)"
        )
    if frames == 0:
        raise LandingFileError("truncated ZSTD stream: no ZSTD frame at all (empty data)")


def _plain_chunks(fh: BinaryIO, key: bytes, compression: str) -> Iterator[bytes]:
    fh.seek(0)
    iv = fh.read(BLOCK)
    chunks = _decrypt_chunks(_file_chunks(fh, BLOCK), key, iv)
    return _zstd_chunks(chunks) if compression == "zstd" else chunks


class _ChunkStream(io.RawIOBase):
    """A raw read-only stream over an iterator of byte chunks (owns the file handle)."""

    def __init__(self, chunks: Iterator[bytes], fh: BinaryIO) -> None:
        super().__init__()
        self._chunks = chunks
        self._fh = fh
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()
            self._fh.close()
        super().close()
