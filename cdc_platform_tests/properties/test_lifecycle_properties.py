"""Table lifecycle operations mixed into random CDC deliveries, against the reference fold.

Some hours are materialized (in random order), then a soft truncate, a re-sync or a widening
file comes, then the other hours in random order, with replays. Truncates and re-syncs act on
the table as it is when they run; what follows them must not depend on order: the final table
equals the reference fold of every event plus the events the operation is documented to log
(written out here from the README's rules, not asked of the code), without the events it
removed. A widening is order-independent altogether: its file may come at any point.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_platform.lib.config import TableConfig
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.operations.resync import ResyncRequest, resync, resync_seqs
from cdc_platform.lib.operations.truncate import TruncateRequest, truncate, truncate_seq
from cdc_platform.lib.pipeline import materialize
from cdc_platform.lib.storage.warehouse import TablePaths
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import history_rows, normalize, write_parquet_events
from cdc_platform_tests.reference import UNMODIFIED, reference_history, truncate_to_ms
from cdc_platform_tests.strategies import (
    BASE_TIME,
    assign_to_files,
    cdc_event_batches,
    hour_floor,
)

TABLE = TableConfig(name="life", primary_key=("id",), start=BASE_TIME)
COLUMNS = ["id", "name", "amount", "extra", "_fivetran_start", "_fivetran_end", "_fivetran_active"]


def live_keys(events: list[dict[str, Any]]) -> set[int]:
    return {r["id"] for r in reference_history(events, ["id"]) if r["_fivetran_active"]}


def first_starts(events: list[dict[str, Any]]) -> dict[int, datetime]:
    starts: dict[int, datetime] = {}
    for r in reference_history(events, ["id"]):
        starts[r["id"]] = min(starts.get(r["id"], r["_fivetran_start"]), r["_fivetran_start"])
    return starts


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_operations_mixed_into_random_deliveries(spark, tmp_path_factory, data):
    root: Path = tmp_path_factory.mktemp("lifecycle")
    landing, warehouse = root / "landing", root / "warehouse"
    events = data.draw(cdc_event_batches(max_keys=3, max_events=14), label="events")
    events = [{k: (None if v is UNMODIFIED else v) for k, v in e.items()} for e in events]
    op = data.draw(st.sampled_from(["truncate", "resync", "widen"]), label="operation")
    files = assign_to_files(data.draw, events, start_hour=BASE_TIME)
    if op == "widen":  # a file of its own brings `amount` as a string, in any hour
        t = BASE_TIME + timedelta(minutes=data.draw(st.integers(0, 180), label="widen at"))
        key = data.draw(st.integers(0, 2), label="widen key")
        wide = ev("UPDATE", 100_000, t, key, name="w", amount="7")
        delay = timedelta(hours=data.draw(st.integers(0, 2), label="widen delay"))
        files[(hour_floor(t) + delay, "widen.parquet")] = [wide]
        events.append(wide)
    for (hour, name), rows in files.items():
        write_parquet_events(landing, TABLE.name, hour, rows, name=name)
    hours = sorted({h for h, _ in files})
    first = (
        data.draw(st.lists(st.sampled_from(hours), unique=True), label="before") if hours else []
    )
    rest = [h for h in hours if h not in first]
    later = data.draw(st.permutations(rest), label="after") if rest else []
    replays = (
        data.draw(st.lists(st.sampled_from(hours), max_size=2), label="replays") if hours else []
    )

    for hour in first:
        materialize(spark, TABLE, landing, warehouse, [hour])
    applied = [e for (h, _), rows in files.items() if h in first for e in rows]
    logged: list[dict[str, Any]] = list(events)  # what the fold is over, once all is applied

    if op == "truncate":
        t = datetime.now(UTC) + timedelta(seconds=1)  # after every run's _fivetran_synced
        # the truncate runs at t
        truncate(HistoryTable(spark, TABLE, warehouse), TruncateRequest(t, soft=True, now=t))
        logged += [ev("DELETE", truncate_seq(t), truncate_to_ms(t), k) for k in live_keys(applied)]
    elif op == "resync":
        at = BASE_TIME + timedelta(minutes=data.draw(st.integers(0, 240), label="resync at"))
        keys = data.draw(st.sets(st.integers(0, 3)), label="snapshot keys")
        image = {k: data.draw(st.sampled_from(["ann", "zed"]), label=f"name {k}") for k in keys}
        folder = root / "snapshot"
        folder.mkdir()
        ids = sorted(keys)
        pq.write_table(
            pa.table({"id": pa.array(ids, pa.int64()), "name": pa.array([image[k] for k in ids])}),
            folder / "snapshot.parquet",
        )
        resync(HistoryTable(spark, TABLE, warehouse, landing), ResyncRequest(folder, (root,), at))
        insert_seq, delete_seq = resync_seqs(at)
        starts = first_starts(applied)
        replaced = {k for k in keys if k in starts and truncate_to_ms(at) < starts[k]}
        removed = {(e["id"], e["cdc_change_seq"]) for e in applied if e["id"] in replaced}
        logged = [e for e in logged if (e["id"], e["cdc_change_seq"]) not in removed]
        logged += [ev("INSERT", insert_seq, at, k, name=image[k]) for k in ids]
        logged += [ev("DELETE", delete_seq, at, k) for k in live_keys(applied) - keys]

    for hour in [*later, *replays]:
        materialize(spark, TABLE, landing, warehouse, [hour])

    if op == "widen":  # every amount is text now, as Arrow writes an integer
        logged = [
            {**e, "amount": str(e["amount"])} if e.get("amount") is not None else e for e in logged
        ]
    paths = TablePaths.of(warehouse, TABLE.name)
    actual = history_rows(paths.history) if paths.history.path.exists() else []
    assert normalize(actual, COLUMNS) == normalize(reference_history(logged, ["id"]), COLUMNS)
    if actual:
        outcomes = invariants.run_checks(spark, paths, TABLE.key)
        failed = [(o.name, o.sample) for o in outcomes if not o.passed]
        assert not failed, failed
