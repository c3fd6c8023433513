"""Bytes that are no text: a file whose text is not UTF-8 is set aside naming the row
and column, and its file statistics give no bounds."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_platform.lib.landing.where.layout import (
    hour_folder,
)
from cdc_platform.lib.pipeline import materialize
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events
from cdc_platform_tests.security.hostile_files import H5, TABLE, TS, logged_keys, reasons


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
