"""Secrets never reach a message: a keyring read as a snapshot or a landing file, key
values in adoption errors, plaintext of encrypted files in a reason. Errors name the file, row
and column, never the value."""

from __future__ import annotations

import base64
import io
import os
import shutil
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.reading.file_reader import LandingReader
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.operations.adopt import AdoptionError
from cdc_platform.lib.operations.resync import (
    SnapshotReader,
)
from cdc_platform_tests.security.pipeline_runs import H0, reasons, run
from cdc_platform_tests.security.sites import CSV_TABLE, H5, SECRET, _adopt


def test_a_file_that_is_not_the_tables_is_named_never_quoted(site) -> None:
    """The keyring read as a CSV snapshot (or a landing file): its header is the key."""
    folder = site["allowed"] / "snap"
    folder.mkdir()
    shutil.copy(site["private"] / "keyring.json", folder / "keyring.json")
    bad_cell = folder / "cells.csv"
    bad_cell.write_text(
        "id,status,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
        f"{SECRET},x,INSERT,1,2024-01-01T00:00:00Z\n"
    )
    at = datetime(2024, 1, 2, tzinfo=UTC)
    reader = SnapshotReader(CSV_TABLE, site["landing"], None, at, 0, folder)
    for path in (folder / "keyring.json", bad_cell):
        report = reader.inspect(str(path))
        assert report.error and SECRET not in report.error, report.error
    assert "column #1" in str(reader.inspect(str(folder / "keyring.json")).error)
    assert "row 1, column 'id'" in str(reader.inspect(str(bad_cell)).error)
    landing = hour_folder(site["landing"], "orders", H5)
    landing.mkdir(parents=True)
    shutil.copy(site["private"] / "keyring.json", landing / "part-1.csv")
    error = LandingReader(CSV_TABLE, site["landing"]).inspect(str(landing / "part-1.csv")).error
    assert error and SECRET not in error and "column #1" in error


def test_adoption_errors_name_rows_never_key_values(spark, site) -> None:
    export = site["allowed"] / "export"
    export.mkdir()
    pq.write_table(pa.table({"id": [SECRET, SECRET], "v": [1, 2]}), export / "part-0.parquet")
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    with pytest.raises(AdoptionError) as err:
        _adopt(spark, site, table, export)
    assert SECRET not in str(err.value)
    assert "part-0.parquet row 1 and" in str(err.value)


KEY = bytes(range(32))


def _encrypt(plain: bytes) -> bytes:
    iv = os.urandom(16)
    padder = padding.PKCS7(128).padder()
    enc = Cipher(algorithms.AES(KEY), modes.CBC(iv)).encryptor()
    return iv + enc.update(padder.update(plain) + padder.finalize()) + enc.finalize()


@pytest.mark.parametrize("file_format", ["csv", "parquet"])
def test_encrypted_reasons_name_row_and_column_never_the_value(spark, lake, file_format):
    table = TableConfig(
        name="enc",
        primary_key=("id",),
        start=H0,
        format=file_format,
        encryption="aes-256-cbc",
        columns={"id": "long", "amount": "long"} if file_format == "csv" else {},
    )
    secret = "not-a-number-SECRETPLAINTEXT"
    if file_format == "csv":
        plain = (
            "id,amount,cdc_operation_type,cdc_change_seq,cdc_commit_timestamp\n"
            "1,5,INSERT,1,2024-01-01T00:00:00Z\n"
            f"2,{secret},INSERT,2,2024-01-01T00:00:00Z\n"
        ).encode()
    else:
        buf = io.BytesIO()
        pq.write_table(
            pa.table(
                {
                    "id": [1, 2],
                    "cdc_operation_type": ["INSERT", secret],
                    "cdc_change_seq": [1, 2],
                    "cdc_commit_timestamp": ["2024-01-01T00:00:00Z", f"{secret}Z"],
                }
            ),
            buf,
        )
        plain = buf.getvalue()
    folder = hour_folder(lake["landing"], "enc", H0)
    folder.mkdir(parents=True)
    (folder / "part-1.bin").write_bytes(_encrypt(plain))
    keyring = Keyring.from_mapping({"tables": {"enc": base64.b64encode(KEY).decode()}})

    result = run(spark, lake, [H0], table, keyring)
    (q,) = result.quarantined
    stored = reasons(lake, "enc")["part-1.bin"]
    assert stored == q.reason and q.row == 2
    column = "amount" if file_format == "csv" else "cdc_commit_timestamp"
    assert q.reason.startswith(f"row 2, column '{column}': the value ")
    assert "SECRET" not in q.reason and "SECRET" not in repr(result)
