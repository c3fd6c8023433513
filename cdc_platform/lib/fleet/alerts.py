"""Alert payloads for a Slack-compatible incoming webhook, and posting them with the stdlib.

Slack (and Mattermost, Teams' Slack-compatible endpoint, most chat bridges) render the ``text``
field; the other fields are there for machines and for webhooks that template their own message.
Webhook URLs embed their credential in the path or query, so they never appear in exceptions or
logs: only ``scheme://host/…`` does (see :func:`redact_url`).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from email.message import Message
from typing import IO, Any, Literal, get_args

from cdc_platform.lib.errors import PlatformError

AlertKind = Literal["check_failed", "check_recovered", "run_failed"]
# build_alert's kinds; new_table_alert's own:
KINDS: tuple[str, ...] = ("check_failed", "check_recovered", "run_failed")
NEW_TABLE_KIND = "new_table"
# source_alert's kinds: each problem, then its recovery (defs.alerts.sources).
SourceAlertKind = Literal[
    "source_stale",
    "source_fresh",
    "hours_unapplied",
    "hours_applied",
    "sensor_failing",
    "sensor_recovered",
]
SOURCE_KINDS: tuple[str, ...] = get_args(SourceAlertKind)
_SOURCE_HEADS = {
    "source_stale": ":hourglass: cdc_platform: {what} is stale",
    "source_fresh": ":white_check_mark: cdc_platform: {what} is fresh again",
    "hours_unapplied": ":rotating_light: cdc_platform: {what} has landed hours not applied",
    "hours_applied": ":white_check_mark: cdc_platform: {what} has every landed hour applied",
    "sensor_failing": ":rotating_light: cdc_platform: sensor {what} keeps failing",
    "sensor_recovered": ":white_check_mark: cdc_platform: sensor {what} ticks again",
}
SEVERITIES = ("ERROR", "WARN")

MAX_DETAIL_CHARS = 500
MAX_SAMPLE_KEYS = 10
MAX_FILES = 100  # files a check_failed alert lists (set aside since the last alert)
_FILES_IN_TEXT = 5
MAX_COLUMNS = 500  # columns listed in a new_table alert (a wider table says how many more)
MAX_SNIPPET_CHARS = 20_000
_COLUMNS_IN_TEXT = 12
_MAX_BODY_CHARS = 200


class AlertDeliveryError(PlatformError, RuntimeError):
    """The webhook could not be reached or did not answer 2xx; the message holds no secret."""


def redact_url(url: str) -> str:
    """``https://hooks.slack.com/services/T0/B0/XYZ?x=1`` -> ``https://hooks.slack.com/…``."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<invalid url>"
    return f"{parts.scheme or '?'}://{host}{port}/…"


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _json_safe(value: Any) -> Any:
    """Sample keys can be tuples (composite keys), dates or decimals: make them JSON values."""
    return json.loads(json.dumps(value, default=str))


def _counts_phrase(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in counts.items())


def _slack_escape(text: str) -> str:
    """Slack treats <, > and & as markup; an exception message must not become a link."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def build_alert(
    kind: AlertKind,
    table: str,
    partition: str | None,
    check: str | None,
    counts: Mapping[str, int],
    run_id: str,
    ui_base_url: str,
    detail: str,
    sample_keys: list | None = None,
    *,
    severity: str | None = None,
    files: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A Slack-compatible payload: one readable ``text`` line plus structured fields.

    ``check_failed`` and ``check_recovered`` carry the check's ``severity`` (``ERROR`` or
    ``WARN``); ``files`` (a ``check_failed`` of ``no_quarantined_files``): the files newly set
    aside, which the text names (the first few) instead of the counts.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown alert kind {kind!r}; expected one of {list(KINDS)}")
    if severity is not None and severity not in SEVERITIES:
        raise ValueError(f"unknown severity {severity!r}; expected one of {list(SEVERITIES)}")
    run_url = f"{ui_base_url.rstrip('/')}/runs/{run_id}"
    where = f"`{table}`" + (f" (partition {partition})" if partition else "")
    summary = _counts_phrase(counts)
    short_detail = _one_line(detail, MAX_DETAIL_CHARS) if detail else ""
    listed = list(files or [])[:MAX_FILES]
    if kind == "check_failed":
        icon = ":warning:" if severity == "WARN" else ":rotating_light:"
        head = f"{icon} cdc_platform: check `{check or '?'}` failed on {where}"
        what = _files_phrase(listed, len(files or [])) if listed else summary or short_detail
    elif kind == "check_recovered":
        head = f":white_check_mark: cdc_platform: check `{check or '?'}` passes again on {where}"
        what = ""
    else:
        head = f":x: cdc_platform: run failed for {where}"
        what = short_detail or summary
    link = f"<{run_url}|run {run_id[:8]}>"
    what = _slack_escape(what.rstrip(". "))
    text = f"{head}: {what}. {link}" if what else f"{head}. {link}"
    samples = list(sample_keys or [])
    payload = {
        "text": text,
        "kind": kind,
        "table": table,
        "partition": partition,
        "check": check,
        "counts": {str(k): int(v) for k, v in counts.items()},
        "run_id": run_id,
        "run_url": run_url,
        "detail": short_detail,
        "sample_keys": _json_safe(samples[:MAX_SAMPLE_KEYS]),
    }
    if severity is not None:
        payload["severity"] = severity
    if files is not None:
        payload["files"] = [str(f) for f in listed]
    return payload


def _files_phrase(files: list[str], total: int) -> str:
    named = ", ".join(f"`{_one_line(f, 300)}`" for f in files[:_FILES_IN_TEXT])
    more = total - min(len(files), _FILES_IN_TEXT)
    return f"{total} new file(s) set aside: {named}" + (f" and {more} more" if more else "")


def source_alert(
    kind: SourceAlertKind,
    subject: str,
    detail: str,
    url: str,
    *,
    severity: str = "ERROR",
    table: str | None = None,
    counts: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """A payload for what no run reports: a source gone quiet, hours that stay unapplied, a
    sensor whose ticks fail. ``subject`` is the table or sensor; ``url`` its page in the UI."""
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown alert kind {kind!r}; expected one of {list(SOURCE_KINDS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"unknown severity {severity!r}; expected one of {list(SEVERITIES)}")
    head = _SOURCE_HEADS[kind].format(what=f"`{_one_line(subject, 300)}`")
    short = _one_line(detail, MAX_DETAIL_CHARS).rstrip(". ") if detail else ""
    what = f"{head}: {_slack_escape(short)}." if short else f"{head}."
    return {
        "text": f"{what} <{url}|open>",
        "kind": kind,
        "severity": severity,
        "table": table,
        "subject": subject,
        "counts": {str(k): int(v) for k, v in (counts or {}).items()},
        "detail": short,
        "url": url,
    }


_DIGEST_NAMED = 10  # subjects a digest's text names (its ``subjects`` field: MAX_FILES)


def source_digest(alerts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One payload for many ``source_alert`` payloads of one kind (a cause the fleet shares:
    every landing sensor failing on one unmounted root). Its text names the first subjects
    and gives the first one's detail; ``subjects`` lists them."""
    first = alerts[0]
    subjects = [str(a["subject"]) for a in alerts]
    named = ", ".join(f"`{_one_line(n, 100)}`" for n in subjects[:_DIGEST_NAMED])
    more = len(subjects) - min(len(subjects), _DIGEST_NAMED)
    icon = _SOURCE_HEADS[str(first["kind"])].split()[0]
    head = f"{icon} cdc_platform: {len(subjects)} `{first['kind']}` alerts at once: {named}"
    head += f" and {more} more" if more else ""
    detail = str(first.get("detail") or "")
    text = f"{head}; the first: {_slack_escape(detail)}." if detail else f"{head}."
    severe = any(a.get("severity") == "ERROR" for a in alerts)
    return {
        "text": f"{text} <{first['url']}|open>",
        "kind": first["kind"],
        "severity": "ERROR" if severe else "WARN",
        "table": None,
        "subject": f"{len(subjects)} {first['kind']}",
        "subjects": subjects[:MAX_FILES],
        "counts": {"subjects": len(subjects)},
        "detail": detail,
        "url": first["url"],
    }


def new_table_alert(
    table: str,
    columns: list[tuple[str, str]],
    primary_key: list[str],
    first_hour: str,
    sample_file: str,
    snippet: str,
    status: str,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """A ``new_table`` payload: a table folder the config does not list.

    ``status`` says what happens next (an asset was created from ``discover:``, or the entry is
    to be pasted); ``snippet`` is the ``tables:`` entry to paste. Only names from the landing
    zone and the file's schema: no URL, key or cell value.
    """
    listed = ", ".join(f"{c} {t}" for c, t in columns[:_COLUMNS_IN_TEXT])
    if len(columns) > _COLUMNS_IN_TEXT:
        listed += f", … ({len(columns) - _COLUMNS_IN_TEXT} more)"
    shape = f"{len(columns)} column(s): {listed}" if columns else "columns unknown"
    head = (
        f":new: cdc_platform: new table folder `{table}` in the landing zone, not in the config"
        f" (first hour {first_hour}; {shape})"
    )
    short_status = _one_line(status, MAX_DETAIL_CHARS).rstrip(". ")
    snippet = snippet if len(snippet) <= MAX_SNIPPET_CHARS else snippet[:MAX_SNIPPET_CHARS] + "…\n"
    text = (
        f"{_slack_escape(head)}: {_slack_escape(short_status)}.\n```\n{_slack_escape(snippet)}```"
    )
    return {
        "text": text,
        "kind": NEW_TABLE_KIND,
        "table": table,
        "columns": [{"name": c, "type": t} for c, t in columns[:MAX_COLUMNS]],
        "column_count": len(columns),
        "primary_key_guess": list(primary_key),
        "keyless_guess": not primary_key,  # no id-like column: `keyless: true` proposed
        "first_hour": first_hour,
        "sample_file": sample_file,
        "config_snippet": snippet,
        "detail": short_status,
        "notes": [_one_line(n, MAX_DETAIL_CHARS) for n in notes or []],
    }


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirected webhook is a misconfiguration: report it instead of re-sending elsewhere."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: Message,
        newurl: str,
    ) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def post_alert(url: str, payload: dict, timeout: float = 10) -> None:
    """POST ``payload`` as JSON; raise :class:`AlertDeliveryError` (redacted) unless 2xx."""
    safe = redact_url(url)
    scheme = urllib.parse.urlsplit(url).scheme.lower() if url else ""
    if scheme not in ("http", "https"):
        raise AlertDeliveryError(f"alert webhook {safe}: only http(s) URLs are supported")
    secret_parts = [p for p in _secret_parts(url) if p]
    body = json.dumps(payload).encode()
    try:
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json; charset=utf-8",
                "User-Agent": "cdc_platform",
            },
        )
        with _OPENER.open(request, timeout=timeout) as response:
            status = response.status
            answer = response.read(_MAX_BODY_CHARS).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        answer = _read_quietly(exc)
        exc.close()
        raise AlertDeliveryError(
            f"alert webhook {safe} answered HTTP {exc.code}: {_scrub(answer, secret_parts)}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise AlertDeliveryError(
            f"could not reach alert webhook {safe}: {_scrub(str(reason), secret_parts)}"
        ) from None
    if not 200 <= status < 300:
        raise AlertDeliveryError(
            f"alert webhook {safe} answered HTTP {status}: {_scrub(answer, secret_parts)}"
        )


def _secret_parts(url: str) -> list[str]:
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return [url]
    segments = [s for s in parts.path.split("/") if len(s) >= 8]
    return [url, parts.path, parts.query, parts.password or "", parts.username or "", *segments]


def _scrub(text: str, secrets: list[str]) -> str:
    """Drop any echo of the URL's secret parts from a server answer or error reason."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "…")
    return _one_line(text, _MAX_BODY_CHARS)


def _read_quietly(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(_MAX_BODY_CHARS).decode("utf-8", "replace")
    except Exception:
        return ""
