"""Alerts against a real HTTP server on loopback: payloads, delivery, redaction, the failure sensor."""

import json
import logging
import socket

import dagster as dg
import pytest

from cdc_platform.defs.alerts import (
    ALERT_WEBHOOK_ENV_VAR,
    RUN_FAILURE_SENSOR_NAME,
    AlertWebhookResource,
    alert_webhook_from_env,
    build_run_failure_alert_sensor,
)
from cdc_platform.lib.alerts import AlertDeliveryError, build_alert, post_alert, redact_url
from cdc_platform_tests.webhook import SECRET_PATH, SECRET_QUERY, Webhook


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
    instance: dg.DagsterInstance, tags: dict[str, str], resource: AlertWebhookResource, **kw: str
) -> dg.RunStatusSensorContext:
    result = dg.materialize(
        [failing_orders], instance=instance, tags=tags, raise_on_error=False, **kw
    )
    assert not result.success
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.status == dg.DagsterRunStatus.FAILURE
    (record,) = instance.get_records_for_run(
        run_id=run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE
    ).records
    return dg.build_run_status_sensor_context(
        sensor_name=RUN_FAILURE_SENSOR_NAME,
        dagster_event=record.event_log_entry.dagster_event,
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
        (record,) = instance.get_records_for_run(
            run_id=result.run_id, of_type=dg.DagsterEventType.RUN_FAILURE
        ).records
        context = dg.build_run_status_sensor_context(
            sensor_name=RUN_FAILURE_SENSOR_NAME,
            dagster_event=record.event_log_entry.dagster_event,
            dagster_instance=instance,
            dagster_run=run,
            resources={"alert_webhook": resource},
        )
        build_run_failure_alert_sensor()(context)
    assert webhook.posted == []
