"""Alerts against a real HTTP server on loopback and a real Dagster instance: payloads,
delivery, redaction, the run failure and check alert sensors, and what a tick costs."""

import json
import logging
import socket
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
import pytest
import sqlalchemy
import sqlalchemy.event

from cdc_platform.defs.alerts import checks as check_alerts
from cdc_platform.defs.alerts import webhook as alerts_module
from cdc_platform.defs.alerts.checks import (
    CHECK_ALERT_SENSOR_NAME,
    build_check_failure_alert_sensor,
)
from cdc_platform.defs.alerts.runs import build_run_failure_alert_sensor
from cdc_platform.defs.alerts.webhook import (
    ALERT_WEBHOOK_ENV_VAR,
    MAX_DELIVERY_ATTEMPTS,
    UI_BASE_URL_ENV_VAR,
    AlertWebhookResource,
    alert_webhook_from_env,
)
from cdc_platform.defs.tables import build_table_definitions
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.fleet.alerts import AlertDeliveryError, build_alert, post_alert, redact_url
from cdc_platform.lib.history import invariants
from cdc_platform.lib.landing.where.layout import hour_folder, hour_to_partition_key
from cdc_platform_tests.helpers import dagster_resources, write_parquet_events
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.webhook import SECRET_PATH, SECRET_QUERY, Webhook

START = datetime(2024, 1, 1, tzinfo=UTC)


def assert_no_secret(text: str) -> None:
    for secret in ("SeCrEtToKeN123456", "qs-secret-987", "T0001/B0002"):
        assert secret not in text


# --- payloads ---------------------------------------------------------------------------------


def test_check_failed_payload_shape_and_text() -> None:
    payload = build_alert(
        "check_failed",
        table="orders",
        partition="2024-01-01-05:00",
        check="versions_do_not_overlap",
        counts={"keys_fail": 3},
        run_id="0123456789abcdef",
        ui_base_url="http://dagster.example:3000/",
        detail="3 keys have overlapping versions",
        sample_keys=[(1, "a"), 2, {"id": 3}],
    )
    run_url = "http://dagster.example:3000/runs/0123456789abcdef"
    assert payload["text"] == (
        ":rotating_light: cdc_platform: check `versions_do_not_overlap` failed on `orders` "
        f"(partition 2024-01-01-05:00): 3 keys fail. <{run_url}|run 01234567>"
    )
    assert payload == {
        "text": payload["text"],
        "kind": "check_failed",
        "table": "orders",
        "partition": "2024-01-01-05:00",
        "check": "versions_do_not_overlap",
        "counts": {"keys_fail": 3},
        "run_id": "0123456789abcdef",
        "run_url": run_url,
        "detail": "3 keys have overlapping versions",
        "sample_keys": [[1, "a"], 2, {"id": 3}],
    }
    json.dumps(payload)  # serialisable as is


def test_run_failed_text_is_one_escaped_line_and_detail_is_truncated() -> None:
    detail = "ValueError: bad <row> & friends\nsecond line " + "x" * 2000
    payload = build_alert(
        "run_failed",
        table="orders",
        partition=None,
        check=None,
        counts={"failed_steps": 1},
        run_id="abc",
        ui_base_url="http://localhost:3000",
        detail=detail,
        sample_keys=None,
    )
    text = payload["text"]
    assert "\n" not in text
    assert text.startswith(
        ":x: cdc_platform: run failed for `orders`: ValueError: bad &lt;row&gt; &amp; friends second line"
    )
    assert "partition" not in text
    assert text.endswith("<http://localhost:3000/runs/abc|run abc>")
    assert len(payload["detail"]) == 500
    assert payload["sample_keys"] == []
    assert payload["partition"] is None


def test_sample_keys_are_capped_and_unknown_kind_rejected() -> None:
    payload = build_alert(
        "check_failed", "t", None, "c", {"rows": 50}, "r", "http://x", "", list(range(50))
    )
    assert payload["sample_keys"] == list(range(10))
    with pytest.raises(ValueError, match="unknown alert kind"):
        build_alert("nope", "t", None, None, {}, "r", "http://x", "")  # type: ignore[arg-type]


def test_redact_url_keeps_only_scheme_and_host() -> None:
    assert (
        redact_url("https://hooks.slack.com/services/T0/B0/XYZ?x=1") == "https://hooks.slack.com/…"
    )
    assert redact_url("http://user:pw@127.0.0.1:8080/a/b") == "http://127.0.0.1:8080/…"


# --- delivery ---------------------------------------------------------------------------------


def test_post_alert_sends_the_json_payload(webhook: Webhook) -> None:
    payload = build_alert(
        "run_failed", "orders", "2024-01-01-05:00", None, {}, "r1", "http://ui", "boom"
    )
    post_alert(webhook.secret_url, payload)
    (got,) = webhook.posted
    assert got.body == payload
    assert got.path == f"{SECRET_PATH}?{SECRET_QUERY}"
    assert got.content_type.startswith("application/json")


def test_non_2xx_raises_a_redacted_error(webhook: Webhook) -> None:
    webhook.status = 500
    # A server that echoes the request path must not leak it through our error either.
    webhook.answer = f"invalid_token for {SECRET_PATH}?{SECRET_QUERY}".encode()
    with pytest.raises(AlertDeliveryError) as info:
        post_alert(webhook.secret_url, {"text": "hi"})
    message = str(info.value)
    assert "HTTP 500" in message
    assert f"http://127.0.0.1:{webhook.port}/…" in message
    assert "invalid_token" in message
    assert_no_secret(message)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_redirect_is_not_followed(webhook: Webhook) -> None:
    webhook.status = 302
    webhook.headers = {"Location": f"{webhook.base}/elsewhere"}
    with pytest.raises(AlertDeliveryError, match="HTTP 302") as info:
        post_alert(webhook.secret_url, {"text": "hi"})
    assert len(webhook.posted) == 1
    assert_no_secret(str(info.value))


def test_unreachable_webhook_raises_a_redacted_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}{SECRET_PATH}?{SECRET_QUERY}"
    with pytest.raises(AlertDeliveryError, match="could not reach") as info:
        post_alert(url, {"text": "hi"}, timeout=2)
    assert_no_secret(str(info.value))


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(AlertDeliveryError, match="only http"):
        post_alert("file:///etc/passwd", {"text": "hi"})


# --- the resource -----------------------------------------------------------------------------


def test_resource_is_a_no_op_without_url(webhook: Webhook) -> None:
    assert AlertWebhookResource().send({"text": "hi"}) is False
    assert AlertWebhookResource(webhook_url="").send({"text": "hi"}) is False  # empty env var
    assert webhook.posted == []


def test_resource_posts_and_logs_without_the_url(
    webhook: Webhook, caplog: pytest.LogCaptureFixture
) -> None:
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    with caplog.at_level(logging.DEBUG):
        assert resource.send({"text": "hello"}) is True
    assert webhook.posted[0].body == {"text": "hello"}
    assert "alert sent" in caplog.text
    assert_no_secret(caplog.text)

    webhook.status = 403
    with caplog.at_level(logging.DEBUG), pytest.raises(AlertDeliveryError) as info:
        resource.send({"text": "again"})
    assert_no_secret(str(info.value))
    assert_no_secret(caplog.text)


# --- the run failure sensor -------------------------------------------------------------------


@dg.asset(
    name="orders",
    partitions_def=dg.HourlyPartitionsDefinition(start_date="2024-01-01-00:00"),
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def failing_orders(context: dg.AssetExecutionContext) -> None:
    raise ValueError(f"bad <row> in {len(context.partition_keys)} partitions\nsecond line")


def fail_a_run(
    instance: dg.DagsterInstance, tags: dict[str, str], partition_key: str | None = None
) -> str:
    """A real failed run recorded in ``instance`` (its RUN_FAILURE event included)."""
    result = dg.materialize(
        [failing_orders],
        instance=instance,
        tags=tags,
        raise_on_error=False,
        partition_key=partition_key,
    )
    assert not result.success
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.status == dg.DagsterRunStatus.FAILURE
    return result.run_id


def tick(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance,
    cursor: str | None,
    resource: AlertWebhookResource,
    **context: Any,
) -> str | None:
    """One tick of an alert sensor, as the daemon would run it; the cursor it leaves."""
    built = dg.build_sensor_context(
        cursor=cursor, instance=instance, resources={"alert_webhook": resource}, **context
    )
    return sensor.evaluate_tick(built).cursor


def test_run_failure_sensor_posts_table_range_and_reason(webhook: Webhook) -> None:
    sensor = build_run_failure_alert_sensor()
    assert sensor.name == "cdc_run_failure_alerts"
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    resource = AlertWebhookResource(
        webhook_url=webhook.secret_url, ui_base_url="http://dagster.example:3000"
    )
    tags = {
        "cdc_platform/table": "orders",
        "dagster/asset_partition_range_start": "2024-01-01-05:00",
        "dagster/asset_partition_range_end": "2024-01-01-07:00",
    }
    with dg.DagsterInstance.ephemeral() as instance:
        fail_a_run(instance, {}, partition_key="2024-01-01-01:00")  # before the first tick
        cursor = tick(sensor, instance, None, resource)  # starts from now: no alert for it
        assert webhook.posted == []
        run_id = fail_a_run(instance, tags)
        cursor = tick(sensor, instance, cursor, resource)
        tick(sensor, instance, cursor, resource)  # nothing new: nothing posted twice

    (got,) = webhook.posted
    body = got.body
    assert body["kind"] == "run_failed"
    assert body["table"] == "orders"
    assert body["partition"] == "2024-01-01-05:00..2024-01-01-07:00"
    assert body["counts"] == {"failed_steps": 1}
    assert body["run_url"] == f"http://dagster.example:3000/runs/{run_id}"
    assert body["detail"].startswith("orders: ValueError: bad <row> in 3 partitions")
    assert body["text"].startswith(
        ":x: cdc_platform: run failed for `orders` (partition 2024-01-01-05:00..2024-01-01-07:00): "
        "orders: ValueError: bad &lt;row&gt; in 3 partitions second line"
    )
    assert body["text"].endswith(f"<http://dagster.example:3000/runs/{run_id}|run {run_id[:8]}>")


def test_run_failure_sensor_falls_back_to_asset_selection_and_partition_tag(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALERT_WEBHOOK_ENV_VAR, webhook.secret_url)
    monkeypatch.delenv(UI_BASE_URL_ENV_VAR, raising=False)
    sensor = build_run_failure_alert_sensor()
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = tick(sensor, instance, None, alert_webhook_from_env())
        fail_a_run(instance, {}, partition_key="2024-01-02-03:00")
        tick(sensor, instance, cursor, alert_webhook_from_env())
    (got,) = webhook.posted
    assert got.body["table"] == "orders"
    assert got.body["partition"] == "2024-01-02-03:00"
    assert got.body["run_url"].startswith("http://localhost:3000/runs/")


def test_run_failure_sensor_without_webhook_is_a_no_op(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALERT_WEBHOOK_ENV_VAR, raising=False)
    resource = alert_webhook_from_env()
    assert resource.webhook_url is None
    sensor = build_run_failure_alert_sensor()
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = tick(sensor, instance, None, resource)
        fail_a_run(instance, {}, partition_key="2024-01-02-03:00")
        cursor = tick(sensor, instance, cursor, resource)
    assert webhook.posted == []
    assert cursor is not None and json.loads(cursor)["pending"] == []  # no webhook: no retries


def test_a_run_failure_alert_not_delivered_is_retried_on_the_next_tick(
    webhook: Webhook, capfd: pytest.CaptureFixture[str]
) -> None:
    """Item 3: a @run_failure_sensor's cursor moved past a run whose alert failed to post, so
    the alert was lost. Now it waits in the cursor; the next tick delivers it, once."""
    sensor = build_run_failure_alert_sensor()
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = tick(sensor, instance, None, resource)
        run_id = fail_a_run(instance, {"cdc_platform/table": "orders"}, "2024-01-02-03:00")
        webhook.status = 404
        sensor_logs(capfd)
        cursor = tick(sensor, instance, cursor, resource)  # does not raise: kept for later
        logged = sensor_logs(capfd)
        assert "alert not delivered (attempt 1, will retry)" in logged
        assert "HTTP 404" in logged
        assert_no_secret(logged)
        assert cursor is not None
        (kept,) = json.loads(cursor)["pending"]
        assert kept["attempts"] == 1 and kept["payload"]["run_id"] == run_id

        webhook.status = 200
        cursor = tick(sensor, instance, cursor, resource)
        assert cursor is not None and json.loads(cursor)["pending"] == []
        tick(sensor, instance, cursor, resource)
    # Tried twice (the 404, then delivered), the same alert; nothing more.
    assert [c.body["run_id"] for c in webhook.posted] == [run_id, run_id]
    assert webhook.posted[0].body == webhook.posted[1].body


def test_run_failure_sensor_goes_on_from_the_run_failure_sensors_cursor(
    webhook: Webhook,
) -> None:
    """The cursor a @run_failure_sensor left (Dagster's RunStatusSensorCursor) is read as the
    last event handled: the runs failed after it alert, after the upgrade."""
    sensor = build_run_failure_alert_sensor()
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    with dg.DagsterInstance.ephemeral() as instance:
        fail_a_run(instance, {}, partition_key="2024-01-02-01:00")
        (latest,) = instance.fetch_run_status_changes(
            dg.DagsterEventType.RUN_FAILURE, limit=1
        ).records
        old = json.dumps(
            {"__class__": "RunStatusSensorCursor", "record_id": latest.storage_id},
        )
        run_id = fail_a_run(instance, {}, partition_key="2024-01-02-02:00")
        tick(sensor, instance, old, resource)
    assert [c.body["run_id"] for c in webhook.posted] == [run_id]


def test_run_failure_sensor_leaves_other_code_locations_runs(webhook: Webhook) -> None:
    sensor = build_run_failure_alert_sensor()
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = tick(sensor, instance, None, resource, repository_name="elsewhere")
        fail_a_run(instance, {}, partition_key="2024-01-02-03:00")  # no code location
        cursor = tick(sensor, instance, cursor, resource, repository_name="elsewhere")
        assert webhook.posted == []
        everything = build_run_failure_alert_sensor(monitor_all_code_locations=True)
        fail_a_run(instance, {}, partition_key="2024-01-02-04:00")
        tick(everything, instance, cursor, resource, repository_name="elsewhere")
    assert [c.body["partition"] for c in webhook.posted] == ["2024-01-02-04:00"]


@dg.asset(name="checked")
def checked_asset() -> None:
    return None


@dg.asset_check(asset=checked_asset, blocking=True)
def always_fails() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, metadata={"failing_keys": 1})


def test_run_failure_sensor_skips_runs_failed_only_by_blocking_checks(webhook: Webhook) -> None:
    """A failed check alerts itself (check_failed); the run failing for it adds no run_failed."""
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_run_failure_alert_sensor()
    with dg.DagsterInstance.ephemeral() as instance:
        cursor = tick(sensor, instance, None, resource)
        result = dg.materialize(
            [checked_asset, always_fails], instance=instance, raise_on_error=False
        )
        assert not result.success
        cursor = tick(sensor, instance, cursor, resource)
    assert webhook.posted == []
    assert cursor is not None and json.loads(cursor)["pending"] == []


def test_ui_base_url_comes_from_the_environment(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 4: CDC_UI_BASE_URL (read through dg.EnvVar) is in every alert's link."""
    ui = "https://dagster.corp.example/prod/"
    monkeypatch.setenv(ALERT_WEBHOOK_ENV_VAR, webhook.secret_url)
    monkeypatch.setenv(UI_BASE_URL_ENV_VAR, ui)
    resource = alert_webhook_from_env()
    assert isinstance(resource.ui_base_url, dg.EnvVar)  # resolved when the sensor runs
    runs = build_run_failure_alert_sensor()
    checks = build_check_failure_alert_sensor([dg.AssetCheckKey(dg.AssetKey("checked"), "flaky")])
    with dg.DagsterInstance.ephemeral() as instance:
        run_cursor = tick(runs, instance, None, resource)
        check_cursor = tick(checks, instance, None, resource)
        FLAKY["passed"] = False
        check_run = dg.materialize([checked_asset, flaky], instance=instance).run_id
        failed_run = fail_a_run(instance, {}, partition_key="2024-01-02-03:00")
        tick(runs, instance, run_cursor, resource)
        tick(checks, instance, check_cursor, resource)
    links = {c.body["kind"]: c.body["run_url"] for c in webhook.posted}
    assert links == {
        "run_failed": f"https://dagster.corp.example/prod/runs/{failed_run}",
        "check_failed": f"https://dagster.corp.example/prod/runs/{check_run}",
    }
    for posted in webhook.posted:
        assert posted.body["text"].endswith(
            f"<{posted.body['run_url']}|run {posted.body['run_id'][:8]}>"
        )

    monkeypatch.delenv(UI_BASE_URL_ENV_VAR)
    unset = alert_webhook_from_env()  # no EnvVar naming an unset variable: ticks would fail
    assert unset.ui_base_url == "http://localhost:3000"


# --- the check alert sensor -------------------------------------------------------------------


def sensor_logs(capfd: pytest.CaptureFixture[str]) -> str:
    """What a sensor logged so far (Dagster's sensor logger writes to stderr)."""
    out, err = capfd.readouterr()
    return out + err


def closed_port_url() -> str:
    """A webhook URL nobody listens on (the port was bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{SECRET_PATH}?{SECRET_QUERY}"


def test_unreachable_webhook_never_loses_check_results(
    spark, lake, webhook: Webhook, capfd: pytest.CaptureFixture[str]
) -> None:
    """With the webhook down and one file set aside, all 9 results are recorded;
    the alert sensor logs the failed delivery (redacted), retries, and posts once it is up."""
    table = TableConfig(name="alerted", primary_key=("id",), start=START)
    platform = PlatformConfig(lake["landing"], lake["warehouse"], (table,))
    hour = START + timedelta(hours=5)
    write_parquet_events(lake["landing"], "alerted", hour, [ev("INSERT", 1, hour, 1, v="a")])
    bad = hour_folder(lake["landing"], "alerted", hour) / "part-bad.parquet"
    bad.write_bytes(b"not a parquet file")
    defs = build_table_definitions(platform, table)
    down = AlertWebhookResource(webhook_url=closed_port_url(), timeout_seconds=2)
    alerts = build_check_failure_alert_sensor(list(defs.checks.check_keys))
    assert alerts.name == CHECK_ALERT_SENSOR_NAME

    def alert_tick(instance, cursor: str | None, hook: AlertWebhookResource) -> str | None:
        context = dg.build_sensor_context(
            cursor=cursor, instance=instance, resources={"alert_webhook": hook}
        )
        return alerts.evaluate_tick(context).cursor

    with dg.instance_for_test() as instance:
        cursor = alert_tick(instance, None, down)  # first tick: the baseline
        result = dg.materialize(
            [defs.asset, defs.checks],
            partition_key=hour_to_partition_key(hour),
            instance=instance,
            resources=dagster_resources(alert_webhook=down),
            raise_on_error=False,
        )
        (mat,) = result.get_asset_materialization_events()
        assert mat.materialization.metadata["files_quarantined"].value == 1
        passed = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert passed == {name: name != invariants.NO_QUARANTINE for name in invariants.CHECK_NAMES}
        # Recorded in the instance too, not only in the run's result.
        records = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            list(defs.checks.check_keys)
        )
        recorded: dict[str, bool] = {}
        for k, r in records.items():
            assert r.event is not None and r.event.asset_check_evaluation is not None
            recorded[k.name] = r.event.asset_check_evaluation.passed
        assert recorded == passed
        # A set-aside file warns (WARN, not blocking): the run, and the rest of its hour, succeed.
        assert result.success
        (quarantined,) = [
            e
            for e in result.get_asset_check_evaluations()
            if e.check_name == invariants.NO_QUARANTINE
        ]
        assert quarantined.severity == dg.AssetCheckSeverity.WARN
        assert not quarantined.blocking
        assert quarantined.metadata["files"].value == [
            "alerted/year=2024/month=01/day=01/hour=05/part-bad.parquet"
        ]

        sensor_logs(capfd)
        cursor = alert_tick(instance, cursor, down)  # webhook down: logged, kept
        logged = sensor_logs(capfd)
        assert "alert not delivered (attempt 1, will retry)" in logged
        assert "could not reach alert webhook http://127.0.0.1:" in logged
        assert_no_secret(logged)
        assert cursor is not None and len(json.loads(cursor)["pending"]) == 1
        assert webhook.posted == []

        up = AlertWebhookResource(webhook_url=webhook.secret_url, ui_base_url="http://ui:3000")
        cursor = alert_tick(instance, cursor, up)
        (got,) = webhook.posted
        assert got.body["kind"] == "check_failed"
        assert got.body["check"] == invariants.NO_QUARANTINE
        assert got.body["table"] == "alerted"
        assert got.body["partition"] == hour_to_partition_key(hour)
        assert got.body["counts"]["failing_keys"] == 1
        assert got.body["severity"] == "WARN"
        assert got.body["files"] == ["alerted/year=2024/month=01/day=01/hour=05/part-bad.parquet"]
        assert got.body["text"].startswith(
            ":warning: cdc_platform: check `no_quarantined_files` failed on `alerted` (partition "
            f"{hour_to_partition_key(hour)}): 1 new file(s) set aside: "
            "`alerted/year=2024/month=01/day=01/hour=05/part-bad.parquet`. <"
        )
        assert [s["file"] for s in got.body["sample_keys"]] == got.body["files"]
        # The pending alert was built on the first tick, when the UI URL was the default.
        assert got.body["run_url"].endswith(f"/runs/{result.run_id}")
        assert cursor is not None and json.loads(cursor)["pending"] == []

        cursor = alert_tick(instance, cursor, up)  # nothing new: nothing posted twice
        assert len(webhook.posted) == 1

        # The hour again, the file still bad: the check fails again, the file is not news.
        again = dg.materialize(
            [defs.asset, defs.checks],
            partition_key=hour_to_partition_key(hour),
            instance=instance,
            resources=dagster_resources(alert_webhook=up),
        )
        assert {e.check_name for e in again.get_asset_check_evaluations() if not e.passed} == {
            invariants.NO_QUARANTINE
        }
        cursor = alert_tick(instance, cursor, up)
        assert len(webhook.posted) == 1


def test_undeliverable_alerts_are_retried_a_bounded_number_of_times(
    webhook: Webhook, capfd: pytest.CaptureFixture[str]
) -> None:
    webhook.status = 503
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_check_failure_alert_sensor([dg.AssetCheckKey(dg.AssetKey("checked"), "x")])
    cursor = json.dumps(
        {"v": 1, "checks": {}, "pending": [{"payload": {"text": "hi"}, "attempts": 0}]}
    )
    with dg.instance_for_test() as instance:
        for _ in range(MAX_DELIVERY_ATTEMPTS + 2):
            context = dg.build_sensor_context(
                cursor=cursor, instance=instance, resources={"alert_webhook": hook}
            )
            cursor = sensor.evaluate_tick(context).cursor
    assert len(webhook.posted) == MAX_DELIVERY_ATTEMPTS
    assert json.loads(cursor or "{}")["pending"] == []
    logged = sensor_logs(capfd)
    assert f"giving up on alert after {MAX_DELIVERY_ATTEMPTS} attempts" in logged
    assert_no_secret(logged)


FLAKY = {"passed": True}


@dg.asset_check(asset=checked_asset, blocking=False)
def flaky() -> dg.AssetCheckResult:
    """Passes or fails as FLAKY says (ERROR severity, like the invariants)."""
    passed = FLAKY["passed"]
    return dg.AssetCheckResult(
        passed=passed,
        metadata={"failing_keys": 0 if passed else 2, "sample": dg.MetadataValue.json([7, 8])},
    )


def test_a_check_failing_run_after_run_alerts_once_and_its_recovery_once(
    webhook: Webhook,
) -> None:
    """Item 2: three failing runs in a row are one check_failed; passing again is one
    check_recovered; failing again after that is news again."""
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_check_failure_alert_sensor([dg.AssetCheckKey(dg.AssetKey("checked"), "flaky")])

    def run(passed: bool) -> str:
        FLAKY["passed"] = passed
        return dg.materialize([checked_asset, flaky], instance=instance).run_id

    with dg.instance_for_test() as instance:
        cursor = tick(sensor, instance, None, hook)
        runs = []
        for passed in (False, False, False, True, True, False):
            runs.append(run(passed))
            cursor = tick(sensor, instance, cursor, hook)
        assert cursor is not None
        assert json.loads(cursor)["failing"] == {"checked:flaky": {"n": 2}}
        # Several runs between two ticks: the changes among them, in order.
        for passed in (True, False, False):
            runs.append(run(passed))
        tick(sensor, instance, cursor, hook)
    got = [(c.body["kind"], c.body["run_id"]) for c in webhook.posted]
    assert got == [
        ("check_failed", runs[0]),
        ("check_recovered", runs[3]),
        ("check_failed", runs[5]),
        ("check_recovered", runs[6]),
        ("check_failed", runs[7]),
    ]
    failed, recovered = webhook.posted[0].body, webhook.posted[1].body
    assert failed["severity"] == "ERROR" and failed["counts"] == {"failing_keys": 2}
    assert failed["sample_keys"] == [7, 8]
    assert failed["text"].startswith(
        ":rotating_light: cdc_platform: check `flaky` failed on `checked`: 2 failing keys. <"
    )
    assert recovered["severity"] == "ERROR" and recovered["sample_keys"] == []
    assert recovered["text"] == (
        ":white_check_mark: cdc_platform: check `flaky` passes again on `checked`. "
        f"<http://localhost:3000/runs/{runs[3]}|run {runs[3][:8]}>"
    )


SET_ASIDE: dict[str, Any] = {"files": [], "count": None}


@dg.asset_check(asset=checked_asset, name=invariants.NO_QUARANTINE, blocking=False)
def set_aside() -> dg.AssetCheckResult:
    """Like the platform's no_quarantined_files: WARN, the files in its metadata."""
    files = list(SET_ASIDE["files"])
    count = SET_ASIDE["count"] if SET_ASIDE["count"] is not None else len(files)
    return dg.AssetCheckResult(
        passed=not count,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "failing_keys": count,
            "sample": dg.MetadataValue.json([{"file": f, "reason": "not Parquet"} for f in files]),
            "files": dg.MetadataValue.json(files),
        },
    )


def test_a_set_aside_file_is_named_once(webhook: Webhook) -> None:
    """Item 2: no_quarantined_files alerts (WARN) when a file joins the set aside, naming the
    new files only; not again for the same files; once when the set is empty again."""
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    key = dg.AssetCheckKey(dg.AssetKey("checked"), invariants.NO_QUARANTINE)
    sensor = build_check_failure_alert_sensor([key])
    with dg.instance_for_test() as instance:
        cursor = tick(sensor, instance, None, hook)
        for files, count in (
            (["t/h=1/a.parquet"], None),
            (["t/h=1/a.parquet"], None),
            (["t/h=1/a.parquet", "t/h=2/b<1>.parquet"], None),
            (["t/h=2/b<1>.parquet"], None),  # a was dealt with
            ([], None),
            (["t/h=1/a.parquet"], None),  # back: news again
            (["t/h=1/a.parquet"], 4),  # more set aside than the check lists: news too
            (["t/h=1/a.parquet"], 4),
        ):
            SET_ASIDE.update(files=files, count=count)
            assert dg.materialize([checked_asset, set_aside], instance=instance).success
            cursor = tick(sensor, instance, cursor, hook)
    got = [(c.body["kind"], c.body.get("files")) for c in webhook.posted]
    assert got == [
        ("check_failed", ["t/h=1/a.parquet"]),
        ("check_failed", ["t/h=2/b<1>.parquet"]),
        ("check_recovered", None),
        ("check_failed", ["t/h=1/a.parquet"]),
        ("check_failed", []),
    ]
    assert {c.body["severity"] for c in webhook.posted} == {"WARN"}
    first, second = webhook.posted[0].body, webhook.posted[1].body
    assert first["text"].startswith(
        ":warning: cdc_platform: check `no_quarantined_files` failed on `checked`: "
        "1 new file(s) set aside: `t/h=1/a.parquet`. <"
    )
    assert "`t/h=2/b&lt;1&gt;.parquet`" in second["text"]
    assert second["sample_keys"] == [{"file": "t/h=2/b<1>.parquet", "reason": "not Parquet"}]
    assert webhook.posted[4].body["counts"] == {"failing_keys": 4}
    assert (
        webhook.posted[4]
        .body["text"]
        .startswith(
            ":warning: cdc_platform: check `no_quarantined_files` failed on `checked`: 4 failing keys."
        )
    )


# --- the cost of a tick ------------------------------------------------------------------------

TABLES_AT_SCALE = 500
SCALE_FAILING: set[str] = set()  # check names failing in the next run


def table_with_checks(table: str) -> tuple[dg.AssetsDefinition, dg.AssetChecksDefinition]:
    """A table asset and its ten invariant checks (results as SCALE_FAILING says; no Spark)."""

    @dg.asset(name=table)
    def history() -> None:
        return None

    @dg.multi_asset_check(
        specs=[dg.AssetCheckSpec(n, asset=table) for n in invariants.CHECK_NAMES],
        name=f"{table}_invariants",
    )
    def checks() -> Iterable[dg.AssetCheckResult]:
        for name in invariants.CHECK_NAMES:
            failing = name in SCALE_FAILING
            yield dg.AssetCheckResult(
                asset_key=dg.AssetKey(table),
                check_name=name,
                passed=not failing,
                metadata={"failing_keys": int(failing)},
            )

    return history, checks


def scale_keys(tables: int) -> list[dg.AssetCheckKey]:
    return [
        dg.AssetCheckKey(dg.AssetKey(f"t{i:04d}"), name)
        for i in range(tables)
        for name in invariants.CHECK_NAMES
    ]


class EventLogQueries:
    """Counts what a tick asks the event log: calls of the event log storage's methods, and the
    SQL statements run on its tables (whatever engine or shard runs them)."""

    TABLES = ("event_logs", "asset_check_executions", "asset_keys", "asset_event_tags")

    def __init__(self, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        self.statements: list[str] = []
        self.counting = False
        self.depth = 0
        storage = instance.event_log_storage
        for name in dir(type(storage)):
            if name.startswith("_") or not callable(getattr(type(storage), name, None)):
                continue
            monkeypatch.setattr(storage, name, self._counted(name, getattr(storage, name)))

        def statement(conn, cursor, sql, parameters, context, executemany) -> None:
            if self.counting and any(t in str(sql) for t in self.TABLES):
                self.statements.append(str(sql))

        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", statement)
        self._listener = statement

    def _counted(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting and not self.depth:  # not the storage's calls of its own methods
                self.calls.append(name)
            self.depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def during(self, fn: Callable[[], Any]) -> tuple[list[str], list[str]]:
        """(storage calls, SQL statements on event tables) while ``fn`` runs."""
        self.calls, self.statements, self.counting = [], [], True
        try:
            fn()
        finally:
            self.counting = False
        return self.calls, self.statements

    def close(self) -> None:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", self._listener)


def test_one_event_log_query_a_tick_at_500_tables(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1: the check alert sensor's tick asks the event log once, for 500 tables x 10 checks
    as for 10 checks (it used to read each check's history: 5,000 queries a tick)."""
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    keys = scale_keys(TABLES_AT_SCALE)
    assert len(keys) == 5000
    at_scale = build_check_failure_alert_sensor(keys)
    one_table = build_check_failure_alert_sensor(scale_keys(1))
    t0, t0_checks = table_with_checks("t0000")
    t1, t1_checks = table_with_checks("t0499")
    with dg.instance_for_test() as instance:
        queries = EventLogQueries(instance, monkeypatch)
        try:
            cursors = {
                "scale": tick(at_scale, instance, None, hook),
                "one": tick(one_table, instance, None, hook),
            }
            SCALE_FAILING.clear()
            SCALE_FAILING.update({invariants.NO_OVERLAP, invariants.MATCHES_CHANGELOG})
            dg.materialize([t0, t0_checks, t1, t1_checks], instance=instance)
            # Another code location's check: read with the rest, left alone.
            dg.materialize([checked_asset, always_fails], instance=instance, raise_on_error=False)
            measured: dict[str, tuple[list[str], list[str]]] = {}
            for name, sensor in (("scale", at_scale), ("one", one_table)):

                def one_tick(name: str = name, sensor: dg.SensorDefinition = sensor) -> None:
                    cursors[name] = tick(sensor, instance, cursors[name], hook)

                measured[name] = queries.during(one_tick)
                measured[f"{name} quiet"] = queries.during(one_tick)  # nothing new
        finally:
            queries.close()
    for name, (calls, statements) in measured.items():
        assert calls == ["get_logs_for_all_runs_by_log_id"], (name, calls)
        assert len(statements) == 1, (name, statements)
    # Two tables' two failing checks from the scale sensor; t0000's two from the other.
    alerts = [(c.body["table"], c.body["check"]) for c in webhook.posted]
    assert sorted(alerts) == sorted(
        [(t, c) for t in ("t0000", "t0499") for c in SCALE_FAILING]
        + [("t0000", c) for c in SCALE_FAILING]
    )
    state = json.loads(cursors["scale"] or "{}")
    assert sorted(state["failing"]) == sorted(
        f"{t}:{c}" for t in ("t0000", "t0499") for c in SCALE_FAILING
    )


def test_more_evaluations_than_a_page_are_read_page_by_page(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst larger than a page is read in pages, at most CHECK_EVENT_PAGES a tick, the rest
    on the next tick; every change alerts once."""
    monkeypatch.setattr(check_alerts, "CHECK_EVENT_PAGE", 4)
    monkeypatch.setattr(check_alerts, "CHECK_EVENT_PAGES", 2)
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_check_failure_alert_sensor(scale_keys(1))
    asset, checks = table_with_checks("t0000")
    with dg.instance_for_test() as instance:
        queries = EventLogQueries(instance, monkeypatch)
        try:
            cursor = tick(sensor, instance, None, hook)
            SCALE_FAILING.clear()
            SCALE_FAILING.update(invariants.CHECK_NAMES)  # 10 evaluations, all failing
            dg.materialize([asset, checks], instance=instance)

            def one_tick() -> None:
                nonlocal cursor
                cursor = tick(sensor, instance, cursor, hook)

            first, _ = queries.during(one_tick)
            assert first == ["get_logs_for_all_runs_by_log_id"] * 2  # 4 + 4 read
            assert len(webhook.posted) == 8
            second, _ = queries.during(one_tick)
            assert second == ["get_logs_for_all_runs_by_log_id"]  # the last 2
        finally:
            queries.close()
    assert sorted(c.body["check"] for c in webhook.posted) == sorted(invariants.CHECK_NAMES)


def test_a_check_alert_cursor_of_the_previous_version_keeps_its_pending_alerts(
    webhook: Webhook,
) -> None:
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_check_failure_alert_sensor([dg.AssetCheckKey(dg.AssetKey("checked"), "flaky")])
    old = json.dumps(
        {
            "v": 1,
            "checks": {"checked:flaky": {"low": 0, "seen": [3]}},
            "pending": [{"payload": {"text": "from before"}, "attempts": 2}],
        }
    )
    with dg.instance_for_test() as instance:
        cursor = tick(sensor, instance, old, hook)
    assert [c.body for c in webhook.posted] == [{"text": "from before"}]
    state = json.loads(cursor or "{}")
    assert state["v"] == 2 and state["pending"] == [] and isinstance(state["after"], int)


def test_delivery_stops_at_the_tick_budget_and_goes_on_next_tick(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow webhook cannot hold a tick past Dagster's sensor timeout: once the budget is
    spent, the rest wait untried (their attempts not counted)."""
    monkeypatch.setattr(alerts_module, "DELIVERY_BUDGET_SECONDS", 0.0)
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    sensor = build_check_failure_alert_sensor([dg.AssetCheckKey(dg.AssetKey("checked"), "x")])
    pending = [{"payload": {"text": f"alert {i}"}, "attempts": 0} for i in range(3)]
    cursor = json.dumps({"v": 2, "after": 0, "failing": {}, "pending": pending})
    with dg.instance_for_test() as instance:
        cursor = tick(sensor, instance, cursor, hook)
        assert webhook.posted == []
        assert json.loads(cursor or "{}")["pending"] == pending
        monkeypatch.setattr(alerts_module, "DELIVERY_BUDGET_SECONDS", 20.0)
        cursor = tick(sensor, instance, cursor, hook)
    assert [c.body["text"] for c in webhook.posted] == ["alert 0", "alert 1", "alert 2"]
