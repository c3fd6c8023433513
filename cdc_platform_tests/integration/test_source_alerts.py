"""The source alert sensor against a real Dagster instance and a loopback webhook: a stale
source, hours left unapplied and a failing sensor are each alerted once, and their end once.
(The freshness states themselves come from Dagster's freshness daemon in test_unattended.)"""

import time
from datetime import UTC, datetime
from typing import Any

import dagster as dg
from dagster._core.definitions.freshness import FreshnessState, FreshnessStateChange
from dagster._core.definitions.run_request import InstigatorType
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin,
    RemoteInstigatorOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.scheduler.instigation import (
    InstigatorState,
    InstigatorStatus,
    SensorInstigatorData,
    TickData,
    TickStatus,
)
from dagster_shared.error import SerializableErrorInfo

from cdc_platform.defs.alerts.sources import (
    DEFAULT_LOCATION,
    FAILING_TICKS,
    build_source_alert_sensor,
)
from cdc_platform.defs.alerts.webhook import AlertWebhookResource
from cdc_platform.defs.tags import BACKLOG_AGE, BACKLOG_HOURS, BACKLOG_OLDEST, BACKLOG_SINCE
from cdc_platform.lib.config import TableConfig
from cdc_platform_tests.integration.test_alerts import tick
from cdc_platform_tests.webhook import Webhook

START = datetime(2024, 1, 1, tzinfo=UTC)


def table(name: str, **kwargs: object) -> TableConfig:
    return TableConfig(name=name, primary_key=["id"], start=START, **kwargs)  # type: ignore[arg-type]


def kinds(webhook: Webhook) -> list[tuple[str, str, str]]:
    return [(c.body["kind"], c.body["subject"], c.body["severity"]) for c in webhook.posted]


def freshness(instance: dg.DagsterInstance, name: str, new: FreshnessState) -> None:
    """The event Dagster's freshness daemon records on a state change (the same call)."""
    instance._report_runless_asset_event(
        FreshnessStateChange(
            key=dg.AssetKey(name),
            new_state=new,
            previous_state=FreshnessState.UNKNOWN,
            state_change_timestamp=time.time(),
        )
    )


def test_a_stale_source_alerts_once_per_state_and_once_when_fresh(webhook: Webhook) -> None:
    hook = AlertWebhookResource(
        webhook_url=webhook.secret_url, ui_base_url="https://dagster.example"
    )
    sensor = build_source_alert_sensor(
        [table("orders", expected_delivery_hours=2), table("quiet")], []
    )
    with dg.instance_for_test() as instance:
        cursor = tick(sensor, instance, None, hook)
        for state in ("WARN", "WARN", "FAIL", "FAIL", "PASS", "PASS"):
            freshness(instance, "orders", FreshnessState(state))
            freshness(instance, "elsewhere", FreshnessState(state))  # not this location's
            cursor = tick(sensor, instance, cursor, hook)
    assert kinds(webhook) == [
        ("source_stale", "orders", "WARN"),
        ("source_stale", "orders", "ERROR"),
        ("source_fresh", "orders", "ERROR"),
    ]
    stale = webhook.posted[1].body
    assert "no new data for 4 h or more (expected every 2 h; freshness FAIL)" in stale["text"]
    assert stale["url"] == "https://dagster.example/assets/orders"


def test_a_source_stale_before_the_first_tick_is_alerted(webhook: Webhook) -> None:
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_source_alert_sensor([table("orders", expected_delivery_hours=1)], [])
    with dg.instance_for_test() as instance:
        freshness(instance, "orders", FreshnessState.FAIL)
        cursor = tick(sensor, instance, None, hook)
        tick(sensor, instance, cursor, hook)
    assert kinds(webhook) == [("source_stale", "orders", "ERROR")]


def backlog(
    instance: dg.DagsterInstance,
    name: str,
    hours: int,
    age_minutes: float,
    since: float | None = None,
) -> None:
    """The observation the landing sensor reports when its backlog changes (``since``: when
    its oldest hour was first requested; without it, as a landing sensor before it reported)."""
    metadata: dict[str, Any] = {
        BACKLOG_HOURS: hours,
        BACKLOG_OLDEST: "2024-01-01-05:00" if hours else "",
        BACKLOG_AGE: dg.MetadataValue.float(float(age_minutes)),
    }
    if since is not None:
        metadata[BACKLOG_SINCE] = dg.MetadataValue.float(since)
    instance.report_runless_asset_event(
        dg.AssetObservation(asset_key=dg.AssetKey(name), metadata=metadata)
    )


def test_hours_unapplied_past_the_threshold_alert_once_and_once_when_applied(
    webhook: Webhook,
) -> None:
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    now = {"t": time.time()}
    sensor = build_source_alert_sensor(
        [table("orders", unapplied_alert_minutes=30), table("fine")], [], clock=lambda: now["t"]
    )
    with dg.instance_for_test() as instance:
        cursor = tick(sensor, instance, None, hook)
        since = now["t"] - 5 * 60
        backlog(instance, "orders", 2, age_minutes=5, since=since)
        backlog(instance, "fine", 1, age_minutes=0)
        backlog(instance, "fine", 0, age_minutes=0)  # applied before the threshold: quiet
        cursor = tick(sensor, instance, cursor, hook)
        now["t"] += 20 * 60  # 25 minutes old
        cursor = tick(sensor, instance, cursor, hook)
        assert webhook.posted == []
        now["t"] += 6 * 60  # 31 minutes old
        cursor = tick(sensor, instance, cursor, hook)
        backlog(instance, "orders", 3, age_minutes=40, since=since)  # one more: still one alert
        now["t"] += 60 * 60
        cursor = tick(sensor, instance, cursor, hook)
        backlog(instance, "orders", 0, age_minutes=0)
        tick(sensor, instance, cursor, hook)
    assert kinds(webhook) == [
        ("hours_unapplied", "orders", "ERROR"),
        ("hours_applied", "orders", "ERROR"),
    ]
    first = webhook.posted[0].body
    assert first["counts"] == {"unapplied_hours": 2}
    assert (
        "2 hour(s) requested and not applied for 31 min, the oldest 2024-01-01-05:00"
        in (first["text"])
    )


class Daemon:
    """Records a sensor's ticks and state as Dagster's sensor daemon does (its storage calls)."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance
        self.failures: dict[str, int] = {}

    def tick(
        self, name: str, status: TickStatus, error: SerializableErrorInfo | None = None
    ) -> None:
        origin = RemoteInstigatorOrigin(
            RemoteRepositoryOrigin(
                RegisteredCodeLocationOrigin(DEFAULT_LOCATION), "__repository__"
            ),
            name,
        )
        failures = self.failures.get(name, 0) + 1 if status == TickStatus.FAILURE else 0
        self.failures[name] = failures
        now = time.time()
        self.instance.create_tick(
            TickData(
                instigator_origin_id=origin.get_id(),
                instigator_name=name,
                instigator_type=InstigatorType.SENSOR,
                status=status,
                timestamp=now,
                selector_id=origin.get_selector().get_id(),
                error=error,
                consecutive_failure_count=failures,
            )
        )
        data = SensorInstigatorData(
            last_tick_timestamp=now,
            # None from a tick's start until it ends without failing
            last_tick_success_timestamp=now
            if status in (TickStatus.SUCCESS, TickStatus.SKIPPED)
            else None,
        )
        state = InstigatorState(origin, InstigatorType.SENSOR, InstigatorStatus.RUNNING, data)
        if self.instance.get_instigator_state(origin.get_id(), origin.get_selector().get_id()):
            self.instance.update_instigator_state(state)
        else:
            self.instance.add_instigator_state(state)


# What the daemon stores for a failed evaluation: Dagster's wrapper, the platform's error inside.
ROOT_GONE = SerializableErrorInfo(
    "dagster._core.errors.SensorExecutionError: Error occurred during the execution of "
    "evaluation_fn for sensor orders_landing_sensor\n",
    [],
    "SensorExecutionError",
    cause=SerializableErrorInfo(
        "LandingRootUnavailableError: orders: the landing root /mnt/landing cannot be listed "
        "(No such file or directory)\nmore",
        [],
        "LandingRootUnavailableError",
    ),
)


def test_a_sensor_failing_tick_after_tick_alerts_once_and_its_recovery_once(
    webhook: Webhook,
) -> None:
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    watched = ["orders_landing_sensor", "fine_landing_sensor"]
    sensor = build_source_alert_sensor([table("orders")], watched)
    with dg.instance_for_test() as instance:
        daemon = Daemon(instance)
        cursor = tick(sensor, instance, None, hook)
        daemon.tick("fine_landing_sensor", TickStatus.FAILURE, ROOT_GONE)  # one blip: quiet
        daemon.tick("fine_landing_sensor", TickStatus.SKIPPED)
        for _ in range(FAILING_TICKS + 2):
            daemon.tick("orders_landing_sensor", TickStatus.FAILURE, ROOT_GONE)
            cursor = tick(sensor, instance, cursor, hook)
        daemon.tick("orders_landing_sensor", TickStatus.STARTED)  # running: not a recovery
        cursor = tick(sensor, instance, cursor, hook)
        assert len(webhook.posted) == 1
        daemon.tick("orders_landing_sensor", TickStatus.SKIPPED)
        cursor = tick(sensor, instance, cursor, hook)
        tick(sensor, instance, cursor, hook)
    assert kinds(webhook) == [
        ("sensor_failing", "orders_landing_sensor", "ERROR"),
        ("sensor_recovered", "orders_landing_sensor", "ERROR"),
    ]
    text = webhook.posted[0].body["text"]
    assert (
        "its last 3 ticks or more failed: LandingRootUnavailableError: orders: the landing root "
        "/mnt/landing cannot be listed (No such file or directory). <"
    ) in text
    assert "/locations/cdc_platform/sensors/orders_landing_sensor" in text


def test_a_cause_the_fleet_shares_is_one_digest(webhook: Webhook) -> None:
    """Every landing sensor failing on one unmounted root: one message naming them, not 40."""
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    watched = [f"t{i:02d}_landing_sensor" for i in range(40)]
    sensor = build_source_alert_sensor([], watched)
    with dg.instance_for_test() as instance:
        daemon = Daemon(instance)
        cursor = tick(sensor, instance, None, hook)
        for _ in range(FAILING_TICKS):
            for name in watched:
                daemon.tick(name, TickStatus.FAILURE, ROOT_GONE)
        tick(sensor, instance, cursor, hook)
    (digest,) = [c.body for c in webhook.posted]
    assert digest["kind"] == "sensor_failing" and digest["counts"] == {"subjects": 40}
    assert digest["subjects"] == sorted(watched)
    assert digest["text"].startswith(
        ":rotating_light: cdc_platform: 40 `sensor_failing` alerts at once: `t00_landing_sensor`, "
    )
    assert (
        "and 30 more; the first: its last 3 ticks or more failed: LandingRootUnavailable"
        in (digest["text"])
    )
