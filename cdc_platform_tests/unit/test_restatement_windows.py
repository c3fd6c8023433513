"""Which downstream partitions a restated span reaches, metadata that is not a span, and
queued requests the code location can no longer take."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest

from cdc_platform.defs.sensors.restatements import (
    MAX_PARTITIONS_PER_TICK,
    _Cursor,
    _due,
    _overlaps,
    _partition_window,
    _window,
)

NOW = datetime(2026, 12, 4, 12, tzinfo=UTC)
DAILY = dg.DailyPartitionsDefinition(start_date="2026-11-28")
BUILT = {"2026-11-29", "2026-11-30", "2026-12-01", "2026-12-02", "2026-12-03", "2025-13-99"}


def window(start: object, end: object) -> dg.TimeWindow | None:
    meta = {"restated_from": dg.MetadataValue.text(str(start)) if start else None}
    meta["restated_to"] = dg.MetadataValue.text(str(end)) if end else None
    return _window({k: v for k, v in meta.items() if v is not None}, NOW)


def reached(span: dg.TimeWindow, built: set[str] = BUILT) -> list[str]:
    windows = {p: _partition_window(DAILY, p) for p in built}
    return sorted(p for p, w in windows.items() if w is not None and _overlaps(w, span))


def test_a_span_reaches_every_day_it_overlaps_its_last_instant_included() -> None:
    start = datetime(2026, 12, 1, 10, tzinfo=UTC)
    end = datetime(2026, 12, 3, tzinfo=UTC) - timedelta(milliseconds=1)
    w = window(start.isoformat(), end.isoformat())
    assert w is not None and reached(w) == ["2026-12-01", "2026-12-02"]
    at_midnight = window(end.isoformat(), (end + timedelta(milliseconds=1)).isoformat())
    assert at_midnight is not None and reached(at_midnight) == ["2026-12-02", "2026-12-03"]


def test_a_live_versions_end_stops_at_now_and_unbuilt_days_are_not_reached() -> None:
    w = window("2026-12-02T05:00:00+00:00", "9999-12-31T23:59:59.999000+00:00")
    assert w is not None and w.end == NOW
    assert reached(w, BUILT - {"2026-12-03"}) == ["2026-12-02"]


def test_metadata_that_is_not_a_span_is_skipped_not_raised() -> None:
    assert window(None, None) is None
    assert window("not a time", "2026-12-02T00:00:00+00:00") is None
    assert window("2026-12-03T00:00:00+00:00", "2026-12-02T00:00:00+00:00") is None
    naive = window("2026-12-02T00:00:00", "2026-12-02T01:00:00")
    assert naive is not None and naive.start.tzinfo is not None


def test_queued_requests_are_capped_and_those_no_longer_valid_are_dropped() -> None:
    daily = dg.AssetKey("orders_daily")
    queue = [("orders_daily", f"2026-12-{d:02d}", 7) for d in range(1, 4)]
    queue += [("gone_daily", "2026-12-01", 7), ("orders_daily", "1999-01-01", 7)]
    queue += [("orders_daily", "2026-11-30", 8)] * MAX_PARTITIONS_PER_TICK
    cursor = _Cursor(queue=queue)
    requests = _due(cursor, {daily: DAILY})
    assert [r.partition_key for r in requests[:3]] == ["2026-12-01", "2026-12-02", "2026-12-03"]
    assert len(requests) == MAX_PARTITIONS_PER_TICK and len(cursor.queue) == 3
    assert all(r.asset_selection == [daily] for r in requests)


@dg.asset(partitions_def=dg.HourlyPartitionsDefinition(start_date="2026-11-28-00:00"))
def orders() -> None:
    """Stands in for a history asset: only its events matter here."""


@dg.asset(deps=[orders], partitions_def=DAILY)
def orders_daily() -> None: ...


def span_event(
    start: str, end: str, observed: bool = False
) -> dg.AssetMaterialization | dg.AssetObservation:
    meta = {"restated_from": start, "restated_to": end, "restated_closed": True}
    if observed:
        return dg.AssetObservation(asset_key="orders", metadata=meta)
    return dg.AssetMaterialization(asset_key="orders", metadata=meta)


def test_the_sensor_requests_days_built_before_the_restating_record_and_each_span_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cdc_platform.defs.sensors import restatements

    monkeypatch.setattr(restatements, "RECORDS_PER_TICK", 1)  # a record of each kind a tick
    sensor = restatements.build_restatements_sensor([dg.AssetKey("orders")])
    defs = dg.Definitions(assets=[orders, orders_daily], sensors=[sensor])
    with dg.DagsterInstance.ephemeral() as instance:
        for day in ("2026-11-30", "2026-12-01", "2026-12-02"):
            instance.report_runless_asset_event(
                dg.AssetMaterialization(asset_key="orders_daily", partition=day)
            )
        late = ("2026-11-30T10:00:00+00:00", "2026-12-01T23:59:59.999000+00:00")
        instance.report_runless_asset_event(span_event(*late))
        instance.report_runless_asset_event(span_event(*late))  # the run's next hour: same span
        # Rebuilt after the restating record: it has read the restated rows.
        instance.report_runless_asset_event(
            dg.AssetMaterialization(asset_key="orders_daily", partition="2026-12-01")
        )
        # An operator job naming no hour: an observation, reaching day 2.
        instance.report_runless_asset_event(
            span_event("2026-12-02T08:00:00+00:00", "2026-12-02T09:00:00+00:00", observed=True)
        )

        def tick(cursor: str | None) -> tuple[list[str], str | None]:
            context = dg.build_sensor_context(
                instance=instance, cursor=cursor, repository_def=defs.get_repository_def()
            )
            result = sensor(context)
            assert isinstance(result, dg.SensorResult)
            return [str(r.partition_key) for r in result.run_requests or []], result.cursor

        requested, cursor = tick(None)
        assert sorted(requested) == ["2026-11-30", "2026-12-02"]
        requested, cursor = tick(cursor)  # the same run's next hour, read at the next tick
        assert requested == []
        assert tick(cursor)[0] == []  # nothing new: nothing again
