"""The reference fold against the worked examples of docs/HISTORY_MODE.md, and one case per rule."""

from __future__ import annotations

import random
from collections import Counter
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from cdc_platform_tests.reference import TMAX, UNMODIFIED, reference_history, truncate_to_ms
from cdc_platform_tests.strategies import (
    MAX_DELAY_HOURS,
    assign_to_files,
    cdc_event_batches,
    hour_floor,
)

MS = timedelta(milliseconds=1)
T0 = datetime(2024, 1, 1, 12, 0, 0, tzinfo=UTC)


def ev(op: str, key: Any, seq: int, ts: datetime, **data: Any) -> dict[str, Any]:
    return {
        "id": key,
        **data,
        "cdc_operation_type": op,
        "cdc_change_seq": seq,
        "cdc_commit_timestamp": ts,
    }


def ver(key: Any, start: datetime, end: datetime, active: bool, **data: Any) -> dict[str, Any]:
    return {
        "id": key,
        **data,
        "_fivetran_start": start,
        "_fivetran_end": end,
        "_fivetran_active": active,
    }


def at(seconds: float = 0, us: int = 0) -> datetime:
    return T0 + timedelta(seconds=seconds, microseconds=us)


# ---------------------------------------------------- docs/HISTORY_MODE.md, example A


def d(day: int) -> datetime:
    return datetime(2020, 1, day, tzinfo=UTC)


SYNC1 = [ev("INSERT", "a", 1, d(1), counter=10), ev("INSERT", "b", 2, d(1), counter=20)]
SYNC2 = [
    ev("UPDATE", "a", 3, d(2), counter=30),
    ev("INSERT", "b", 2, d(1), counter=20),  # b re-delivered unchanged: the same event
    ev("INSERT", "c", 4, d(2), counter=40),
]
SYNC3 = [ev("DELETE", "b", 5, d(3))]


def test_example_a_after_first_sync() -> None:
    assert reference_history(SYNC1, ["id"]) == [
        ver("a", d(1), TMAX, True, counter=10),
        ver("b", d(1), TMAX, True, counter=20),
    ]


def test_example_a_after_second_sync() -> None:
    assert reference_history(SYNC1 + SYNC2, ["id"]) == [
        ver("a", d(1), datetime(2020, 1, 1, 23, 59, 59, 999000, tzinfo=UTC), False, counter=10),
        ver("a", d(2), TMAX, True, counter=30),
        ver("b", d(1), TMAX, True, counter=20),
        ver("c", d(2), TMAX, True, counter=40),
    ]


def test_example_a_after_delete_of_b() -> None:
    expected = [
        ver("a", d(1), datetime(2020, 1, 1, 23, 59, 59, 999000, tzinfo=UTC), False, counter=10),
        ver("a", d(2), TMAX, True, counter=30),
        ver("b", d(1), d(3), False, counter=20),
        ver("c", d(2), TMAX, True, counter=40),
    ]
    assert reference_history(SYNC1 + SYNC2 + SYNC3, ["id"]) == expected
    # b re-sent as a visibly identical event with its own seq: still no new history.
    resent = [*SYNC1, ev("UPDATE", "b", 6, d(1), counter=20), *SYNC2, *SYNC3]
    assert reference_history(resent, ["id"]) == expected


# ---------------------------------------------------- docs/HISTORY_MODE.md, example B

T1, T2, T3, T4, T5 = (datetime(2024, 3, 1, h, 0, 0, 250000, tzinfo=UTC) for h in range(1, 6))


def test_example_b_update_file_with_unmodified_cells() -> None:
    events = [
        ev("INSERT", 1, 1, T1, COL1="abc", COL2=1),
        ev("UPDATE", 1, 2, T2, COL1="pqr", COL2=2),
        ev("INSERT", 2, 3, T2, COL1="mno", COL2=3),
        ev("UPDATE", 1, 4, T3, COL1="xyz", COL2=UNMODIFIED),
        ev("UPDATE", 2, 5, T4, COL1=UNMODIFIED, COL2=1000),
        ev("UPDATE", 1, 6, T5, COL1="def", COL2=UNMODIFIED),
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, T1, T2 - MS, False, COL1="abc", COL2=1),
        ver(1, T2, T3 - MS, False, COL1="pqr", COL2=2),
        ver(1, T3, T5 - MS, False, COL1="xyz", COL2=2),
        ver(1, T5, TMAX, True, COL1="def", COL2=2),
        ver(2, T2, T4 - MS, False, COL1="mno", COL2=3),
        ver(2, T4, TMAX, True, COL1="mno", COL2=1000),
    ]


# --------------------------------------------------------------------------- rules


def test_empty_input() -> None:
    assert reference_history([], ["id"]) == []


def test_duplicate_seq_counted_once() -> None:
    a = ev("INSERT", 1, 1, at(0), v=1)
    b = ev("UPDATE", 1, 2, at(10), v=2)
    expected = [ver(1, at(0), at(10) - MS, False, v=1), ver(1, at(10), TMAX, True, v=2)]
    assert reference_history([a, b, dict(b), dict(a)], ["id"]) == expected
    # An old event re-delivered after a newer one changes nothing either.
    assert reference_history([b, a, dict(a), dict(b)], ["id"]) == expected


def test_duplicate_seq_with_different_content_is_an_error() -> None:
    with pytest.raises(ValueError, match="cdc_change_seq=1"):
        reference_history([ev("INSERT", 1, 1, at(0), v=1), ev("INSERT", 1, 1, at(0), v=2)], ["id"])


def test_same_seq_on_two_keys_are_two_events() -> None:
    events = [ev("INSERT", 1, 1, at(0), v=1), ev("INSERT", 2, 1, at(0), v=2)]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), TMAX, True, v=1),
        ver(2, at(0), TMAX, True, v=2),
    ]


def test_noop_update_makes_no_version() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v=1, w=None),
        ev("UPDATE", 1, 2, at(5), v=1, w=None),  # None == None: still a no-op
        ev("UPDATE", 1, 3, at(9), v=1),  # w missing -> null: still a no-op
    ]
    assert reference_history(events, ["id"]) == [ver(1, at(0), TMAX, True, v=1, w=None)]


def test_null_vs_value_is_a_change() -> None:
    events = [ev("INSERT", 1, 1, at(0), v=None), ev("UPDATE", 1, 2, at(5), v=0)]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(5) - MS, False, v=None),
        ver(1, at(5), TMAX, True, v=0),
    ]


def test_update_as_first_event() -> None:
    events = [ev("UPDATE", 7, 1, at(0), v="x"), ev("INSERT", 7, 2, at(1), v="y")]
    assert reference_history(events, ["id"]) == [
        ver(7, at(0), at(1) - MS, False, v="x"),
        ver(7, at(1), TMAX, True, v="y"),
    ]


def test_operation_type_is_case_insensitive() -> None:
    events = [
        ev("insert", 1, 1, at(0), v=1),
        ev("Update", 1, 2, at(1), v=2),
        ev("delete", 1, 3, at(2)),
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(1) - MS, False, v=1),
        ver(1, at(1), at(2), False, v=2),
    ]


def test_unknown_operation_is_an_error() -> None:
    with pytest.raises(ValueError, match="UPSERT"):
        reference_history([ev("UPSERT", 1, 1, at(0), v=1)], ["id"])


def test_timestamps_truncated_to_millisecond() -> None:
    events = [ev("INSERT", 1, 1, at(0, us=123_999), v=1), ev("DELETE", 1, 2, at(3, us=456_789))]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0, us=123_000), at(3, us=456_000), False, v=1)
    ]
    assert truncate_to_ms(at(0, us=999)) == at(0)


def test_several_events_in_one_millisecond_make_one_image_in_seq_order() -> None:
    # Same millisecond; seq order disagrees with microsecond order: seq wins.
    events = [
        ev("INSERT", 1, 10, at(1, us=900), v="first", w=1),
        ev("UPDATE", 1, 11, at(1, us=100), v="second", w=UNMODIFIED),
        ev("UPDATE", 1, 12, at(1, us=500), v=UNMODIFIED, w=3),
    ]
    assert reference_history(events, ["id"]) == [ver(1, at(1), TMAX, True, v="second", w=3)]


def test_order_by_millisecond_before_seq() -> None:
    # The contract orders by (ms, seq): a later millisecond wins even with a smaller seq.
    events = [ev("UPDATE", 1, 5, at(2), v="b"), ev("INSERT", 1, 10, at(1), v="a")]
    assert reference_history(events, ["id"]) == [
        ver(1, at(1), at(2) - MS, False, v="a"),
        ver(1, at(2), TMAX, True, v="b"),
    ]


def test_sub_millisecond_changes_collapse() -> None:
    events = [
        ev("INSERT", 1, 1, at(0, us=1_000), v=1),
        ev("UPDATE", 1, 2, at(0, us=1_999), v=2),
        ev("UPDATE", 1, 3, at(0, us=2_000), v=3),  # next millisecond
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0, us=1_000), at(0, us=1_000), False, v=2),
        ver(1, at(0, us=2_000), TMAX, True, v=3),
    ]


def test_insert_then_delete_in_one_millisecond() -> None:
    events = [ev("INSERT", 1, 1, at(4, us=10), v=1), ev("DELETE", 1, 2, at(4, us=20))]
    assert reference_history(events, ["id"]) == [ver(1, at(4), at(4), False, v=1)]


def test_update_then_delete_in_one_millisecond_on_live_key() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v=1),
        ev("UPDATE", 1, 2, at(4), v=2),
        ev("DELETE", 1, 3, at(4)),
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(4) - MS, False, v=1),
        ver(1, at(4), at(4), False, v=2),
    ]


def test_noop_update_then_delete_in_one_millisecond_closes_live_version() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v=1),
        ev("UPDATE", 1, 2, at(4), v=1),
        ev("DELETE", 1, 3, at(4)),
    ]
    assert reference_history(events, ["id"]) == [ver(1, at(0), at(4), False, v=1)]


def test_delete_of_unknown_key_changes_nothing() -> None:
    events = [ev("DELETE", 99, 1, at(0)), ev("INSERT", 1, 2, at(1), v=1)]
    assert reference_history(events, ["id"]) == [ver(1, at(1), TMAX, True, v=1)]


def test_double_delete_keeps_first_end() -> None:
    events = [ev("INSERT", 1, 1, at(0), v=1), ev("DELETE", 1, 2, at(3)), ev("DELETE", 1, 3, at(8))]
    assert reference_history(events, ["id"]) == [ver(1, at(0), at(3), False, v=1)]


def test_delete_ignores_data_cells() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v=1),
        ev("DELETE", 1, 2, at(3), v=999),
        ev("UPDATE", 1, 3, at(5), v=UNMODIFIED),
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(3), False, v=1),
        ver(1, at(5), TMAX, True, v=1),
    ]


def test_delete_then_reinsert_same_image_is_a_new_version() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v=1),
        ev("DELETE", 1, 2, at(3)),
        ev("INSERT", 1, 3, at(7), v=1),
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(3), False, v=1),
        ver(1, at(7), TMAX, True, v=1),
    ]


def test_delete_then_insert_in_one_millisecond_is_judged_by_the_image() -> None:
    # The millisecond ends with a non-delete: the key stays live with that ms's image.
    same = [
        ev("INSERT", 1, 1, at(0), v=1),
        ev("DELETE", 1, 2, at(3)),
        ev("INSERT", 1, 3, at(3), v=1),
    ]
    assert reference_history(same, ["id"]) == [ver(1, at(0), TMAX, True, v=1)]
    other = [
        ev("INSERT", 1, 1, at(0), v=1),
        ev("DELETE", 1, 2, at(3)),
        ev("INSERT", 1, 3, at(3), v=2),
    ]
    assert reference_history(other, ["id"]) == [
        ver(1, at(0), at(3) - MS, False, v=1),
        ver(1, at(3), TMAX, True, v=2),
    ]


def test_unmodified_after_delete_uses_last_image() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v="a", w=1),
        ev("DELETE", 1, 2, at(2)),
        ev("UPDATE", 1, 3, at(4), v=UNMODIFIED, w=2),
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(2), False, v="a", w=1),
        ver(1, at(4), TMAX, True, v="a", w=2),
    ]


def test_unmodified_with_no_earlier_image_is_null() -> None:
    events = [ev("UPDATE", 1, 1, at(0), v=UNMODIFIED, w=2)]
    assert reference_history(events, ["id"]) == [ver(1, at(0), TMAX, True, v=None, w=2)]


def test_unmodified_only_update_is_a_noop() -> None:
    events = [ev("INSERT", 1, 1, at(0), v="a"), ev("UPDATE", 1, 2, at(1), v=UNMODIFIED)]
    assert reference_history(events, ["id"]) == [ver(1, at(0), TMAX, True, v="a")]


def test_schema_drift_missing_column_is_null() -> None:
    events = [
        ev("INSERT", 1, 1, at(0), v=1, extra="x"),
        ev("UPDATE", 1, 2, at(1), v=1),  # 'extra' dropped from the source: null, not unmodified
        ev("INSERT", 2, 3, at(2), v=5),  # key 2 never had 'extra'
        ev("UPDATE", 2, 4, at(3), v=5, late="new"),  # a column that appears later
    ]
    assert reference_history(events, ["id"]) == [
        ver(1, at(0), at(1) - MS, False, v=1, extra="x", late=None),
        ver(1, at(1), TMAX, True, v=1, extra=None, late=None),
        ver(2, at(2), at(3) - MS, False, v=5, extra=None, late=None),
        ver(2, at(3), TMAX, True, v=5, extra=None, late="new"),
    ]


def test_composite_primary_key_and_no_cdc_columns_in_output() -> None:
    def cev(op: str, a: int, b: str, seq: int, ts: datetime, **data: Any) -> dict[str, Any]:
        return {
            "a": a,
            "b": b,
            **data,
            "cdc_operation_type": op,
            "cdc_change_seq": seq,
            "cdc_commit_timestamp": ts,
        }

    events = [
        cev("INSERT", 1, "y", 1, at(0), v=1),
        cev("INSERT", 1, "x", 2, at(0), v=2),
        cev("UPDATE", 1, "y", 3, at(1), v=3),
    ]
    base = {"_fivetran_end": TMAX, "_fivetran_active": True}
    assert reference_history(events, ["a", "b"]) == [
        {"a": 1, "b": "x", "v": 2, "_fivetran_start": at(0), **base},
        {
            "a": 1,
            "b": "y",
            "v": 1,
            "_fivetran_start": at(0),
            **base,
            "_fivetran_end": at(1) - MS,
            "_fivetran_active": False,
        },
        {"a": 1, "b": "y", "v": 3, "_fivetran_start": at(1), **base},
    ]


def test_non_utc_timestamps_are_converted() -> None:
    from datetime import timezone

    plus2 = timezone(timedelta(hours=2))
    events = [ev("INSERT", 1, 1, datetime(2024, 1, 1, 14, 0, tzinfo=plus2), v=1)]
    [row] = reference_history(events, ["id"])
    assert row["_fivetran_start"] == datetime(2024, 1, 1, 12, 0, tzinfo=UTC)
    assert row["_fivetran_start"].tzinfo == UTC


# --------------------------------------------------------------------------- properties

LIGHT = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_invariants(rows: list[dict[str, Any]]) -> None:
    """docs/HISTORY_MODE.md section 6, on the reference's own output."""
    by_key: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        assert row["id"] is not None
        by_key.setdefault(row["id"], []).append(row)
    for versions in by_key.values():
        starts = [v["_fivetran_start"] for v in versions]
        assert starts == sorted(set(starts))
        assert sum(v["_fivetran_active"] for v in versions) <= 1
        for v in versions:
            assert v["_fivetran_active"] == (v["_fivetran_end"] == TMAX)
            assert v["_fivetran_start"] <= v["_fivetran_end"]
            assert v["_fivetran_start"].microsecond % 1000 == 0
        for prev, nxt in pairwise(versions):
            assert prev["_fivetran_end"] < nxt["_fivetran_start"]


@LIGHT
@given(cdc_event_batches())
def test_reference_invariants_and_delivery_order(events: list[dict[str, Any]]) -> None:
    rows = reference_history(events, ["id"])
    check_invariants(rows)
    shuffled = list(events)
    random.Random(len(events)).shuffle(shuffled)
    assert reference_history(shuffled, ["id"]) == rows
    assert reference_history(list({id(e): e for e in events}.values()) * 2, ["id"]) == rows


@LIGHT
@given(st.data())
def test_assign_to_files_respects_delivery_window(data: st.DataObject) -> None:
    events = data.draw(cdc_event_batches())
    files = assign_to_files(data.draw, events)
    placed = [e for batch in files.values() for e in batch]
    assert sorted(map(id, placed)) == sorted(map(id, events))
    for (hour, name), batch in files.items():
        assert hour.tzinfo is not None and hour == hour_floor(hour)
        assert name.endswith(".parquet")
        for e in batch:
            floor = hour_floor(e["cdc_commit_timestamp"])
            assert floor <= hour <= floor + timedelta(hours=MAX_DELAY_HOURS)


def _keys_ms(events: list[dict[str, Any]]) -> Counter[tuple[Any, datetime]]:
    distinct = {(e["id"], e["cdc_change_seq"]): e for e in events}.values()
    return Counter((e["id"], truncate_to_ms(e["cdc_commit_timestamp"])) for e in distinct)


def _first_op_is_update(events: list[dict[str, Any]]) -> bool:
    first: dict[Any, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e["cdc_change_seq"]):
        first.setdefault(e["id"], e)
    return any(e["cdc_operation_type"].upper() == "UPDATE" for e in first.values())


def _visible(e: dict[str, Any]) -> tuple[Any, ...]:
    cells = [(k, "<U>" if v is UNMODIFIED else v) for k, v in sorted(e.items())]
    return (*[c for c in cells if not c[0].startswith("cdc_")], e["cdc_operation_type"].upper())


FEATURES = {
    "duplicate seq": lambda es: len({e["cdc_change_seq"] for e in es}) < len(es),
    "visibly identical, new seq": lambda es: any(
        n > 1
        for n in Counter(
            _visible(e) for e in {e["cdc_change_seq"]: e for e in es}.values()
        ).values()
    ),
    "update first": _first_op_is_update,
    "several events in one ms": lambda es: any(n > 1 for n in _keys_ms(es).values()),
    "sub-ms collapse": lambda es: any(
        a["id"] == b["id"]
        and a["cdc_commit_timestamp"] != b["cdc_commit_timestamp"]
        and truncate_to_ms(a["cdc_commit_timestamp"]) == truncate_to_ms(b["cdc_commit_timestamp"])
        for a in es
        for b in es
    ),
    "delete of unknown key": lambda es: any(
        e["cdc_operation_type"].upper() == "DELETE"
        and not any(o["id"] == e["id"] and o["cdc_change_seq"] < e["cdc_change_seq"] for o in es)
        for e in es
    ),
    "unmodified cell": lambda es: any(v is UNMODIFIED for e in es for v in e.values()),
    "drift": lambda es: any("extra" in e for e in es) and any("extra" not in e for e in es),
    "insert+delete in one ms": lambda es: any(
        v["_fivetran_start"] == v["_fivetran_end"] for v in reference_history(es, ["id"])
    ),
    "shuffled delivery": lambda es: (
        [e["cdc_change_seq"] for e in es] != sorted(e["cdc_change_seq"] for e in es)
    ),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_strategy_generates(feature: str) -> None:
    found = find(
        cdc_event_batches(),
        FEATURES[feature],
        settings=settings(max_examples=2000, database=None, deadline=None, phases=[Phase.generate]),
    )
    assert FEATURES[feature](found)
