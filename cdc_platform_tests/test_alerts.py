"""Alerts against a real HTTP server on loopback: payloads, delivery, redaction, the failure sensor."""

import json
import logging
import socket
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest

from cdc_platform.defs.alerts import (
    ALERT_WEBHOOK_ENV_VAR,
    CHECK_ALERT_SENSOR_NAME,
    MAX_DELIVERY_ATTEMPTS,
    RUN_FAILURE_SENSOR_NAME,
    AlertWebhookResource,
    alert_webhook_from_env,
    build_check_failure_alert_sensor,
    build_run_failure_alert_sensor,
)
from cdc_platform.defs.factory import build_table_definitions
from cdc_platform.lib import invariants
from cdc_platform.lib.alerts import AlertDeliveryError, build_alert, post_alert, redact_url
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.landing import hour_folder, hour_to_partition_key
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


def failed_run_context(
    instance: dg.DagsterInstance,
    tags: dict[str, str],
    resource: AlertWebhookResource,
    partition_key: str | None = None,
) -> dg.RunStatusSensorContext:
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
    (record,) = instance.get_records_for_run(
        run_id=run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE
    ).records
    event = record.event_log_entry.dagster_event
    assert event is not None  # a RUN_FAILURE record is a Dagster event
    return dg.build_run_status_sensor_context(
        sensor_name=RUN_FAILURE_SENSOR_NAME,
        dagster_event=event,
        dagster_instance=instance,
        dagster_run=run,
        resources={"alert_webhook": resource},
    )


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
        context = failed_run_context(instance, tags, resource)
        sensor(context)
        run_id = context.dagster_run.run_id

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
    sensor = build_run_failure_alert_sensor()
    with dg.DagsterInstance.ephemeral() as instance:
        context = failed_run_context(
            instance, {}, alert_webhook_from_env(), partition_key="2024-01-02-03:00"
        )
        sensor(context)
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
    with dg.DagsterInstance.ephemeral() as instance:
        context = failed_run_context(instance, {}, resource, partition_key="2024-01-02-03:00")
        build_run_failure_alert_sensor()(context)
    assert webhook.posted == []


def test_run_failure_sensor_delivery_error_is_redacted(webhook: Webhook) -> None:
    webhook.status = 404
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    with dg.DagsterInstance.ephemeral() as instance:
        context = failed_run_context(instance, {}, resource, partition_key="2024-01-02-03:00")
        with pytest.raises(AlertDeliveryError, match="HTTP 404") as info:
            build_run_failure_alert_sensor()(context)
    assert_no_secret(str(info.value))


@dg.asset(name="checked")
def checked_asset() -> None:
    return None


@dg.asset_check(asset=checked_asset, blocking=True)
def always_fails() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, metadata={"failing_keys": 1})


def test_run_failure_sensor_skips_runs_failed_only_by_blocking_checks(webhook: Webhook) -> None:
    """A failed check alerts itself (check_failed); the run failing for it adds no run_failed."""
    resource = AlertWebhookResource(webhook_url=webhook.secret_url)
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize(
            [checked_asset, always_fails], instance=instance, raise_on_error=False
        )
        assert not result.success
        run = instance.get_run_by_id(result.run_id)
        assert run is not None
        (record,) = instance.get_records_for_run(
            run_id=result.run_id, of_type=dg.DagsterEventType.RUN_FAILURE
        ).records
        event = record.event_log_entry.dagster_event
        assert event is not None  # a RUN_FAILURE record is a Dagster event
        context = dg.build_run_status_sensor_context(
            sensor_name=RUN_FAILURE_SENSOR_NAME,
            dagster_event=event,
            dagster_instance=instance,
            dagster_run=run,
            resources={"alert_webhook": resource},
        )
        build_run_failure_alert_sensor()(context)
    assert webhook.posted == []


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
    """Issue 7, item 1: with the webhook down and one file set aside, all 9 results are recorded;
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
        assert not result.success  # the blocking check failed the run, as it should

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
        # The pending alert was built on the first tick, when the UI URL was the default.
        assert got.body["run_url"].endswith(f"/runs/{result.run_id}")
        assert cursor is not None and json.loads(cursor)["pending"] == []

        alert_tick(instance, cursor, up)  # nothing new: nothing posted twice
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


def test_check_alert_sensor_alerts_only_new_failures(webhook: Webhook) -> None:
    """First tick: a baseline (old failures are history). Then one alert per new failure."""
    hook = AlertWebhookResource(webhook_url=webhook.secret_url)
    key = dg.AssetCheckKey(dg.AssetKey("checked"), "always_fails")
    sensor = build_check_failure_alert_sensor([key])

    def run_and_tick(instance, cursor: str | None) -> str | None:
        dg.materialize([checked_asset, always_fails], instance=instance, raise_on_error=False)
        context = dg.build_sensor_context(
            cursor=cursor, instance=instance, resources={"alert_webhook": hook}
        )
        return sensor.evaluate_tick(context).cursor

    with dg.instance_for_test() as instance:
        cursor = run_and_tick(instance, None)
        assert webhook.posted == []
        cursor = run_and_tick(instance, cursor)
        cursor = run_and_tick(instance, cursor)
    assert [(c.body["check"], c.body["counts"]) for c in webhook.posted] == [
        ("always_fails", {"failing_keys": 1}),
        ("always_fails", {"failing_keys": 1}),
    ]
    assert len({c.body["run_id"] for c in webhook.posted}) == 2
