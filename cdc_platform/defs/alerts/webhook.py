"""Alerting in Dagster: the webhook resource and the delivery every alert sensor shares (the
sensors: ``defs.alerts.checks`` for check state changes, ``defs.alerts.runs`` for failed runs,
``defs.alerts.sources`` for sources).

The payloads come from :mod:`cdc_platform.lib.fleet.alerts`. With no webhook configured, alerts are
logged and dropped, so a laptop or CI setup needs no secret. Bind the resource under the key
``alert_webhook`` (see :func:`alert_webhook_from_env`).

Checks and runs never send anything themselves: a check's result or a run's failure is
recorded whatever happens to a notification. Each sensor reads what the instance recorded since
its cursor (a storage id in the event log: one query a tick, whatever the number of tables),
queues the alerts in its cursor and posts them; a delivery failure is logged (URL redacted) and
retried on later ticks, a bounded number of times.
"""

import os
import time
from collections.abc import Mapping
from typing import Any

import dagster as dg

from cdc_platform.defs.tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from cdc_platform.lib.fleet.alerts import (
    AlertDeliveryError,
    post_alert,
    redact_url,
)

ALERT_WEBHOOK_ENV_VAR = "CDC_ALERT_WEBHOOK_URL"
UI_BASE_URL_ENV_VAR = "CDC_UI_BASE_URL"
DEFAULT_UI_BASE_URL = "http://localhost:3000"
ALERT_RESOURCE_KEY = "alert_webhook"
# An undeliverable alert is tried on this many ticks in all, then dropped with an error log.
MAX_DELIVERY_ATTEMPTS = 5
# At most this many undelivered alerts wait in a cursor (the oldest are dropped first).
MAX_PENDING_ALERTS = 100
# Seconds a tick spends delivering: the rest wait for the next tick, their attempts not counted
# (a webhook that hangs would otherwise hold the tick past Dagster's sensor timeout).
DELIVERY_BUDGET_SECONDS = 20.0

# How often the alert sensors read what the instance recorded. Each evaluation costs the code
# server a fresh instance and the daemon a tick record, whatever the fleet's size (the idle
# figures in benchmarks/fleet.py); for hourly data an alert up to a minute later loses nothing.
ALERT_INTERVAL_SECONDS = 60


class AlertWebhookResource(dg.ConfigurableResource):
    """Posts alert payloads to a Slack-compatible incoming webhook (no-op without a URL)."""

    webhook_url: str | None = None
    ui_base_url: str = DEFAULT_UI_BASE_URL
    timeout_seconds: float = 10.0

    def send(self, payload: dict[str, Any]) -> bool:
        """True when posted; False when no webhook is configured. Raises AlertDeliveryError."""
        log = dg.get_dagster_logger()
        if not self.webhook_url:
            log.warning(
                f"no alert webhook configured ({ALERT_WEBHOOK_ENV_VAR}); alert not sent: {payload.get('text')}"
            )
            return False
        post_alert(self.webhook_url, payload, timeout=self.timeout_seconds)
        log.info(f"alert sent to {redact_url(self.webhook_url)}: {payload.get('text')}")
        return True


def alert_webhook_from_env(ui_base_url: str = DEFAULT_UI_BASE_URL) -> AlertWebhookResource:
    """The resource wired to ``CDC_ALERT_WEBHOOK_URL`` and ``CDC_UI_BASE_URL`` via ``dg.EnvVar``.

    Dagster fails any run or sensor tick that uses an ``EnvVar`` naming an unset variable, so an
    EnvVar is only used when its variable is set: otherwise alerts are a logged no-op (no
    webhook), and their links point at ``ui_base_url`` (no UI address).
    """
    settings: dict[str, Any] = {"ui_base_url": ui_base_url}
    if os.environ.get(ALERT_WEBHOOK_ENV_VAR):
        settings["webhook_url"] = dg.EnvVar(ALERT_WEBHOOK_ENV_VAR)
    if os.environ.get(UI_BASE_URL_ENV_VAR):
        settings["ui_base_url"] = dg.EnvVar(UI_BASE_URL_ENV_VAR)
    return AlertWebhookResource(**settings)


# --- delivery ---------------------------------------------------------------------------------


def deliver(
    context: dg.SensorEvaluationContext,
    alert_webhook: AlertWebhookResource,
    pending: list[dict[str, Any]],
    budget_seconds: float | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Try the pending alerts once each, oldest first; return (still pending, number delivered).

    ``pending`` holds ``{"payload": ..., "attempts": n}`` items, as a sensor cursor keeps them.
    A delivery error never raises: the alert stays pending (logged, URL redacted) until it has
    been tried ``MAX_DELIVERY_ATTEMPTS`` times. Once ``budget_seconds`` are spent, the rest wait
    for the next tick untried (default ``DELIVERY_BUDGET_SECONDS``). At most
    ``MAX_PENDING_ALERTS`` are kept.
    """
    left: list[dict[str, Any]] = []
    delivered = 0
    if budget_seconds is None:
        budget_seconds = DELIVERY_BUDGET_SECONDS
    deadline = time.monotonic() + budget_seconds
    for index, item in enumerate(pending):
        if time.monotonic() >= deadline:
            context.log.warning(
                f"{len(pending) - index} alert(s) left for the next tick (delivery took "
                f"{budget_seconds:g}s this tick)"
            )
            left.extend(pending[index:])
            break
        payload, attempts = item["payload"], int(item["attempts"]) + 1
        try:
            sent = alert_webhook.send(payload)
        except AlertDeliveryError as exc:  # its message is redacted already
            if attempts >= MAX_DELIVERY_ATTEMPTS:
                context.log.error(
                    f"giving up on alert after {attempts} attempts: {exc}; "
                    f"alert was: {payload.get('text')}"
                )
            else:
                context.log.warning(f"alert not delivered (attempt {attempts}, will retry): {exc}")
                left.append({"payload": payload, "attempts": attempts})
            continue
        delivered += int(sent)
    if len(left) > MAX_PENDING_ALERTS:
        dropped = left[: len(left) - MAX_PENDING_ALERTS]
        context.log.error(f"dropping {len(dropped)} undelivered alert(s): too many pending")
        left = left[-MAX_PENDING_ALERTS:]
    return left, delivered


def queued(payload: dict[str, Any]) -> dict[str, Any]:
    return {"payload": payload, "attempts": 0}


# --- shared by the run and check sensors -----------------------------------------------------


def partition_for_run(tags: Mapping[str, str]) -> str | None:
    """``dagster/partition``, or ``start..end`` for a single-run partition range."""
    if tags.get(PARTITION_TAG):
        return tags[PARTITION_TAG]
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    if start and end:
        return start if start == end else f"{start}..{end}"
    return None


def root_error(error: Any) -> Any:
    """The innermost cause of a serialised error: the user's exception, not Dagster's wrapper."""
    while getattr(error, "cause", None) is not None:
        error = error.cause
    return error


def root_message(error: Any) -> str:
    error = root_error(error)
    cls_name = getattr(error, "cls_name", None)
    message = (getattr(error, "message", "") or "").strip()
    return f"{cls_name}: {message}" if cls_name and not message.startswith(cls_name) else message


def metadata_int(value: object) -> int:
    """``int()`` of a number a check or materialization recorded as metadata (a TypeError else)."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"metadata value is not a number: {type(value).__name__}")
