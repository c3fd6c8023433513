"""The keyring: strict parsing, lookup order, and never showing a key."""

from __future__ import annotations

import base64
import json
import os
import pickle
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cdc_platform.lib.landing.decoding.keyring import Keyring, KeyringError

K1 = bytes(range(32))
K2 = bytes(range(50, 82))
K3 = bytes(range(200, 232))
K1_B64, K2_B64, K3_B64 = (base64.b64encode(k).decode() for k in (K1, K2, K3))
REL = "orders/year=2024/month=01/day=01/hour=05/part-1.csv.zst.aes"
SECRETS = (K1, K2, K3)


def assert_secret_free(text: str) -> None:
    for key in SECRETS:
        assert base64.b64encode(key).decode() not in text
        assert key.hex() not in text
        assert repr(key) not in text


def write_ring(tmp_path, content, mode=0o600):
    p = tmp_path / "keyring.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    os.chmod(p, mode)
    return p


GOOD = {"tables": {"orders": K1_B64, "users": [K2_B64, K3_B64]}, "files": {REL: K3_B64}}


def test_from_file_private_file_ok(tmp_path):
    ring = Keyring.from_file(write_ring(tmp_path, GOOD, 0o600))
    assert ring.keys_for("users", "users/x.csv") == [K2, K3]
    assert ring.keys_for("orders", REL) == [K3, K1]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660])
def test_from_file_rejects_group_or_other_access(tmp_path, mode):
    p = write_ring(tmp_path, GOOD, mode)
    with pytest.raises(KeyringError) as info:
        Keyring.from_file(p)
    assert "chmod 600" in str(info.value)
    assert_secret_free(str(info.value))


def test_from_file_missing(tmp_path):
    with pytest.raises(KeyringError, match="does not exist"):
        Keyring.from_file(tmp_path / "nope.json")


def test_malformed_json(tmp_path):
    p = write_ring(tmp_path, '{"tables": {"orders": "' + K1_B64 + '",}')
    with pytest.raises(KeyringError, match="not valid JSON") as info:
        Keyring.from_file(p)
    assert_secret_free(str(info.value))


def test_unknown_top_level_key(tmp_path):
    p = write_ring(tmp_path, {"tables": {}, "keys": {"x": K1_B64}})
    with pytest.raises(KeyringError, match=r"unknown top-level key\(s\) \['keys'\]") as info:
        Keyring.from_file(p)
    assert_secret_free(str(info.value))


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"tables": {"orders": base64.b64encode(K1[:16]).decode()}}, "tables['orders']"),
        ({"tables": {"orders": [K1_B64, K2_B64[:-4] + "!!!!"]}}, "tables['orders'][1]"),
        ({"tables": {"orders": K1_B64 + "AAAA"}}, "tables['orders']"),
        ({"tables": {"orders": 12}}, "tables['orders']"),
        ({"tables": {"orders": []}}, "tables['orders']"),
        ({"files": {REL: K2_B64[:-1]}}, f"files[{REL!r}]"),
        ({"files": {REL: [K2_B64]}}, f"files[{REL!r}]"),
    ],
)
def test_bad_keys_name_the_entry_never_the_value(tmp_path, raw, names):
    p = write_ring(tmp_path, raw)
    with pytest.raises(KeyringError) as info:
        Keyring.from_file(p)
    msg = str(info.value)
    assert names in msg
    assert_secret_free(msg)
    for value in json.dumps(raw).split('"'):
        if len(value) >= 16 and value not in (REL,):
            assert value not in msg
    with pytest.raises(KeyringError):
        Keyring.from_mapping(raw)


def test_file_paths_must_be_relative():
    for bad in ("/abs/path.csv", "../outside.csv"):
        with pytest.raises(KeyringError, match="relative to the landing root"):
            Keyring.from_mapping({"files": {bad: K1_B64}})


def test_not_an_object():
    with pytest.raises(KeyringError):
        Keyring.from_mapping([K1_B64])
    with pytest.raises(KeyringError):
        Keyring.from_mapping({"tables": [K1_B64]})


def test_keys_for_order_and_normalisation():
    ring = Keyring.from_mapping(GOOD)
    assert ring.keys_for("orders", REL) == [K3, K1]
    assert ring.keys_for("orders", "./" + REL) == [K3, K1]
    assert ring.keys_for("orders", "orders/other.csv") == [K1]
    assert ring.keys_for("users", "users/a.csv") == [K2, K3]
    assert ring.keys_for("nobody", "nobody/a.csv") == []
    assert ring.keys_for("nobody", REL) == [K3]
    # a file key equal to a table key is tried once
    dup = Keyring.from_mapping({"tables": {"orders": [K2_B64, K1_B64]}, "files": {REL: K1_B64}})
    assert dup.keys_for("orders", REL) == [K1, K2]


def test_a_table_reader_ships_only_that_tables_keys():
    from cdc_platform.lib.config import TableConfig
    from cdc_platform.lib.landing.reading.file_reader import LandingReader

    ring = Keyring.from_mapping(GOOD)
    orders = ring.for_table("orders")
    assert orders.keys_for("orders", REL) == [K3, K1]
    assert orders.keys_for("users", "users/a.csv") == []
    assert (orders.table_count, orders.file_count) == (1, 1)
    users = Keyring.from_mapping(GOOD).for_table("users")
    assert users.keys_for("users", REL) == [K2, K3] and users.file_count == 0
    # "order" is a prefix of "orders" as a string, never as a folder
    assert ring.for_table("order").keys_for("order", REL) == []

    table = TableConfig(name="users", primary_key=("id",), start=datetime(2024, 1, 1, tzinfo=UTC))
    shipped = pickle.dumps(LandingReader(table, Path("/landing"), ring))
    assert K2 in shipped and K3 in shipped and K1 not in shipped


def test_empty():
    ring = Keyring.empty()
    assert ring.keys_for("orders", REL) == []
    assert repr(ring) == "Keyring(tables=0, files=0)"
    assert Keyring.from_mapping({}) == ring


def test_repr_and_str_show_counts_only():
    ring = Keyring.from_mapping(GOOD)
    assert repr(ring) == "Keyring(tables=2, files=1)"
    assert str(ring) == repr(ring)
    assert f"{ring}" == repr(ring)
    assert f"{ring!r:>40}".strip() == repr(ring)
    for text in (repr(ring), str(ring), f"{ring}", repr([ring]), repr({"k": ring})):
        assert_secret_free(text)
    assert (ring.table_count, ring.file_count) == (2, 1)


def test_pickle_round_trip():
    ring = Keyring.from_mapping(GOOD)
    back = pickle.loads(pickle.dumps(ring))
    assert back == ring
    assert back.keys_for("orders", REL) == [K3, K1]
    assert repr(back) == "Keyring(tables=2, files=1)"


def test_no_attribute_dict_to_dump():
    ring = Keyring.from_mapping(GOOD)
    assert not hasattr(ring, "__dict__")
    assert_secret_free(repr(vars(type(ring))))
