"""A merge plan (dry run): what materializing some hours would do, committed nowhere real.

The plan runs the real pipeline, not a model of it, against a *shadow* of the table: a
temporary folder where every Delta log is a copy and every data file a symlink to the real one.
Spark reads the real files through the links and writes its new files into the shadow; the
commits go to the copied logs. So the figures (keys affected, versions opened and closed, files
removed and added with their bytes, files set aside) are exactly those the real run would
report against the same table, and the real tables, the landing zone and the real Delta logs
are never written. The shadow lives under ``<warehouse_root>/_cdc/`` (so that on a cluster
every executor sees it, like the warehouse) and is removed afterwards, whatever happens.

On top of the run's own figures the plan says which events are *late*: at or before the last
event already applied for their key, so that the key's history is recomputed from the change
log rather than extended, and how far back the oldest one reaches.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cdc_platform.lib.columns import CURRENT, LAST_EVENT_AT, TS, col, cols
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.operation import Request
from cdc_platform.lib.pipeline import MaterializationOutcome, materialize_hours
from cdc_platform.lib.storage import delta
from cdc_platform.lib.storage.stores import Location, Where
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    pass

DELTA_LOG = "_delta_log"


@dataclass(frozen=True)
class PlanRequest(Request):
    """The hours a materialization would apply."""

    hours: tuple[datetime, ...]


@dataclass(frozen=True)
class MergePlan:
    """What a materialization of ``hours`` would do now."""

    hours_planned: int
    outcome: MaterializationOutcome  # every figure the real run would report
    late_events: int  # new events at or before their key's last applied event
    late_keys: int
    oldest_late_event: datetime | None  # the earliest commit time among them
    reaches_back_seconds: float | None  # the longest gap, late event to its key's last event
    # A dry run committed nowhere, reported all the same: as an observation (no hour).
    changed: bool = True
    hours: tuple[datetime, ...] = ()

    def summary(self) -> str:
        m = self.outcome.merge
        return (
            f"plan for {self.hours_planned} hour(s): {m.keys_affected} keys, "
            f"{m.versions_opened} versions opened, {m.files_removed} files "
            f"({m.bytes_removed:,} bytes) removed, {m.files_added} added "
            f"({m.bytes_added:,} bytes), {self.late_events} late events"
        )

    def metadata(self) -> dict[str, Any]:
        o, m = self.outcome, self.outcome.merge
        reach = self.reaches_back_seconds
        return {
            "dry_run": True,
            "files_read": o.files_read,
            "events_new": o.events_new,
            "files_quarantined": len(o.quarantined),
            "quarantined": [
                {"file": q.file, "row": q.row, "reason": q.reason} for q in o.quarantined
            ],
            "keys_affected": m.keys_affected,
            "versions_opened": m.versions_opened,
            "versions_closed": m.versions_closed,
            "files_removed": m.files_removed,
            "bytes_removed": m.bytes_removed,
            "files_added": m.files_added,
            "bytes_added": m.bytes_added,
            "late_events": self.late_events,
            "late_keys": self.late_keys,
            "oldest_late_event": (
                self.oldest_late_event.isoformat() if self.oldest_late_event else None
            ),
            "late_reach_hours": round(reach / 3600, 3) if reach is not None else None,
            **m.restated_metadata(),
        }


def plan(t: HistoryTable, request: PlanRequest) -> MergePlan:
    """The merge plan for the request's hours; writes nothing outside a temporary folder.

    The warehouse must be a local or mounted folder: the shadow links to the real files.
    """
    if not Location.of(t.warehouse_root).is_local:
        raise Refusal(
            f"a merge plan needs a local or mounted warehouse (its shadow links to the real "
            f"files); {t.warehouse_root} is on an object store"
        )
    with shadow_warehouse(t.warehouse_root, t.name) as shadow_root:
        shadow = HistoryTable(t.spark, t.config, shadow_root, t.landing_root, t.keyring)
        log_before = delta.version_or_none(shadow.paths.changelog)
        outcome = materialize_hours(shadow, request.hours, request.now)
        late = _late_events(t, shadow, log_before)
    return MergePlan(len(request.hours), outcome, *late)


@contextmanager
def shadow_warehouse(warehouse_root: Where, table: str) -> Iterator[Path]:
    """A temporary warehouse holding a shadow of ``table`` (history, change log and side
    tables): Delta logs copied, data files symlinked. Removed on exit."""
    system = Location.of(warehouse_root).path / "_cdc"
    system.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=".plan-", dir=system))
    try:
        real, shadow = TablePaths.of(warehouse_root, table), TablePaths.of(root, table)
        _mirror(real.history.path, shadow.history.path)
        _mirror(real.changelog.parent.path, shadow.changelog.parent.path)  # its side tables
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _mirror(src: Path, dst: Path) -> None:
    """``dst`` reads as ``src``: folders recreated, Delta logs copied (commits go there), every
    other file a symlink (read through, never written: the merge only adds new files)."""
    if not src.exists():
        return
    for folder, _, files in os.walk(src):
        rel = Path(folder).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        in_log = DELTA_LOG in rel.parts
        for name in files:
            source = Path(folder) / name
            if in_log:
                shutil.copy2(source, dst / rel / name)
            else:
                (dst / rel / name).symlink_to(source.resolve())


def _late_events(
    real: HistoryTable, shadow: HistoryTable, log_before: int | None
) -> tuple[int, int, datetime | None, float | None]:
    """Late events among those the planned run logged: (events, keys, oldest, reach)."""
    from pyspark.sql import functions as F

    spark = real.spark
    planned, history = shadow.fresh(shadow.paths.changelog), real.history
    if not planned.exists or not history.exists:
        return 0, 0, None, None
    before = real.changelog.at(log_before).files if log_before is not None else []
    seen = {f.path for f in before}
    new_files = [f for f in planned.files if f.path not in seen]
    if not new_files:
        return 0, 0, None, None
    pk = real.key
    events = planned.read(spark, new_files).select(
        *cols(pk), F.date_trunc("millisecond", col(TS)).alias("_cdc_tmp_ms")
    )
    if not history.files or CURRENT not in history.arrow_schema.names:
        return 0, 0, None, None
    last = history.read(spark, where=col(CURRENT)).select(*cols(pk), col(LAST_EVENT_AT))
    # A key whose every event is a delete has no version; the merge keeps its last event in
    # the delete-only side table, and an event at or before it is just as late.
    side = real.table(real.paths.delete_only_keys)
    if side.files:
        last = last.unionByName(side.read(spark).select(*cols(pk), col(LAST_EVENT_AT)))
    late = events.join(last, pk).filter(col("_cdc_tmp_ms") <= col(LAST_EVENT_AT))
    gap = col(LAST_EVENT_AT).cast("double") - col("_cdc_tmp_ms").cast("double")
    row = late.agg(
        F.count(F.lit(1)).alias("n"),
        F.count_distinct(*cols(pk)).alias("keys"),
        F.min("_cdc_tmp_ms").alias("oldest"),
        F.max(gap).alias("reach"),
    ).collect()[0]
    oldest = row["oldest"]
    return (
        int(row["n"]),
        int(row["keys"]),
        oldest.replace(tzinfo=UTC) if oldest is not None else None,  # Spark's are naive UTC
        float(row["reach"]) if row["reach"] is not None else None,
    )
