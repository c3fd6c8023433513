"""Delta's own SCD2 as a reference (issue 21, item 6), and what a deletion-vector MERGE of a
late hour would cost (issue 21, "Not in this issue").

The same CDC landing files (the harness's generator: inserts, updates, deletes with only the
key, late events; plus a handful of planned edge cases: several events of a key in one
millisecond, an unchanged image re-sent with a new seq, a re-delivered seq, an update first,
a delete of a key never seen, a delete and re-insert of the live image in one millisecond) go
through, one hour folder at a time, in one process and one Spark session:

- the platform: ``cdc_platform.lib.pipeline.materialize`` of that hour;
- the reference: what a Databricks user would compare the platform to.

**1. Spark Declarative Pipelines' auto CDC.** ``create_auto_cdc_flow(stored_as_scd_type=2)``
is probed three ways and every refusal is printed with its error text: the Python API itself,
the Spark Connect protocol it speaks, and a real ``spark-pipelines run`` (a Spark Connect
server of its own: it runs before this process starts its session) with an SCD *type 1* flow
into a Delta target (``--no-sdp-probe`` skips that run, ~40 s). On OSS Spark 4.2.0 with
delta-spark 4.4 none of it can run, so the reference is the classic delta-spark ``MERGE INTO``
SCD2 pattern, written as a data engineer would: per landing batch, events deduplicated by
seq, ordered per key by (commit timestamp, seq), no-op updates and deletes of absent keys
skipped (null-safe), each kept upsert opening a version ``[start, end)`` that the key's next
kept event ends, and one ``MERGE`` per batch that closes each key's current row at its first
kept event and inserts the batch's versions (the "staged updates with a NULL merge key"
pattern of Delta's documentation). Columns are named like SDP's SCD2 output
(``__START_AT``, ``__END_AT``; ``__END_AT`` null while current). An event committed at or
before the last instant the reference already holds for its key (a late event, or a seq
delivered again) is dropped: a ``MERGE`` that appends intervals cannot put a version in the
past without recomputing the key, which the platform does from its change log.

Both tables are compared row by row after normalising the known differences (names, null vs
TMAX, the platform's closed intervals with end = next start - 1 ms vs half-open, the
millisecond precision); every remaining difference is attributed to a late event or to several
events in one millisecond, or counted as unexplained. Both times are printed, hour by hour.

**2. A late hour through delta-spark with deletion vectors.** The platform's history table just
before the late hour (the last landing folder: events of this hour and events committed hours
earlier) is copied twice; one copy gets ``delta.enableDeletionVectors=true``. The exact row
changes the platform's copy-on-write commit made for that hour (rows added, rows gone: a diff
of the table before and after) are applied to each copy by one delta-spark ``MERGE`` (with and
without deletion vectors), so all three commits write the same logical change and end in the
same rows (checked). Printed per commit, from the ``_delta_log`` JSON: bytes of the files
added and removed, how many Parquet bytes were newly written, the deletion-vector bytes
written (files on disk), and the seconds. The MERGE's seconds exclude computing the change
(the platform's fold and its change-log append are in its ``materialize`` seconds).

Run it alone on a shared machine (seconds are indicative; bytes are exact)::

    .venv/bin/python -m benchmarks.delta_merge_reference                  # the default size, ~3 min
    .venv/bin/python -m benchmarks.delta_merge_reference --events 200 --keys 50 --no-sdp-probe
    .venv/bin/python -m benchmarks.delta_merge_reference --events 1000000 --keys 100000 --hours 24

Needs Delta's jars (``make jars``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from benchmarks.harness.generate import EventGenerator, split_evenly, write_hour
from benchmarks.harness.measure import file_sizes, log_versions
from benchmarks.harness.report import MB
from benchmarks.harness.table import HOUR_US, START_US, TABLE, TMAX_US, TS_TYPE, hour_at
from cdc_platform.lib.columns import END, START
from cdc_platform.lib.landing.where.layout import hour_folder
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize
from cdc_platform.lib.spark.session import build_spark_session, delta_conf
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

KEY = "id"
DATA = ("status", "amount", "quantity", "updated_at", "is_priority", "note")
REF_START, REF_END = "__START_AT", "__END_AT"  # SDP's SCD2 column names
US, MS = 1_000_000, 1_000
EVENT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64()),
        pa.field("status", pa.string()),
        pa.field("amount", pa.float64()),
        pa.field("quantity", pa.int32()),
        pa.field("updated_at", TS_TYPE),
        pa.field("is_priority", pa.bool_()),
        pa.field("note", pa.string()),
        pa.field("cdc_operation_type", pa.string()),
        pa.field("cdc_change_seq", pa.int64()),
        pa.field("cdc_commit_timestamp", TS_TYPE),
    ]
)


# --------------------------------------------------------------------------- the landing files


@dataclass
class Landing:
    root: Path
    hours: int  # in-order hour folders 0..hours-1; folder ``hours`` is the late hour
    events: list[pa.Table] = field(default_factory=list)
    folders: list[int] = field(default_factory=list)  # the folder of each table of ``events``
    late_events: int = 0

    def add(self, folder: int, table: pa.Table) -> None:
        self.events.append(table)
        self.folders.append(folder)

    def late_keys(self) -> set[int]:
        """Keys with an event committed at or before an event of theirs that landed in an
        earlier folder (a late event, or a seq delivered again)."""
        seen: dict[int, int] = {}  # key -> latest commit time of the folders before
        late: set[int] = set()
        for folder in sorted(set(self.folders)):
            latest: dict[int, int] = {}
            for f, t in zip(self.folders, self.events, strict=True):
                if f != folder:
                    continue
                for key, ts in zip(
                    t.column(KEY).to_pylist(), as_micros(t, "cdc_commit_timestamp"), strict=True
                ):
                    if ts is None:
                        continue
                    if key in seen and ts <= seen[key]:
                        late.add(key)
                    latest[key] = max(ts, latest.get(key, ts))
            for key, ts in latest.items():
                seen[key] = max(ts, seen.get(key, ts))
        return late


def edge_events(keys: int, hour: int, next_seq: int) -> tuple[pa.Table, pa.Table, int]:
    """The planned edge cases (keys above the generator's range), in hour ``hour``, and the
    re-delivery of one of their events (for a later folder). Returns (events, redelivered,
    next seq)."""
    rows: list[dict[str, Any]] = []
    seq = next_seq

    def ev(case: int, op: str, at_us: int, image: int | None = None) -> dict[str, Any]:
        nonlocal seq
        t = START_US + hour * HOUR_US + (case + 1) * 60 * US + at_us
        row: dict[str, Any] = {c: None for c in EVENT_SCHEMA.names}
        if op != "DELETE" and image is not None:
            row.update(
                status=f"edge-{image}",
                amount=float(image),
                quantity=image,
                updated_at=START_US + image,
                is_priority=image % 2 == 0,
                note=f"image {image}",
            )
        row.update(id=keys + case, cdc_operation_type=op, cdc_change_seq=seq)
        row["cdc_commit_timestamp"] = t
        seq += 1
        rows.append(row)
        return row

    ev(0, "INSERT", 0, 1)  # insert then update in one millisecond
    ev(0, "UPDATE", 200, 2)
    ev(1, "INSERT", 0, 1)  # insert then delete in one millisecond, key not live before
    ev(1, "DELETE", 200)
    ev(2, "INSERT", 0, 1)  # the same image again, with a new seq
    ev(2, "UPDATE", 5 * US, 1)
    redelivered = ev(3, "INSERT", 0, 1)  # delivered again (same seq) in a later folder
    ev(4, "UPDATE", 0, 1)  # a key whose first event is an update
    ev(5, "DELETE", 0)  # a delete of a key never seen
    ev(6, "INSERT", 0, 1)  # live A; then an update to A and a delete, in one millisecond
    ev(6, "UPDATE", 5 * US, 1)
    ev(6, "DELETE", 5 * US + 200)
    ev(7, "INSERT", 0, 1)  # live A; then a delete and an insert of A, in one millisecond
    ev(7, "DELETE", 5 * US)
    ev(7, "INSERT", 5 * US + 200, 1)
    ev(8, "INSERT", 0, 1)  # live A; a delete; A again in a later millisecond
    ev(8, "DELETE", 5 * US)
    ev(8, "INSERT", 10 * US, 1)

    def table(rs: list[dict[str, Any]]) -> pa.Table:
        cols = {c: [r[c] for r in rs] for c in EVENT_SCHEMA.names}
        for c in ("updated_at", "cdc_commit_timestamp"):
            cols[c] = pa.array(cols[c], pa.int64()).cast(TS_TYPE)
        return pa.table(cols, schema=EVENT_SCHEMA)

    return table(rows), table([redelivered]), seq


def generate(root: Path, keys: int, events: int, hours: int, late: int, seed: int) -> Landing:
    """``events`` in-order events over ``hours`` folders, then the late hour (folder ``hours``):
    an hour's worth of in-order events, ``late`` of them committed in the earlier hours."""
    gen = EventGenerator(keys, seed)
    out = Landing(root, hours)
    per_hour = split_evenly(events, hours)
    redelivered: pa.Table | None = None
    for index, n in enumerate(per_hour):
        table = gen.events(n, START_US + index * HOUR_US)
        write_hour(root, index, table)
        out.add(index, table)
        extra: list[pa.Table] = []
        if index == min(1, hours - 1):
            edges, redelivered, gen.next_seq = edge_events(keys, index, gen.next_seq)
            extra.append(edges)
        elif redelivered is not None:
            extra.append(redelivered)
            redelivered = None
        if extra:
            side = pa.concat_tables(extra)
            pq.write_table(
                side, hour_folder(root, TABLE.name, hour_at(index)) / "part-edge.parquet"
            )
            out.add(index, side)
    n_late_hour = max(per_hour[-1], late + 1)
    late = min(late, n_late_hour)
    table = gen.events(
        n_late_hour,
        START_US + hours * HOUR_US,
        late=late,
        late_window_us=(START_US, START_US + hours * HOUR_US),
    )
    write_hour(root, hours, table)
    out.add(hours, table)
    out.late_events = late
    if redelivered is not None:  # one in-order hour only: deliver it again in the late hour
        pq.write_table(
            redelivered, hour_folder(root, TABLE.name, hour_at(hours)) / "part-edge.parquet"
        )
        out.add(hours, redelivered)
    return out


def hour_files(root: Path, index: int) -> list[str]:
    return sorted(str(p) for p in hour_folder(root, TABLE.name, hour_at(index)).glob("*.parquet"))


# --------------------------------------------------------------------------- the reference


@dataclass
class BatchStats:
    events: int = 0
    late_dropped: int = 0
    late_keys: set[int] = field(default_factory=set)


def reference_batch_stats(spark: SparkSession, target: str, files: Sequence[str]) -> BatchStats:
    """What the batch brings and which of its events the reference will drop as late (run
    before the timed MERGE, on the same snapshot; not part of the reference's time)."""
    from pyspark.sql import functions as F

    ev = spark.read.parquet(*files).dropDuplicates(["cdc_change_seq"])
    stats = BatchStats(events=ev.count())
    if not delta_table_exists(target):
        return stats
    seen = seen_until(spark.read.format("delta").load(target))
    late = ev.join(seen, KEY).where(F.col("cdc_commit_timestamp") <= F.col("_seen_until"))
    rows = late.select(KEY).collect()
    stats.late_dropped = len(rows)
    stats.late_keys = {int(r[0]) for r in rows}
    return stats


def seen_until(target: DataFrame) -> DataFrame:
    """Per key, the last instant the reference holds (a version's start, or the end a delete
    or a later version gave it)."""
    from pyspark.sql import functions as F

    return target.groupBy(KEY).agg(
        F.max(F.coalesce(F.col(REF_END), F.col(REF_START))).alias("_seen_until")
    )


def delta_table_exists(path: str) -> bool:
    return (Path(path) / "_delta_log").is_dir()


def create_reference_table(spark: SparkSession, target: str) -> None:
    spark.sql(
        f"""CREATE TABLE delta.`{target}` (
              id BIGINT, status STRING, amount DOUBLE, quantity INT, updated_at TIMESTAMP,
              is_priority BOOLEAN, note STRING, {REF_START} TIMESTAMP, {REF_END} TIMESTAMP)
            USING delta"""
    )


def reference_batch(spark: SparkSession, target: str, files: Sequence[str]) -> None:
    """One landing batch into the SCD2 table at ``target`` with delta-spark's ``MERGE``."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if not delta_table_exists(target):
        create_reference_table(spark, target)
    tgt = spark.read.format("delta").load(target)
    current = tgt.where(F.col(REF_END).isNull()).select(
        KEY, *(F.col(c).alias(f"_cur_{c}") for c in DATA), F.lit(True).alias("_cur_live")
    )
    ts, seq = F.col("cdc_commit_timestamp"), F.col("cdc_change_seq")
    ev = (
        spark.read.parquet(*files)
        .dropDuplicates(["cdc_change_seq"])
        .withColumn("_del", F.upper(F.col("cdc_operation_type")) == "DELETE")
        .join(seen_until(tgt), KEY, "left")
        .where(F.col("_seen_until").isNull() | (ts > F.col("_seen_until")))  # late: dropped
        .join(current, KEY, "left")
    )
    # Per key in commit order: is the key live before the event, with which image?
    w = Window.partitionBy(KEY).orderBy(ts, seq)
    first = F.row_number().over(w) == 1
    prev_live = F.when(first, F.coalesce(F.col("_cur_live"), F.lit(False))).otherwise(
        ~F.lag("_del").over(w)
    )
    same_image = F.lit(True)
    for c in DATA:
        prev = F.when(first, F.col(f"_cur_{c}")).otherwise(F.lag(c).over(w))
        same_image = same_image & F.col(c).eqNullSafe(prev)
    kept = (
        ev.withColumn("_prev_live", prev_live)
        .withColumn("_same", same_image)
        # A delete of an absent key, an upsert of the live image: nothing to record.
        .where(
            F.when(F.col("_del"), F.col("_prev_live")).otherwise(
                ~F.col("_prev_live") | ~F.col("_same")
            )
        )
        .withColumn("_next_ts", F.lead(ts).over(w))
    )
    versions = kept.where(~F.col("_del")).select(
        F.lit(None).cast("bigint").alias("_merge_key"),
        KEY,
        *DATA,
        ts.alias(REF_START),
        F.col("_next_ts").alias(REF_END),
    )
    closes = kept.groupBy(KEY).agg(F.min(ts).alias("_close_at"))
    staged = closes.select(
        F.col(KEY).alias("_merge_key"),
        KEY,
        *(F.lit(None).alias(c) for c in DATA),
        F.lit(None).cast("timestamp").alias(REF_START),
        F.col("_close_at").alias(REF_END),
    ).unionByName(versions, allowMissingColumns=True)
    staged.createOrReplaceTempView("_scd2_staged")
    cols = ", ".join((KEY, *DATA, REF_START, REF_END))
    spark.sql(
        f"""MERGE INTO delta.`{target}` t
            USING _scd2_staged s
            ON t.{KEY} = s._merge_key AND t.{REF_END} IS NULL
            WHEN MATCHED THEN UPDATE SET t.{REF_END} = s.{REF_END}
            WHEN NOT MATCHED AND s._merge_key IS NULL THEN
              INSERT ({cols}) VALUES ({", ".join(f"s.{c}" for c in cols.split(", "))})"""
    )


# --------------------------------------------------------------------------- SDP's auto CDC


def sdp_api_refusal() -> str:
    """What ``create_auto_cdc_flow(stored_as_scd_type=2)`` says (checked before any graph)."""
    try:
        from pyspark.pipelines import create_auto_cdc_flow
    except ImportError as exc:
        return f"pyspark.pipelines not importable: {exc}"
    try:
        create_auto_cdc_flow(
            target="history",
            source="events",
            keys=[KEY],
            sequence_by="cdc_change_seq",
            apply_as_deletes="cdc_operation_type = 'DELETE'",
            stored_as_scd_type=2,  # type: ignore[arg-type]  (the annotation says only 1)
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted (no error)"


def sdp_protocol_scd_types() -> list[str]:
    from pyspark.sql.connect.proto import pipelines_pb2

    return list(pipelines_pb2.PipelineCommand.DefineFlow.SCDType.keys())


SDP_FLOWS = """
from pyspark import pipelines as dp
from pyspark.sql import SparkSession


@dp.temporary_view
def events():
    return (
        SparkSession.active().readStream.format("parquet")
        .schema({schema!r}).load({source!r})
    )


dp.create_streaming_table("history_scd1", format="delta")
dp.create_auto_cdc_flow(
    target="history_scd1",
    source="events",
    keys=["id"],
    sequence_by="cdc_change_seq",
    apply_as_deletes="cdc_operation_type = 'DELETE'",
    except_column_list=["cdc_operation_type", "cdc_change_seq", "cdc_commit_timestamp"],
    stored_as_scd_type=1,
)
"""


def sdp_probe(work: Path, source: Path) -> tuple[bool, str, float]:
    """``spark-pipelines run`` of an auto CDC flow (SCD type 1, the only type the API takes)
    into a Delta target, over the landing folder ``source``. Returns (ran, what it said, s)."""
    project = work / "sdp_probe"
    shutil.rmtree(project, ignore_errors=True)
    (project / "transformations").mkdir(parents=True)
    schema = "id BIGINT, status STRING, amount DOUBLE, quantity INT, updated_at TIMESTAMP, is_priority BOOLEAN, note STRING, cdc_operation_type STRING, cdc_change_seq BIGINT, cdc_commit_timestamp TIMESTAMP"
    (project / "transformations" / "flows.py").write_text(
        SDP_FLOWS.format(schema=schema, source=str(source))
    )
    conf = delta_conf()
    (project / "spark-pipeline.yml").write_text(
        json.dumps(  # JSON is YAML
            {
                "name": "scd_reference",
                "storage": (project / "storage").as_uri(),
                "configuration": {
                    # A catalog given with --conf only does not reach the pipeline's session.
                    "spark.sql.catalog.spark_catalog": conf["spark.sql.catalog.spark_catalog"],
                    "spark.sql.session.timeZone": "UTC",
                },
                "libraries": [{"glob": {"include": "transformations/**"}}],
            }
        )
    )
    cmd = [
        str(Path(sys.executable).parent / "spark-pipelines"),
        "--driver-class-path",
        conf["spark.driver.extraClassPath"],
        "--driver-java-options",
        "-Duser.timezone=UTC",
        *("--conf", f"spark.sql.extensions={conf['spark.sql.extensions']}"),
        *("--conf", f"spark.sql.catalog.spark_catalog={conf['spark.sql.catalog.spark_catalog']}"),
        *("--conf", f"spark.sql.warehouse.dir={project / 'warehouse'}"),
        *("--conf", "spark.ui.enabled=false"),
        "run",
        "--spec",
        str(project / "spark-pipeline.yml"),
    ]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False
        )
    except subprocess.TimeoutExpired:
        return False, "spark-pipelines did not finish in 600 s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    (work / "sdp_probe.log").write_text(out)
    if proc.returncode == 0:
        return True, "the flow ran (exit 0)", seconds
    errors = [ln.strip() for ln in out.splitlines() if "AUTOCDC_" in ln or ln.startswith("Error:")]
    tail = [ln for ln in out.splitlines() if ln.strip()][-1:]
    return False, (errors or tail or ["(no output)"])[-1], seconds


# --------------------------------------------------------------------------- comparing the rows

Row = tuple[Any, ...]


def as_micros(table: pa.Table, name: str) -> list[int | None]:
    return pc.cast(table.column(name), pa.int64()).to_pylist()


def data_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    cols = [
        as_micros(table, c)
        if pa.types.is_timestamp(table.schema.field(c).type)
        else table.column(c).to_pylist()
        for c in (KEY, *DATA)
    ]
    return list(zip(*cols, strict=True))


@dataclass
class Normalised:
    rows: dict[int, list[Row]]  # key -> (data..., start_ms, end_ms or None), sorted
    superseded: int = 0  # closed rows given end + 1 ms (the next version's start)
    deleted: int = 0  # closed rows ended by a delete (end kept: the delete's millisecond)
    open: int = 0  # TMAX / null ends
    sub_ms: int = 0  # timestamps truncated to the millisecond


def normalise_platform(table: pa.Table) -> Normalised:
    """[start, end] closed, end = next start - 1 ms or the delete's ms -> [start, end) in ms."""
    out = Normalised(defaultdict(list))
    by_key: dict[int, list[tuple[int, int, tuple[Any, ...]]]] = defaultdict(list)
    for data, start, end in zip(
        data_rows(table), as_micros(table, START), as_micros(table, END), strict=True
    ):
        assert start is not None and end is not None
        by_key[data[0]].append((start, end, data))
    for key, versions in by_key.items():
        versions.sort()
        for i, (start, end, data) in enumerate(versions):
            nxt = versions[i + 1][0] if i + 1 < len(versions) else None
            if end == TMAX_US:
                out.open += 1
                end_ms = None
            elif nxt is not None and nxt == end + MS:
                out.superseded += 1
                end_ms = (end + MS) // MS
            else:
                out.deleted += 1
                end_ms = end // MS
            out.rows[key].append((*data[1:], start // MS, end_ms))
    return out


def normalise_reference(table: pa.Table) -> Normalised:
    """µs [start, end) -> ms [start, end) (truncated, as the platform truncates events)."""
    out = Normalised(defaultdict(list))
    for data, start, end in zip(
        data_rows(table), as_micros(table, REF_START), as_micros(table, REF_END), strict=True
    ):
        assert start is not None
        out.sub_ms += (start % MS != 0) + (end is not None and end % MS != 0)
        out.open += end is None
        out.rows[data[0]].append((*data[1:], start // MS, None if end is None else end // MS))
    for rows in out.rows.values():
        rows.sort(key=by_interval)
    return out


def by_interval(row: Row) -> tuple[int, bool, int]:
    return (row[-2], row[-1] is None, row[-1] or 0)


def same_ms_keys(events: Iterable[pa.Table]) -> set[int]:
    """Keys with two or more distinct seqs in one millisecond."""
    pairs: Counter[tuple[int, int]] = Counter()
    seen: set[int] = set()
    for t in events:
        for key, ts, seq in zip(
            t.column(KEY).to_pylist(),
            as_micros(t, "cdc_commit_timestamp"),
            t.column("cdc_change_seq").to_pylist(),
            strict=True,
        ):
            if seq in seen or ts is None:
                continue
            seen.add(seq)
            pairs[(key, ts // MS)] += 1
    return {k for (k, _), n in pairs.items() if n > 1}


@dataclass
class Comparison:
    platform_rows: int
    reference_rows: int
    matching: int
    keys_differing: dict[str, list[int]]  # reason -> keys
    platform_only: Counter[str]
    reference_only: Counter[str]


def compare(
    platform: Normalised, reference: Normalised, late_keys: set[int], same_ms: set[int]
) -> Comparison:
    matching = 0
    keys_differing: dict[str, list[int]] = defaultdict(list)
    p_only: Counter[str] = Counter()
    r_only: Counter[str] = Counter()
    for key in sorted(set(platform.rows) | set(reference.rows)):
        p = Counter(platform.rows.get(key, []))
        r = Counter(reference.rows.get(key, []))
        both = p & r
        matching += sum(both.values())
        if p == r:
            continue
        reason = (
            "late event"
            if key in late_keys
            else "several events in one millisecond"
            if key in same_ms
            else "UNEXPLAINED"
        )
        keys_differing[reason].append(key)
        p_only[reason] += sum((p - r).values())
        r_only[reason] += sum((r - p).values())
    return Comparison(
        platform_rows=sum(len(v) for v in platform.rows.values()),
        reference_rows=sum(len(v) for v in reference.rows.values()),
        matching=matching,
        keys_differing=dict(keys_differing),
        platform_only=p_only,
        reference_only=r_only,
    )


def fmt_row(row: Row) -> str:
    *data, start, end = row

    def ms(v: int | None) -> str:
        if v is None:
            return "open"
        return np.datetime64(v, "ms").astype(str)

    return f"[{ms(start)}, {ms(end)}) {data[0]!s:>9} {data[1]!s:>7}"


KNOWN_DIFFERENCES = """
  How the two tables differ by design (the first four are normalised before comparing):
  - names: _fivetran_start/_fivetran_end vs __START_AT/__END_AT; the platform adds
    _fivetran_active, _fivetran_synced, _cdc_current, _cdc_last_event_at, _cdc_changed_columns;
  - an open version ends at TMAX (9999-12-31T23:59:59.999) on the platform, NULL in the reference;
  - intervals: the platform's are closed, a superseded version ends 1 ms before its successor
    starts; the reference's are half-open, end = the next start;
  - precision: the platform truncates commit times to the millisecond, the reference keeps µs;
  - deletes: both end the version at the delete (no open row after it); on the platform the
    version is still valid in the delete's own millisecond (end included), in the reference it
    is not (end excluded); same numbers after truncating, 1 ms apart in meaning. An insert and
    a delete in one millisecond: the platform's [M, M] (valid for that ms, rule 5), the
    reference's [t1, t2) with t1, t2 inside M (valid for microseconds), equal once truncated;
  - several events of a key in one millisecond (counted below): the platform folds them into
    one image (rule 1), the reference opens a version per event (an insert then an update in
    one ms: an extra sub-millisecond version); a delete then an insert of the live image in one
    ms: the platform changes nothing, the reference closes the version and opens an identical one;
  - consecutive equal images (an unchanged image re-sent with a new seq, a seq delivered again):
    neither records a version (the reference compares null-safe, <=>; the textbook `<>`
    would open versions on every null cell, or miss changes to and from null);
  - late events (counted below): the platform re-folds the key and puts the version in the
    past; the reference's MERGE only appends at the end of a key's history, so it drops an
    event at or before the last instant it holds for the key (Databricks' closed-source AUTO
    CDC orders out-of-sequence records by sequence_by; OSS Spark has no SCD2 to compare).
"""


# --------------------------------------------------------------------------- Delta log bytes


@dataclass
class CommitFigures:
    versions: list[int]
    operations: list[str] = field(default_factory=list)
    added: int = 0  # bytes of the add actions (Parquet file sizes)
    removed: int = 0  # bytes of the remove actions
    files_added: int = 0
    files_removed: int = 0
    new_parquet: int = 0  # Parquet bytes written by the commit (added paths not re-added ones)
    files_new: int = 0
    gone_parquet: int = 0  # Parquet bytes no longer in the table (removed, not re-added)
    files_gone: int = 0
    dv_marked: int = 0  # files kept in place, re-added with a (new) deletion vector
    dv_marked_bytes: int = 0
    dv_bytes: int = 0  # deletion-vector bytes written (files on disk, or inline)
    operation_metrics: dict[str, str] = field(default_factory=dict)


def dv_files(table: Path) -> dict[str, int]:
    return {
        str(p.relative_to(table)): p.stat().st_size for p in table.rglob("deletion_vector_*.bin")
    }


def commit_figures(
    table: Path, versions: Iterable[int], dvs_before: dict[str, int] | None = None
) -> CommitFigures:
    out = CommitFigures(sorted(versions))
    for version in out.versions:
        adds: dict[str, dict[str, Any]] = {}
        removes: dict[str, dict[str, Any]] = {}
        with open(table / "_delta_log" / f"{version:020d}.json") as fh:
            for line in fh:
                action = json.loads(line)
                if "add" in action:
                    adds[action["add"]["path"]] = action["add"]
                elif "remove" in action:
                    removes[action["remove"]["path"]] = action["remove"]
                elif "commitInfo" in action:
                    info = action["commitInfo"]
                    out.operations.append(str(info.get("operation")))
                    out.operation_metrics.update(info.get("operationMetrics") or {})
        missing = [p for p, r in removes.items() if r.get("size") is None]
        sizes = file_sizes(table, version - 1) if missing else {}
        out.files_added += len(adds)
        out.files_removed += len(removes)
        out.added += sum(int(a["size"]) for a in adds.values())
        for path, r in removes.items():
            size = int(r["size"]) if r.get("size") is not None else int(sizes[path])
            out.removed += size
            if path in adds:
                out.dv_marked += 1
                out.dv_marked_bytes += size
            else:
                out.gone_parquet += size
                out.files_gone += 1
        for path, a in adds.items():
            if path not in removes:
                out.new_parquet += int(a["size"])
                out.files_new += 1
            dv = a.get("deletionVector")
            if dv and dv.get("storageType") == "i":
                out.dv_bytes += int(dv["sizeInBytes"])
    if dvs_before is not None:
        out.dv_bytes += sum(
            size for name, size in dv_files(table).items() if name not in dvs_before
        )
    return out


# --------------------------------------------------------------------------- the DV MERGE


def stage_late_changes(
    spark: SparkSession, before: Path, after: Path, staged: Path
) -> tuple[int, int]:
    """The rows the platform's late-hour commit added and the (key, start) of those it took
    away, as one Parquet folder with an ``_op`` column. Returns (upserts, deletes)."""
    from pyspark.sql import functions as F

    b = spark.read.format("delta").load(str(before))
    a = spark.read.format("delta").load(str(after))
    upserts = a.exceptAll(b).withColumn("_op", F.lit("U"))
    gone = b.select(KEY, START).exceptAll(a.select(KEY, START))
    deletes = gone.join(b, [KEY, START]).withColumn("_op", F.lit("D"))
    upserts.unionByName(deletes).write.mode("overwrite").parquet(str(staged))
    counts = {
        r["_op"]: r["count"]
        for r in spark.read.parquet(str(staged)).groupBy("_op").count().collect()
    }
    return int(counts.get("U", 0)), int(counts.get("D", 0))


def merge_changes(spark: SparkSession, target: Path, staged: Path, columns: Sequence[str]) -> float:
    spark.read.parquet(str(staged)).createOrReplaceTempView("_late_changes")
    assign = ", ".join(f"t.`{c}` = s.`{c}`" for c in columns)
    names = ", ".join(f"`{c}`" for c in columns)
    values = ", ".join(f"s.`{c}`" for c in columns)
    t0 = time.perf_counter()
    spark.sql(
        f"""MERGE INTO delta.`{target}` t
            USING _late_changes s
            ON t.{KEY} = s.{KEY} AND t.{START} = s.{START}
            WHEN MATCHED AND s._op = 'D' THEN DELETE
            WHEN MATCHED THEN UPDATE SET {assign}
            WHEN NOT MATCHED AND s._op = 'U' THEN INSERT ({names}) VALUES ({values})"""
    )
    return time.perf_counter() - t0


def same_rows(spark: SparkSession, left: Path, right: Path) -> bool:
    a = spark.read.format("delta").load(str(left))
    b = spark.read.format("delta").load(str(right))
    return a.exceptAll(b).isEmpty() and b.exceptAll(a).isEmpty()


def print_commit(label: str, seconds: float, f: CommitFigures) -> None:
    print(
        f"  {label:<44} {seconds:7.2f} s  log: +{f.added / MB:8.3f} MB ({f.files_added} files)"
        f"  -{f.removed / MB:8.3f} MB ({f.files_removed} files)"
    )
    print(
        f"  {'':<44} {'':9}  Parquet written {f.new_parquet / MB:8.3f} MB ({f.files_new} files),"
        f" dropped {f.gone_parquet / MB:.3f} MB ({f.files_gone}),"
        f" kept + deletion vector {f.dv_marked} files ({f.dv_marked_bytes / MB:.3f} MB),"
        f" DV bytes written {f.dv_bytes:,}"
    )


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    p.add_argument("--events", type=int, default=20_000, help="in-order events (all hours)")
    p.add_argument("--keys", type=int, default=5_000)
    p.add_argument("--hours", type=int, default=4, help="in-order hour folders before the late one")
    p.add_argument(
        "--late",
        type=float,
        default=0.1,
        help="fraction of the late hour's events committed in the earlier hours",
    )
    p.add_argument("--seed", type=int, default=21)
    p.add_argument("--work-dir", type=Path, help="default: a new temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--no-sdp-probe", action="store_true", help="skip the spark-pipelines run")
    p.add_argument("--examples", type=int, default=2, help="keys shown per kind of difference")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Sitting:
    """What every part of one run shares: its options, folders, landing files and tables."""

    args: argparse.Namespace
    work: Path
    landing_root: Path
    warehouse: Path
    landing: Landing
    paths: TablePaths
    history: Path
    before_late: Path
    reference: str


@dataclass
class HourRuns:
    """Part 1's hours: each side's seconds, what the reference dropped, the late hour's run."""

    plat_s: list[float]
    ref_s: list[float]
    late_keys: set[int]
    late_dropped: int
    late_hour: MaterializationOutcome


def probe_sdp(args: argparse.Namespace, work: Path, landing_root: Path) -> None:
    """Spark Declarative Pipelines' auto CDC, before this process starts a JVM (one Spark at
    a time): what its API and protocol offer, and whether a run of it works here."""
    print("\n== Spark Declarative Pipelines: create_auto_cdc_flow(stored_as_scd_type=2) ==")
    print(f"  Python API: {sdp_api_refusal()}")
    print(f"  Spark Connect protocol SCDType values: {sdp_protocol_scd_types()}")
    if args.no_sdp_probe:
        print("  spark-pipelines run: skipped (--no-sdp-probe)")
    else:
        ran, said, s = sdp_probe(work, hour_folder(landing_root, TABLE.name, hour_at(0)))
        verdict = "RAN" if ran else "FAILED"
        print(
            f"  spark-pipelines run, SCD type 1 into a Delta target: {verdict} ({s:.0f} s): {said}"
        )
    print(
        "  -> the reference below is delta-spark's MERGE INTO SCD2 pattern (one MERGE per landing batch)"
    )


def hour_by_hour(spark: SparkSession, s: Sitting) -> HourRuns:
    """The same hours, the platform's ``materialize()`` then the reference's MERGE, in one
    sitting; the history before the late hour is kept for part 2."""
    print("\n== 1. The same hours: platform materialize() vs delta-spark MERGE SCD2 ==")
    print(
        f"  {'hour folder':<14} {'events':>7} {'platform s':>10} {'reference s':>11}  late dropped by reference"
    )
    plat_s: list[float] = []
    ref_s: list[float] = []
    late_keys: set[int] = set()
    late_dropped = 0
    late_hour = None
    for index in range(s.args.hours + 1):
        files = hour_files(s.landing_root, index)
        if index == s.args.hours:
            shutil.rmtree(s.before_late, ignore_errors=True)
            shutil.copytree(s.history, s.before_late)
        t0 = time.perf_counter()
        outcome = materialize(spark, TABLE, s.landing_root, s.warehouse, [hour_at(index)])
        plat_s.append(time.perf_counter() - t0)
        stats = reference_batch_stats(spark, s.reference, files)
        t0 = time.perf_counter()
        reference_batch(spark, s.reference, files)
        ref_s.append(time.perf_counter() - t0)
        late_keys |= stats.late_keys
        late_dropped += stats.late_dropped
        label = f"{index}{' (late)' if index == s.args.hours else ''}"
        print(
            f"  {label:<14} {stats.events:>7,} {plat_s[-1]:>10.2f} {ref_s[-1]:>11.2f}  {stats.late_dropped:,}"
        )
        if index == s.args.hours:
            late_hour = outcome
    assert late_hour is not None
    print(
        f"  {'all hours':<14} {'':>7} {sum(plat_s):>10.2f} {sum(ref_s):>11.2f}"
        f"   (without the first hour, which warms the session up: {sum(plat_s[1:]):.2f} vs {sum(ref_s[1:]):.2f})"
    )
    return HourRuns(plat_s, ref_s, late_keys, late_dropped, late_hour)


def row_by_row(spark: SparkSession, s: Sitting, runs: HourRuns) -> int:
    """Both tables row by row, once normalised (the known differences printed first);
    returns the platform's row count."""
    print(KNOWN_DIFFERENCES)
    plat_table = delta.read_arrow(s.paths.history)
    ref_table = spark.read.format("delta").load(s.reference).toArrow()
    p_norm = normalise_platform(plat_table)
    r_norm = normalise_reference(ref_table)
    same_ms = same_ms_keys(s.landing.events)
    late_in_data = s.landing.late_keys()
    cmp = compare(p_norm, r_norm, runs.late_keys | late_in_data, same_ms)
    print(
        f"\n  platform history: {plat_table.num_rows:,} rows; reference: {ref_table.num_rows:,} rows"
    )
    print(
        "  normalised: names (_fivetran_start/_fivetran_end -> __START_AT/__END_AT; _fivetran_active,"
        " _fivetran_synced and the _cdc_* columns dropped), TMAX -> null,"
        f" {p_norm.superseded:,} platform ends next start - 1 ms -> next start,"
        f" {p_norm.deleted:,} ended by a delete kept at the delete's ms,"
        f" {r_norm.sub_ms:,} reference µs timestamps truncated to the ms"
    )
    print(
        f"  rows matching after normalising: {cmp.matching:,} of {cmp.platform_rows:,} (platform)"
        f" / {cmp.reference_rows:,} (reference)"
    )
    reasons = sorted(set(cmp.platform_only) | set(cmp.reference_only) | set(cmp.keys_differing))
    for reason in reasons:
        keys = cmp.keys_differing.get(reason, [])
        print(
            f"  differing, {reason}: {len(keys):,} keys, {cmp.platform_only[reason]:,} platform-only"
            f" rows, {cmp.reference_only[reason]:,} reference-only rows"
        )
        for key in keys[: s.args.examples]:
            print(f"    key {key}:")
            for row in p_norm.rows.get(key, []):
                print(f"      platform  {fmt_row(row)}")
            for row in r_norm.rows.get(key, []):
                print(f"      reference {fmt_row(row)}")
    if not reasons:
        print("  no differing rows")
    print(
        f"  the reference dropped {runs.late_dropped:,} late or re-delivered events"
        f" ({len(runs.late_keys):,} keys); keys with a late event in the landing files:"
        f" {len(late_in_data):,} (a late event of a key whose only earlier event was a delete is"
        " not dropped: the reference keeps no row for it, and makes the late image current);"
        f" keys with several events in one millisecond: {len(same_ms):,}"
    )
    return plat_table.num_rows


def late_hour_merges(spark: SparkSession, s: Sitting, runs: HourRuns, platform_rows: int) -> None:
    """The late hour: the platform's copy-on-write commit against delta-spark's MERGE of the
    same row changes, with and without deletion vectors."""
    print(
        "\n== 2. The late hour: platform copy-on-write vs delta-spark MERGE (same row changes) =="
    )
    before_v = runs.late_hour.history_version_before
    after_v = runs.late_hour.merge.history_version
    plat_versions = [v for v in sorted(log_versions(s.history)) if before_v is None or v > before_v]
    plat = commit_figures(s.history, plat_versions)
    cl = Path(s.paths.changelog.uri)
    cl_fig = commit_figures(cl, [runs.late_hour.merge.changelog_version or max(log_versions(cl))])
    staged = s.work / "late_changes"
    upserts, deletes = stage_late_changes(spark, s.before_late, s.history, staged)
    columns = [f.name for f in spark.read.format("delta").load(str(s.history)).schema.fields]
    print(
        f"  the platform's commit(s) {plat_versions} (history v{before_v} -> v{after_v}):"
        f" {upserts:,} rows written, {deletes:,} rows gone, {platform_rows:,} rows in all,"
        f" {len(delta.snapshot_files(delta.open_table(s.paths.history))):,} files"
    )
    print_commit("platform materialize() (whole run)", runs.plat_s[-1], plat)
    print(
        f"  {'':<44} {'':9}  + its change-log commit: +{cl_fig.added / MB:.3f} MB"
        f" ({cl_fig.files_added} files), -{cl_fig.removed / MB:.3f} MB"
    )
    print(
        "  (the MERGE seconds below apply the platform's row changes only: reading the late files,"
        " the change-log append and the fold are in materialize()'s seconds, not in theirs)"
    )
    for dvs in (True, False):
        copy = s.work / ("late_dv" if dvs else "late_cow")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(s.before_late, copy)
        if dvs:
            spark.sql(
                f"ALTER TABLE delta.`{copy}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
            )
        first = max(log_versions(copy)) + 1
        dv_before = dv_files(copy)
        seconds = merge_changes(spark, copy, staged, columns)
        fig = commit_figures(copy, sorted(v for v in log_versions(copy) if v >= first), dv_before)
        label = "delta-spark MERGE, deletion vectors" if dvs else "delta-spark MERGE, copy-on-write"
        print_commit(label, seconds, fig)
        m = fig.operation_metrics
        print(
            f"  {'':<44} {'':9}  operationMetrics: "
            + ", ".join(
                f"{k}={m[k]}"
                for k in (
                    "numTargetFilesAdded",
                    "numTargetFilesRemoved",
                    "numTargetDeletionVectorsAdded",
                    "numTargetRowsCopied",
                    "numTargetBytesAdded",
                    "numTargetBytesRemoved",
                    "executionTimeMs",
                )
                if k in m
            )
        )
        print(
            f"  {'':<44} {'':9}  same rows as the platform's table: {same_rows(spark, copy, s.history)}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.hours < 1 or args.events < args.hours:
        raise SystemExit("--hours must be >= 1 and --events >= --hours")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cdc_delta_ref_"))
    work.mkdir(parents=True, exist_ok=True)
    landing_root, warehouse = work / "landing", work / "warehouse"
    shutil.rmtree(landing_root, ignore_errors=True)
    shutil.rmtree(warehouse, ignore_errors=True)
    per_hour = args.events // args.hours
    late = max(1, round(per_hour * args.late))
    landing = generate(landing_root, args.keys, args.events, args.hours, late, args.seed)
    n_events = sum(t.num_rows for t in landing.events)
    print(
        f"{n_events:,} CDC events over {args.keys:,} keys (+9 edge-case keys): {args.hours} hour"
        f" folders in order, then a late hour ({late:,} of its events committed in the earlier"
        f" hours); local[2], {os.cpu_count()} cores, shared: seconds are indicative, bytes exact."
        f" Work folder {work}"
    )

    probe_sdp(args, work, landing_root)

    spark = build_spark_session(
        "local[2]", {**delta_conf(), "spark.driver.memory": "2g"}, "delta_reference"
    )
    spark.sparkContext.setLogLevel("ERROR")
    reference = str(work / "reference_scd2")
    shutil.rmtree(reference, ignore_errors=True)
    paths = TablePaths.of(warehouse, TABLE.name)
    history = Path(paths.history.uri)
    before_late = work / "history_before_late"
    s = Sitting(
        args, work, landing_root, warehouse, landing, paths, history, before_late, reference
    )
    runs = hour_by_hour(spark, s)
    platform_rows = row_by_row(spark, s, runs)
    late_hour_merges(spark, s, runs, platform_rows)
    spark.stop()
    if not args.keep and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
