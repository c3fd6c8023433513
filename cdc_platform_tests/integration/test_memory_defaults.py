"""A bulk hour works on the shipped defaults: the local driver's memory is
sized from the machine unless the deployment says, and no join side that grows with keys is
broadcast on Spark's estimate (``lib.history.joins``), with the merge's results unchanged either way."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from cdc_platform.lib.history import joins
from cdc_platform.lib.spark.session import (
    DRIVER_MEMORY_MAX_MB,
    DRIVER_MEMORY_MIN_MB,
    DRIVER_MEMORY_SHARE,
    _machine_memory_bytes,
    default_driver_memory,
    spark_conf,
)
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.integration.test_merge_adversarial import H0, HOUR, MS, _Lake

# -- the driver's memory ---------------------------------------------------------------------


def _mb(value: str | None) -> int:
    assert value is not None and value.endswith("m"), value
    return int(value[:-1])


def test_default_driver_memory_is_a_share_of_the_machine_within_bounds():
    total = _machine_memory_bytes()
    assert total is not None and total > 0
    mb = _mb(default_driver_memory({}))
    assert DRIVER_MEMORY_MIN_MB <= mb <= DRIVER_MEMORY_MAX_MB
    share = total // DRIVER_MEMORY_SHARE // 2**20
    assert mb == max(DRIVER_MEMORY_MIN_MB, min(DRIVER_MEMORY_MAX_MB, share))


def test_a_local_session_gets_it_and_a_cluster_does_not(monkeypatch):
    for name in ("SPARK_DRIVER_MEMORY", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert spark_conf("local[2]")["spark.driver.memory"] == default_driver_memory({})
    assert "spark.driver.memory" not in spark_conf("spark://cluster:7077")
    # A run's spark_config (RUN_TUNABLE) still tunes it.
    assert spark_conf("local[2]", {"spark.driver.memory": "3g"})["spark.driver.memory"] == "3g"


@pytest.mark.parametrize("line", ["spark.driver.memory 12g", "spark.driver.memory=12g"])
def test_the_deployments_spark_defaults_win(tmp_path: Path, monkeypatch, line: str):
    (tmp_path / "spark-defaults.conf").write_text(f"# the deployment's\n{line}\n")
    monkeypatch.delenv("SPARK_DRIVER_MEMORY", raising=False)
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert default_driver_memory() is None
    # Not on the command line, where it would override the file.
    assert "spark.driver.memory" not in spark_conf("local[2]")
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv("SPARK_HOME", str(tmp_path.parent))
    (tmp_path.parent / "conf").mkdir(exist_ok=True)
    (tmp_path.parent / "conf" / "spark-defaults.conf").write_text(line + "\n")
    assert default_driver_memory() is None


def test_other_settings_in_spark_defaults_do_not_count(tmp_path: Path):
    (tmp_path / "spark-defaults.conf").write_text("spark.driver.memoryOverhead 1g\n")
    assert default_driver_memory({"SPARK_CONF_DIR": str(tmp_path)}) is not None


@pytest.mark.parametrize(
    "env",
    [
        {"SPARK_DRIVER_MEMORY": "6g"},
        {"PYSPARK_SUBMIT_ARGS": "--driver-memory 6g pyspark-shell"},
        {"PYSPARK_SUBMIT_ARGS": "--conf spark.driver.memory=6g pyspark-shell"},
    ],
)
def test_the_environment_wins(env: dict[str, str]):
    assert default_driver_memory(env) is None


# -- joins of key-sized sides ------------------------------------------------------------------


def _plan(df: Any) -> str:
    return df._jdf.queryExecution().executedPlan().toString()


def test_a_side_known_large_is_never_broadcast_whatever_spark_estimates(spark):
    """A side Spark estimates tiny (a 10-row range) is still joined by sort-merge when its
    bound says large; with a small bound it is broadcast (no shuffle of the big side)."""
    big = spark.range(50_000).withColumnRenamed("id", "k")
    keys = spark.range(10).withColumnRenamed("id", "k")
    assert "BroadcastExchange" in _plan(big.join(keys, "k", "left_semi"))  # Spark's own choice
    large = big.join(joins.build_side(keys, joins.BROADCAST_ROWS + 1), "k", "left_semi")
    assert "BroadcastExchange" not in _plan(large)
    assert "SortMergeJoin" in _plan(large)
    unknown = big.join(joins.build_side(keys, None), "k", "left_semi")
    assert "BroadcastExchange" not in _plan(unknown)
    small = big.join(joins.build_side(keys, 10), "k", "left_semi")
    assert "BroadcastExchange" in _plan(small)
    assert large.count() == small.count() == unknown.count() == 10


def test_a_held_key_set_filters_exactly_whatever_the_values_and_the_key_name(spark, tmp_path):
    """``in_keys`` is SQL text: quotes, backticks, backslashes, NULs, newlines and an injection
    attempt in the values, and a backtick and a dot in the key's name, select exactly those
    keys (never a null key, never another one); integers at the ends of their range too. The
    filter still reaches Parquet as an ``In`` (row groups pruned by statistics)."""
    from pyspark.sql import functions as F

    weird = ["a'b", "c`d", "x\\y", "", "e\u0000z", "\U0001f642", "' OR 1=1 --", "a\nb", "'"]
    name = "k.e`y"
    df = spark.createDataFrame([(w,) for w in [*weird, "other", None]], "`k.e``y` string")
    kept = [r[0] for r in df.filter(joins.in_keys([name], weird)).collect()]
    assert sorted(kept) == sorted(weird)
    outside = ~F.coalesce(joins.in_keys([name], weird), F.lit(False))
    assert sorted(df.filter(outside).collect(), key=str) == sorted(
        df.filter(~F.col("`k.e``y`").isin(weird) | F.col("`k.e``y`").isNull()).collect(), key=str
    )
    ends = [-(2**63), 0, 2**63 - 1]
    longs = spark.createDataFrame([(v,) for v in [*ends, -1, 7]], "k long")
    assert sorted(r[0] for r in longs.filter(joins.in_keys(["k"], ends)).collect()) == ends
    assert longs.filter(joins.in_keys(["k"], [])).count() == 0
    path = str(tmp_path / "keys.parquet")
    spark.range(100).selectExpr("id AS k", "CAST(id AS STRING) AS s").write.parquet(path)
    held = spark.read.parquet(path).filter(joins.in_keys(["k"], list(range(0, 40, 2))))
    assert "PushedFilters: [In(k" in _plan(held)
    assert held.count() == 20
    held = spark.read.parquet(path).filter(joins.in_keys(["s"], ["0", "7", "it's"]))
    assert "PushedFilters: [In(s" in _plan(held)
    assert held.count() == 2


def test_row_bounds():
    class F:
        def __init__(self, n: int | None) -> None:
            self.num_records = n

    assert joins.records([F(2), F(3)]) == 5
    assert joins.records([]) == 0
    assert joins.records([F(2), F(None)]) is None
    assert joins.add(1, 2, 3) == 6
    assert joins.add(1, None) is None
    assert joins.smallest(None, 4, 2) == 2
    assert joins.smallest(None, None) is None


@pytest.fixture()
def no_broadcast(monkeypatch):
    """Every key-sized side counts as large: the merge runs on the path a bulk hour takes."""
    monkeypatch.setattr(joins, "BROADCAST_ROWS", -1)


def test_merge_with_every_side_large_matches_the_reference(spark, lake, no_broadcast):
    """The sort-merge path (a bulk hour's) gives the reference's history: a first load, an
    in-order hour (fast path), a late hour (slow path, closed rows), delete-only keys."""
    t = _Lake(spark, lake["landing"], lake["warehouse"])
    a = H0 + timedelta(minutes=5)
    first = [ev("INSERT", k, a + k * MS, k, status="new") for k in range(1, 9)]
    first += [ev("DELETE", 20, a, 20), ev("DELETE", 21, a + MS, 21)]
    first += [ev("UPDATE", 100 + k, a + 40 * MS + k * MS, k, status="paid") for k in (1, 2, 3)]
    t.run(H0, first)
    t.check(["status"])
    b = H0 + HOUR + timedelta(minutes=1)
    t.run(
        H0 + HOUR,
        [
            ev("UPDATE", 200, b, 4, status="shipped"),
            ev("DELETE", 201, b + MS, 5),
            ev("INSERT", 202, b + 2 * MS, 9, status="new"),
            ev("UPDATE", 203, b + 3 * MS, 6, status="new"),  # same image: no new version
        ],
    )
    t.check(["status"])
    late = H0 + timedelta(minutes=5, milliseconds=20)
    t.run(
        H0 + 2 * HOUR,
        [
            ev("UPDATE", 300, late, 1, status="late"),  # between versions: slow path
            ev("INSERT", 301, a - MS, 20, status="back"),  # a delete-only key: an older insert
            ev("DELETE", 302, H0 + 2 * HOUR, 7),
        ],
    )
    t.check(["status"])
