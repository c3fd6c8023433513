"""``unapply_files`` and ``readmit_files``: taking a bad delivery back out of a table, and
putting it back, from the Launchpad.

Each run names the table, the files (paths or globs relative to the landing root or to the
table's folder) and, to un-apply, a reason. The work is ``lib.operations.revocation``'s; here it is
reported and checked as ``defs.operations`` does for every operator job, on the hour
partitions the files are in.
"""

from datetime import UTC, datetime
from typing import Any

import dagster as dg
from pydantic import Field

from cdc_platform.defs.operations import TableRunConfig, operator_run
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.operations.revocation import (
    NoMatchingFileError,
    NotReadmittableError,
    readmit,
    unapply,
)

UNAPPLY_JOB = "unapply_files"
READMIT_JOB = "readmit_files"


class UnapplyConfig(TableRunConfig):
    files: list[str] = Field(
        description="Landing files to un-apply: paths or globs relative to the landing root "
        "(orders/year=2024/month=01/day=01/hour=05/bad.parquet) or to the table's folder."
    )
    reason: str = Field(description="Why: recorded with the files.")


class ReadmitConfig(TableRunConfig):
    files: list[str] = Field(description="Revoked files to apply again: paths or globs.")


def build_revocation_jobs(platform: PlatformConfig) -> list[dg.JobDefinition]:
    return [_unapply_job(platform), _readmit_job(platform)]


def _unapply_job(platform: PlatformConfig) -> dg.JobDefinition:
    """Un-applying landing files (``lib.operations.revocation.unapply``)."""

    @dg.op(name="unapply")
    def unapply_op(
        context: dg.OpExecutionContext, config: UnapplyConfig, spark: SparkResource
    ) -> None:
        refuse = (NoMatchingFileError, ValueError)
        with operator_run(context, platform, config, spark, refuse=refuse) as run:
            r = unapply(
                run.session,
                run.table,
                platform.landing_root,
                platform.warehouse_root,
                config.files,
                config.reason,
                context.run.run_id,
                datetime.now(UTC),
            )
            meta = {
                "operation": "unapply_files",
                "reason": config.reason,
                "files": dg.MetadataValue.json(list(r.files)),
                "newly_revoked": len(r.newly_revoked),
                "events_removed": r.events_removed,
                "keys_retracted": r.keys_retracted,
                "changelog_files_rewritten": r.changelog_files_rewritten,
                "keys_affected": r.merge.keys_affected,
                "versions_closed": r.merge.versions_closed,
                "files_removed": r.merge.files_removed,
                "files_added": r.merge.files_added,
                "delta_version": r.merge.history_version,
            }
            run.done(
                f"revoked {len(r.files)} file(s) ({len(r.newly_revoked)} newly), removed "
                f"{r.events_removed} event(s) of {r.keys_retracted} key(s), history version "
                f"{r.merge.history_version}",
                r.hours,
                meta,
            )

    @dg.job(
        name=UNAPPLY_JOB,
        description="Un-apply landing files: remove their events, recompute the keys they "
        "touched, never apply them again unless re-admitted.",
    )
    def unapply_files() -> None:
        unapply_op()

    return unapply_files


def _readmit_job(platform: PlatformConfig) -> dg.JobDefinition:
    """Re-admitting un-applied files (``lib.operations.revocation.readmit``)."""

    @dg.op(name="readmit")
    def readmit_op(
        context: dg.OpExecutionContext,
        config: ReadmitConfig,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        refuse = (NoMatchingFileError, NotReadmittableError)
        with operator_run(context, platform, config, spark, keyring, refuse) as run:
            r = readmit(
                run.session,
                run.table,
                platform.landing_root,
                platform.warehouse_root,
                config.files,
                run.keyring(),
            )
            o = r.outcome
            meta: dict[str, Any] = {
                "operation": "readmit_files",
                "files": dg.MetadataValue.json(list(r.files)),
                "events_new": o.events_new if o else 0,
                "keys_affected": o.merge.keys_affected if o else 0,
                "delta_version": o.merge.history_version if o else run.version_before,
            }
            run.done(
                f"re-admitted {len(r.files)} file(s); {o.events_new if o else 0} event(s) "
                f"logged again over {len(r.hours)} hour(s)",
                r.hours,
                meta,
            )

    @dg.job(
        name=READMIT_JOB,
        description="Re-admit un-applied landing files and apply them again.",
    )
    def readmit_files() -> None:
        readmit_op()

    return readmit_files
