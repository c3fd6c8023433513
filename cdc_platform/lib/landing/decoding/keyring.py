"""The keyring: AES-256 keys for encrypted landing files, per table and per file.

The keyring file is JSON::

    {
      "tables": {"orders": "<base64 32-byte key>", "users": ["<old key>", "<new key>"]},
      "files": {"orders/year=2024/month=01/day=01/hour=05/part-1.csv.zst.aes": "<base64 key>"}
    }

An optional ``"hash_salt"`` (base64, at least 16 bytes) salts the SHA-256 of a table's
``hash_columns`` (``landing.rows.pii``). File paths are relative to the landing root. A file's own
key is tried first, then its table's keys in the listed order (key rotation). The file must not
be readable or writable by group or other (``chmod 600``).

Key bytes never appear in ``repr``/``str`` or in any error message. A Keyring is picklable so
it can travel to Spark tasks inside a task closure; never log or print its pickled form.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import posixpath
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cdc_platform.lib.errors import Refusal

KEY_BYTES = 32
MIN_SALT_BYTES = 16
_TOP_KEYS = ("tables", "files", "hash_salt")


class KeyringError(Refusal):
    """The keyring file or mapping is invalid; the message names the entry, never the key."""


def normalize_relative_path(path: str) -> str:
    """One spelling per landing-relative path: '/' separators, no './', no trailing '/'."""
    p = str(path).replace(os.sep, "/")
    p = posixpath.normpath(p)
    return p[2:] if p.startswith("./") else p


class Keyring:
    """Keys by table (a list, for rotation) and by landing file (relative path), and the salt
    of hashed columns."""

    __slots__ = ("_files", "_salt", "_tables")

    def __init__(
        self,
        tables: Mapping[str, tuple[bytes, ...]],
        files: Mapping[str, bytes],
        salt: bytes | None = None,
    ) -> None:
        self._tables: dict[str, tuple[bytes, ...]] = dict(tables)
        self._files: dict[str, bytes] = dict(files)
        self._salt = salt

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def empty(cls) -> Keyring:
        return cls({}, {})

    @classmethod
    def from_mapping(cls, raw: Any, *, source: str = "keyring") -> Keyring:
        """Build from the parsed JSON structure (strict: unknown keys and bad keys are errors)."""
        if not isinstance(raw, Mapping):
            raise KeyringError(f"{source}: expected a JSON object with 'tables' and/or 'files'")
        unknown = sorted(str(k) for k in raw if k not in _TOP_KEYS)
        if unknown:
            raise KeyringError(
                f"{source}: unknown top-level key(s) {unknown}; allowed: {list(_TOP_KEYS)}"
            )

        tables_raw = raw.get("tables") or {}
        if not isinstance(tables_raw, Mapping):
            raise KeyringError(f"{source}: 'tables' must be an object of table name to key(s)")
        tables: dict[str, tuple[bytes, ...]] = {}
        for name, value in tables_raw.items():
            label = f"tables[{str(name)!r}]"
            if isinstance(value, str):
                values = [value]
            elif isinstance(value, list) and value:
                values = value
            else:
                raise KeyringError(
                    f"{source}: {label} must be a base64 key or a non-empty list of them"
                )
            keys = []
            for i, v in enumerate(values):
                where = label if isinstance(value, str) else f"{label}[{i}]"
                keys.append(_decode_key(v, f"{source}: {where}"))
            tables[str(name)] = tuple(keys)

        files_raw = raw.get("files") or {}
        if not isinstance(files_raw, Mapping):
            raise KeyringError(f"{source}: 'files' must be an object of relative file path to key")
        files: dict[str, bytes] = {}
        for rel, value in files_raw.items():
            label = f"files[{str(rel)!r}]"
            rel_s = str(rel)
            norm = normalize_relative_path(rel_s)
            if not rel_s or posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
                raise KeyringError(f"{source}: {label} must be a path relative to the landing root")
            if norm in files:
                raise KeyringError(f"{source}: {label} names the same file as another entry")
            files[norm] = _decode_key(value, f"{source}: {label}")
        salt = raw.get("hash_salt")
        return cls(tables, files, None if salt is None else _decode_salt(salt, source))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Keyring:
        """Read a keyring JSON file; it must be private to its owner (``chmod 600``)."""
        p = Path(path)
        try:
            st = p.stat()
        except FileNotFoundError:
            raise KeyringError(f"keyring file {p} does not exist") from None
        if not stat.S_ISREG(st.st_mode):
            raise KeyringError(f"keyring {p} is not a regular file")
        if os.name == "posix" and st.st_mode & 0o077:
            raise KeyringError(
                f"keyring file {p} is accessible by group/other (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod 600 {p}` so only its owner can read it"
            )
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise KeyringError(f"keyring file {p} is not UTF-8 text") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            # the decoder's message holds only a position, never the document
            raise KeyringError(
                f"keyring file {p} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        return cls.from_mapping(raw, source=f"keyring file {p}")

    # -- lookup -------------------------------------------------------------------------------

    def keys_for(self, table: str, relative_path: str) -> list[bytes]:
        """Candidate keys for one file: its own key first, then the table's in listed order."""
        out: list[bytes] = []
        own = self._files.get(normalize_relative_path(relative_path)) if relative_path else None
        if own is not None:
            out.append(own)
        for key in self._tables.get(table, ()):
            if key not in out:
                out.append(key)
        return out

    def for_table(self, table: str) -> Keyring:
        """Only the keys that can open ``table``'s files: what a task decoding that table gets,
        so a task (or a worker that keeps its closure) never holds another table's keys."""
        prefix = normalize_relative_path(table) + "/"
        files = {p: k for p, k in self._files.items() if p.startswith(prefix)}
        tables = {t: keys for t, keys in self._tables.items() if t == table}
        return Keyring(tables, files, self._salt)

    @property
    def hash_salt(self) -> bytes | None:
        """The salt of hashed columns (None: the keyring has none)."""
        return self._salt

    @property
    def table_count(self) -> int:
        return len(self._tables)

    @property
    def file_count(self) -> int:
        return len(self._files)

    # -- safety -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        salt = ", hash_salt" if self._salt is not None else ""
        return f"Keyring(tables={len(self._tables)}, files={len(self._files)}{salt})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Keyring):
            return NotImplemented
        return (self._tables, self._files, self._salt) == (other._tables, other._files, other._salt)

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        return {"tables": self._tables, "files": self._files, "salt": self._salt}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._tables = dict(state["tables"])
        self._files = dict(state["files"])
        self._salt = state.get("salt")


def _decode_salt(value: Any, source: str) -> bytes:
    """base64 text -> the salt; the error names the entry, never the value."""
    where = f"{source}: hash_salt"
    salt = _base64(value, where, "the salt")
    if len(salt) < MIN_SALT_BYTES:
        raise KeyringError(
            f"{where}: the salt decodes to {len(salt)} bytes; at least {MIN_SALT_BYTES}"
        )
    return salt


def _decode_key(value: Any, where: str) -> bytes:
    """base64 text -> 32 key bytes; the error names the entry, never the value."""
    key = _base64(value, where, "the key")
    if len(key) != KEY_BYTES:
        raise KeyringError(
            f"{where}: the key decodes to {len(key)} bytes; AES-256 needs exactly {KEY_BYTES}"
        )
    return key


def _base64(value: Any, where: str, what: str) -> bytes:
    if not isinstance(value, str):
        raise KeyringError(f"{where}: {what} must be a base64 string")
    try:
        return base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyringError(f"{where}: {what} is not valid base64") from None
