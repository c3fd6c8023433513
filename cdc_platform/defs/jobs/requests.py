"""The run config of each operator job, as the Launchpad shows it, and the request it makes.

Each config names its table (``TableRunConfig``) and what the operator asks; ``request``
turns it into the operation's request (``lib.operations``), raising ``Refusal`` for a value
that cannot be meant (the run fails before it waits for the table). Deployment facts (the
snapshot and adoption roots) come from the config file, never from the run's config.
"""

from datetime import UTC, datetime
from typing import Literal

from pydantic import Field

from cdc_platform.defs.jobs.skeleton import TableRunConfig
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.landing.where.layout import hours_between, partition_key_to_hour
from cdc_platform.lib.operations.adopt import AdoptRequest
from cdc_platform.lib.operations.erase import EraseRequest
from cdc_platform.lib.operations.maintenance import (
    DEFAULT_RETENTION_HOURS,
    MaintainRequest,
    retention_refusal,
)
from cdc_platform.lib.operations.plan import PlanRequest
from cdc_platform.lib.operations.protect import ProtectRequest
from cdc_platform.lib.operations.rekey import RekeyRequest
from cdc_platform.lib.operations.resync import ResyncRequest
from cdc_platform.lib.operations.truncate import TruncateRequest
from cdc_platform.lib.operations.unapply import ReadmitRequest, UnapplyRequest


def parse_time(text: str | None, name: str) -> datetime | None:
    """A time as given in the run config (None: not given); refused if it is not zoned."""
    if text is None or not text.strip():
        return None
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise Refusal(
            f"{name} {text!r} is not an ISO-8601 time (like 2024-01-02T00:00:00Z)"
        ) from None
    if value.tzinfo is None:
        raise Refusal(f"{name} {text!r} has no time zone: add Z for UTC, or an offset")
    return value.astimezone(UTC)


class RekeyConfig(TableRunConfig):
    def request(self, platform: PlatformConfig, run_id: str) -> RekeyRequest:
        return RekeyRequest()


class ProtectConfig(TableRunConfig):
    def request(self, platform: PlatformConfig, run_id: str) -> ProtectRequest:
        return ProtectRequest()


class TruncateConfig(TableRunConfig):
    before: str | None = Field(
        default=None,
        description="Truncate what was written before this time: ISO-8601 with a zone "
        "(2024-01-02T00:00:00Z), not in the future. Default: everything written up to this "
        "run (its catch-up merge included).",
    )
    soft: bool = Field(
        default=True,
        description="Soft: close the live versions at `before` (history kept). Hard: remove "
        "the keys' rows and events (Delta time travel keeps them).",
    )

    def request(self, platform: PlatformConfig, run_id: str) -> TruncateRequest:
        return TruncateRequest(parse_time(self.before, "before"), self.soft)


class AdoptConfig(TableRunConfig):
    source: str = Field(
        description="The table to adopt: a Delta table or a folder of Parquet files (an "
        "absolute path, file:// or object-store URI under one of the config's adoption_roots), "
        "in live or soft-delete mode."
    )
    format: Literal["auto", "delta", "parquet"] = Field(
        default="auto", description="auto: Delta if the source has a _delta_log, else Parquet."
    )

    def request(self, platform: PlatformConfig, run_id: str) -> AdoptRequest:
        return AdoptRequest(self.source, tuple(platform.adoption_roots), self.format)


class ResyncConfig(TableRunConfig):
    snapshot: str = Field(
        description="The folder of snapshot files, in the table's landing format: an absolute "
        "path under one of the config's snapshot_roots (no symlink in it)."
    )
    at: str | None = Field(
        default=None,
        description="The re-sync's time R, ISO-8601 with a zone, not in the future (a minute "
        "of clock skew allowed). Default: when the run starts.",
    )

    def request(self, platform: PlatformConfig, run_id: str) -> ResyncRequest:
        # The snapshot as typed: checked against snapshot_roots, never resolved here.
        at = parse_time(self.at, "at")
        return ResyncRequest(self.snapshot, tuple(platform.snapshot_roots), at)


class EraseConfig(TableRunConfig):
    keys: list[dict[str, str]] = Field(
        description="The keys to erase (at most 1000): each names every key column of the "
        "table with its value as text, times with a zone ({id: '42'}; a keyless table's key is "
        "{_fivetran_id: '...'}). Dagster keeps a run's config: delete the run afterwards if "
        "its storage must not hold them."
    )
    reason: str = Field(
        description="Why (recorded in the erased-keys ledger; 1 to 500 characters). Name the "
        "request, not the person."
    )
    allow_absent: bool = Field(
        default=False,
        description="Record keys that have no event in the table as erased all the same (a "
        "key that may arrive later). Off: such a request fails and writes nothing, since a key "
        "that matches nothing is most often a value given in another form than the table's.",
    )

    def request(self, platform: PlatformConfig, run_id: str) -> EraseRequest:
        return EraseRequest(tuple(self.keys), self.reason, run_id, self.allow_absent)


class UnapplyConfig(TableRunConfig):
    files: list[str] = Field(
        description="Landing files to un-apply: paths or globs relative to the landing root "
        "(orders/year=2024/month=01/day=01/hour=05/bad.parquet) or to the table's folder."
    )
    reason: str = Field(description="Why: recorded with the files.")

    def request(self, platform: PlatformConfig, run_id: str) -> UnapplyRequest:
        return UnapplyRequest(tuple(self.files), self.reason, run_id)


class ReadmitConfig(TableRunConfig):
    files: list[str] = Field(description="Revoked files to apply again: paths or globs.")

    def request(self, platform: PlatformConfig, run_id: str) -> ReadmitRequest:
        return ReadmitRequest(tuple(self.files))


class PlanConfig(TableRunConfig):
    first_partition: str = Field(description="First hourly partition, e.g. 2024-01-01-05:00.")
    last_partition: str | None = Field(default=None, description="Last one; default: the first.")

    def request(self, platform: PlatformConfig, run_id: str) -> PlanRequest:
        try:
            first = partition_key_to_hour(self.first_partition)
            last = partition_key_to_hour(self.last_partition or self.first_partition)
        except ValueError as exc:
            raise Refusal(f"partitions are spelled like 2024-01-01-05:00: {exc}") from None
        if last < first:
            raise Refusal(f"last_partition {self.last_partition} is before first_partition")
        return PlanRequest(tuple(hours_between(first, last)))


class MaintenanceConfig(TableRunConfig):
    retention_hours: int = Field(
        default=DEFAULT_RETENTION_HOURS,
        description="VACUUM removes files no longer referenced for at least this many hours "
        "(time travel reaches back as far).",
    )
    allow_short_retention: bool = Field(
        default=False,
        description=f"True: a retention_hours below {DEFAULT_RETENTION_HOURS} is meant (to "
        "purge the files an erase_key or protect_columns replaced sooner); time travel then "
        "reaches back only that far.",
    )
    vacuum: bool = Field(default=True, description="False: compact only.")

    def request(self, platform: PlatformConfig, run_id: str) -> MaintainRequest:
        """Refused before the op waits for the slot or reads anything."""
        request = MaintainRequest(self.retention_hours, self.allow_short_retention, self.vacuum)
        refusal = retention_refusal(request)
        if refusal is not None:
            raise Refusal(refusal)
        return request
