"""The ``cdc_new_tables`` sensor: report table folders in the landing zone the config does not list.

Each tick lists the landing root's table folders (``lib.landing.discovery``, a directory listing). A
folder seen for the first time is reported once: a warning in the tick's log (the UI shows it
under the sensor's ticks) with its columns and the ``tables:`` entry to paste, and a
``new_table`` alert through the ``alert_webhook`` resource. An alert that cannot be delivered
stays in the cursor and is retried on later ticks (``defs.alerts.webhook.deliver``); nothing raises
into the tick. On a bucket a tick lists within a budget (``discovery.unlisted_budget``): a
folder not decided when it is spent (thousands of junk keys, say) goes on next tick where it
stopped, the longest waiting first. The cursor is JSON: ``{"reported": [names], "pending":
[alerts], "scanning": [[name, key listed up to], ...]}``.

With a ``discover:`` template, the tables the Definitions were built with (at code-location
load) already have assets; the report says so. A folder appearing later gets its asset when
the code location is reloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from cdc_platform.defs.alerts.webhook import AlertWebhookResource, deliver
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.fleet.alerts import new_table_alert
from cdc_platform.lib.landing.discovery import (
    DiscoveredTable,
    describe,
    unlisted_budget,
    unlisted_tables,
)
from cdc_platform.lib.landing.where.root import zone_at
from cdc_platform.lib.landing.where.zone import LandingUnavailableError, LandingZone

NEW_TABLES_SENSOR_NAME = "cdc_new_tables"


@dataclass
class NewTablesCursor:
    """The tables already reported, and the alerts not delivered yet (with their attempts)."""

    reported: list[str] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    # Folders whose listing goes on next tick (name -> the key it goes on after), in order.
    scanning: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        data: dict[str, Any] = {"reported": sorted(self.reported), "pending": self.pending}
        if self.scanning:
            data["scanning"] = [[n, k] for n, k in self.scanning.items()]
        return json.dumps(
            data,
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | None) -> NewTablesCursor:
        """An empty cursor (first tick, or reset from the UI) has reported nothing."""
        if not raw:
            return cls()
        data = json.loads(raw)
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("reported", []), list)
            or not isinstance(data.get("pending", []), list)
            or not isinstance(data.get("scanning", []), list)
        ):
            raise ValueError("unsupported new-table cursor; reset the sensor cursor")
        return cls(
            reported=[str(n) for n in data.get("reported") or []],
            pending=list(data.get("pending") or []),
            scanning={str(n): str(k) for n, k in data.get("scanning") or []},
        )


def status_line(table: DiscoveredTable, platform: PlatformConfig, discovered: set[str]) -> str:
    """What happens next for a reported table."""
    where = f" in {platform.source}" if platform.source else ""
    if table.name in discovered:
        note = ""
        if platform.discover is not None and table.first_hour < platform.discover.start:
            note = (
                f" (files before the template's start {platform.discover.start_partition_key}"
                " are outside its partitions)"
            )
        return f"its asset was created from the config's discover: template{note}"
    if platform.discover is not None and table.encoding.is_plain_parquet:
        return (
            "the discover: template will create its asset when the code location is reloaded;"
            f" or paste this entry under tables:{where}"
        )
    if platform.discover is not None:
        return (
            f"discover: covers plain Parquet only and its files are {_encoding(table)};"
            f" paste this entry under tables:{where}"
        )
    return f"paste this entry under tables:{where} to build its history table"


def _encoding(table: DiscoveredTable) -> str:
    enc = table.encoding
    parts = [enc.format.upper()]
    if enc.compression != "none":
        parts.append(enc.compression.upper())
    if enc.encryption != "none":
        parts.append(enc.encryption.upper())
    return "+".join(parts)


def build_new_tables_sensor(
    platform: PlatformConfig,
    discovered: Iterable[str] = (),
    *,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds: int = 60,
) -> dg.SensorDefinition:
    """The sensor for ``platform`` as written (its listed tables); ``discovered`` names the
    tables the Definitions added from its ``discover:`` template (reported as such)."""
    landing = zone_at(platform.landing_root)
    landing_root = landing.root
    listed = [t.name for t in platform.tables]
    added = set(discovered)

    def status_for(table: DiscoveredTable) -> str:
        return status_line(table, platform, added)

    @dg.sensor(
        name=NEW_TABLES_SENSOR_NAME,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            f"Reports table folders under {landing_root} that the config does not list (once "
            "each): a warning in the tick log and a new_table alert with the columns and the "
            "tables: entry to paste; undeliverable alerts are retried on later ticks."
        ),
    )
    def cdc_new_tables(
        context: dg.SensorEvaluationContext, alert_webhook: AlertWebhookResource
    ) -> dg.SensorResult:
        state = NewTablesCursor.from_json(context.cursor)
        if not landing.exists():
            # An unmounted landing root is not "every table gone": keep what was reported.
            state.pending, delivered = deliver(context, alert_webhook, state.pending)
            return dg.SensorResult(
                cursor=state.to_json(),
                skip_reason=f"landing root {landing_root} does not exist; "
                f"{delivered} alert(s) sent, {len(state.pending)} pending",
            )
        names = unlisted_tables(landing, listed, unlisted_budget(), state.scanning)
        reported = set(state.reported)
        new = []
        for name in names:
            if name in reported:
                continue
            payload = _new_table_alert(context, landing, name, status_for)
            if payload is None:
                continue
            state.pending.append({"payload": payload, "attempts": 0})
            reported.add(name)
            new.append(name)
        # A table the config lists now leaves the cursor (reported again if it is unlisted).
        known = {n.lower() for n in listed}
        state.reported = sorted(n for n in reported if n.lower() not in known)
        state.pending, delivered = deliver(context, alert_webhook, state.pending)
        found = f"{len(names)} unlisted table folder(s)" + (
            f" ({', '.join(names)})" if names else ""
        )
        if state.scanning:
            found += f" ({len(state.scanning)} folder(s) to be listed further next tick)"
        summary = (
            f"{found}: {len(new)} new"
            + (f" ({', '.join(new)})" if new else "")
            + f", {delivered} alert(s) sent, {len(state.pending)} pending"
        )
        return dg.SensorResult(cursor=state.to_json(), skip_reason=summary)

    return cdc_new_tables


def _new_table_alert(
    context: dg.SensorEvaluationContext,
    landing: LandingZone,
    name: str,
    status_for: Callable[[DiscoveredTable], str],
) -> dict[str, Any] | None:
    """The ``new_table`` alert for an unlisted folder, logged as a warning with the entry to
    paste; None when the folder cannot be described this tick (it went away meanwhile: it is
    tried again next tick)."""
    try:
        table = describe(landing, name)
    except (OSError, LandingUnavailableError) as exc:
        context.log.info(f"{name}: not described this tick ({type(exc).__name__})")
        return None
    status = status_for(table)
    snippet = table.config_snippet()
    columns = ", ".join(f"{c} {t}" for c, t in table.columns) or "unknown"
    context.log.warning(
        f"new table folder '{name}' in {landing.root} is not in the config: {status}. "
        f"Columns: {columns}.\n{snippet}"
    )
    return new_table_alert(
        table=name,
        columns=table.columns,
        primary_key=list(table.primary_key),
        first_hour=table.start,
        sample_file=landing.relative(table.sample_file),
        snippet=snippet,
        status=status,
        notes=list(table.notes),
    )
