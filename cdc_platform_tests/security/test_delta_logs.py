"""A hostile ``_delta_log`` under an adoption root: add paths that point outside the
source, or that Spark would expand as a glob pattern, are refused and never read; legitimate
logs (percent-encoded partition values with glob characters) still adopt."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import write_deltalake

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.operations.adopt import AdoptionError
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.security.sites import H5, SECRET, _adopt


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_delta_log_never_points_adoption_at_files_outside_the_source(
    spark, site, partitioned
) -> None:
    """Whoever can write a ``_delta_log`` under an adoption root could name another table's
    history or change-log files by absolute path or ``..``: refused before any file is read."""
    secret_file = site["private"] / "history.parquet"
    pq.write_table(pa.table({"id": [1], "v": [SECRET]}), secret_file)
    for name, path in (("abs", str(secret_file)), ("up", "../../private/history.parquet")):
        export = site["allowed"] / f"{name}-{partitioned}"
        data = pa.table({"id": [2], "v": ["x"], "p": ["a"]})
        write_deltalake(str(export), data, partition_by=["p"] if partitioned else None)
        log = export / "_delta_log" / "00000000000000000000.json"
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        for action in lines:
            if "add" in action:
                action["add"]["path"] = path
        log.write_text("".join(json.dumps(a) + "\n" for a in lines))
        table = TableConfig(name="orders", primary_key=("id",), start=H5)
        with pytest.raises(AdoptionError, match="outside the table") as err:
            _adopt(spark, site, table, export)
        assert SECRET not in str(err.value)
        assert not (site["warehouse"] / "orders").exists()


def _delta_with_add_path(export: Path, path: str, partitioned: bool) -> None:
    """A Delta table at ``export`` whose log names its one data file ``path``."""
    data = pa.table({"id": [2], "v": ["x"], "p": ["a"]})
    write_deltalake(str(export), data, partition_by=["p"] if partitioned else None)
    log = export / "_delta_log" / "00000000000000000000.json"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for action in lines:
        if "add" in action:
            action["add"]["path"] = path
    log.write_text("".join(json.dumps(a) + "\n" for a in lines))


@pytest.mark.parametrize("partitioned", [False, True])
def test_a_delta_log_add_path_with_a_glob_pattern_is_refused_never_read(
    spark, site, partitioned, monkeypatch
) -> None:
    """``a{/..}{/..}{/..}/private/history.parquet`` has no ``..`` segment, and Spark expanded
    it to ``a/../../../private/history.parquet``: outside the source. Refused, naming the
    field, before Spark is handed any path. Percent-encoded, the same text is a file name
    (decoded, checked, read literally): there is no such file, and the secret is not read."""
    from pyspark.sql.readwriter import DataFrameReader

    secret_file = site["private"] / "history.parquet"
    pq.write_table(pa.table({"id": [1], "v": [SECRET]}), secret_file)
    handed: list[str] = []
    parquet = DataFrameReader.parquet

    def spy(self: DataFrameReader, *paths: str, **options: Any) -> Any:
        handed.extend(paths)
        return parquet(self, *paths, **options)

    monkeypatch.setattr(DataFrameReader, "parquet", spy)
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    export = site["allowed"] / f"bare-{partitioned}"
    _delta_with_add_path(export, "a{/..}{/..}{/..}/private/history.parquet", partitioned)
    with pytest.raises(AdoptionError, match=r"add\.path .* has glob characters \{ \} not") as err:
        _adopt(spark, site, table, export)
    assert SECRET not in str(err.value) and handed == []

    export = site["allowed"] / f"encoded-{partitioned}"
    encoded = "a%7B%2F..%7D%7B%2F..%7D%7B%2F..%7D/private/history.parquet"
    _delta_with_add_path(export, encoded, partitioned)
    with pytest.raises(Exception, match="PATH_NOT_FOUND") as err:
        _adopt(spark, site, table, export)
    assert SECRET not in str(err.value)
    assert handed and all("private/history.parquet" in p and "\\{" in p for p in handed)
    assert not (site["warehouse"] / "orders").exists()


def test_a_delta_log_path_is_decoded_then_kept_inside_the_table() -> None:
    """What every read of a Delta table's files goes through (``delta.absolute_paths``)."""
    inside = {
        "part-0.parquet": "part-0.parquet",
        "p=x%257By%257D/part-0.parquet": "p=x%7By%7D/part-0.parquet",  # delta-rs, x{y}
        "p=x%257By%7D/part-0.parquet": "p=x%7By}/part-0.parquet",  # delta-spark, x{y}
        "p=a%2520b/part-0.parquet": "p=a%20b/part-0.parquet",
        "d%C3%A9j%C3%A0/a%20b.parquet": "déjà/a b.parquet",
    }
    for logged, relative in inside.items():
        assert delta.relative_file("/wh/t", logged) == relative
        assert delta.absolute_paths("/wh/t", [logged]) == [f"/wh/t/{relative}"]
    outside = {
        "a{/..}{/..}/x.parquet": "glob characters { }",
        "x*.parquet": "glob characters *",
        "a\\..\\x.parquet": "glob characters \\",
        "/wh/other/x.parquet": "an absolute path",
        "%2Fwh%2Fother/x.parquet": "an absolute path",
        "file:/wh/other/x.parquet": "a URI",
        "s3a://bucket/x.parquet": "a URI",
        "../other/x.parquet": "a '.' or '..' segment",
        "a/%2E%2E/%2e%2e/other/x.parquet": "a '.' or '..' segment",
        "a%5C..%5C..%5Cx.parquet": "a '.' or '..' segment",
        "": "empty",
    }
    for logged, why in outside.items():
        with pytest.raises(delta.UnsafeFilePathError, match=f"add.path .*{re.escape(why)}"):
            delta.absolute_paths("/wh/t", [logged])


@pytest.mark.parametrize("writer", ["delta-rs", "delta-spark"])
def test_partition_values_with_glob_characters_adopt(spark, site, writer) -> None:
    """Legitimate logs are not refused: each writer percent-encodes a partition value's
    ``{``, ``[``, ``*``, ``%`` or space in the add path; the decoded name (delta-spark leaves
    ``}`` and ``]`` bare on disk) is read by its name."""
    from cdc_platform_tests.helpers import history_rows, normalize

    values = ["x{y}", "[1]", "a*b?", "c%d e", "plain"]
    export = site["allowed"] / writer
    data = pa.table({"id": list(range(len(values))), "p": values})
    if writer == "delta-rs":
        write_deltalake(str(export), data, partition_by=["p"])
    else:
        spark.createDataFrame(data.to_pandas()).write.format("delta").partitionBy("p").save(
            str(export)
        )
    table = TableConfig(name="orders", primary_key=("id",), start=H5)
    result = _adopt(spark, site, table, export)
    assert result.live_rows == len(values)
    history = TablePaths.of(site["warehouse"], "orders").history
    assert normalize(history_rows(history), ["id", "p"]) == list(enumerate(values))
