"""Every operator job, as one registry of ``(job, op, run config, operation)`` and one factory.

Each job names its table in its run config, so the Jobs page lists the same dozen jobs
whatever the table count. Its op refuses a config that cannot be meant before it waits for
the table (``request``), then, holding the table's pool slot (``skeleton.operator_run``),
runs the operation on the table's handle and reports its result (``OperatorRun.finish``):
a materialization of the hours it concerns, with the invariants checked over the keys it
recomputed, or an observation when it names no hour.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import dagster as dg

import cdc_platform.defs.jobs.requests as rq
from cdc_platform.defs.jobs.maintenance_schedules import MAINTENANCE_JOB, MAINTENANCE_OP
from cdc_platform.defs.jobs.skeleton import OperatorRun, operator_run, refused, table_named
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.history.table_key import PROTECT_JOB, REKEY_JOB
from cdc_platform.lib.operations import (
    adopt,
    erase,
    maintenance,
    plan,
    protect,
    rekey,
    resync,
    truncate,
    unapply,
)
from cdc_platform.lib.operations.operation import Request, Result, to_ms

PLAN_JOB = "merge_plan"
PLAN_OP = "plan_merge"


class RunConfig(Protocol):
    table: str

    def request(self, platform: PlatformConfig, run_id: str) -> Request: ...


@dataclass(frozen=True)
class OperatorJob:
    """One operator job: its name and its op's, its run config, the operation it runs and
    how: which keyring it takes (``if_needed``: only for a table whose files or erased keys
    need one), whether it changes the key or the protected columns (``rebuilding``: it
    checks what it needs itself), whether its result is checked, and whether its request
    learns that the table's slot is held (a short-retention VACUUM needs it)."""

    name: str
    op: str
    config: type[dg.Config]
    operation: Callable[[HistoryTable, Any], Result]
    description: str
    keyring: Literal["none", "if_needed", "always"] = "none"
    rebuilding: bool = False
    checked: bool = True
    needs_slot_held: bool = False


OPERATOR_JOBS: tuple[OperatorJob, ...] = (
    OperatorJob(
        MAINTENANCE_JOB,
        MAINTENANCE_OP,
        rq.MaintenanceConfig,
        maintenance.maintain,
        "Compact a table's history table and change log, then VACUUM them (and its current "
        "table). Each table's <table>_maintenance_schedule launches it (a fleet's: "
        "cdc_maintenance_schedule).",
        checked=False,
        needs_slot_held=True,
    ),
    OperatorJob(
        PLAN_JOB,
        PLAN_OP,
        rq.PlanConfig,
        plan.plan,
        "Dry run: what materializing a range of hours of a table would change (figures logged "
        "on the table's asset; nothing committed).",
        keyring="if_needed",
        checked=False,
    ),
    OperatorJob(
        unapply.UNAPPLY,
        "unapply",
        rq.UnapplyConfig,
        unapply.unapply,
        "Un-apply landing files: remove their events, recompute the keys they touched, never "
        "apply them again unless re-admitted.",
    ),
    OperatorJob(
        unapply.READMIT,
        "readmit",
        rq.ReadmitConfig,
        unapply.readmit,
        "Re-admit un-applied landing files and apply them again.",
        keyring="if_needed",
    ),
    OperatorJob(
        truncate.TRUNCATE,
        "truncate",
        rq.TruncateConfig,
        truncate.truncate,
        "Truncate a table before a time: soft closes live versions (history kept), hard "
        "removes the rows and their events.",
    ),
    OperatorJob(
        adopt.ADOPT,
        "adopt",
        rq.AdoptConfig,
        adopt.adopt,
        "Adopt an existing table (live or soft-delete mode) into history mode: live rows start "
        "at its latest _fivetran_synced, soft-deleted rows at 0001-01-01.",
        keyring="if_needed",
    ),
    OperatorJob(
        resync.RESYNC,
        "resync",
        rq.ResyncConfig,
        resync.resync,
        "Re-sync a table from a snapshot: changed keys get a new version, absent keys are "
        "closed, unchanged keys keep theirs.",
        keyring="if_needed",
    ),
    OperatorJob(
        REKEY_JOB,
        "rekey",
        rq.RekeyConfig,
        rekey.rekey,
        "Rebuild a table's history under the key its config now names (columns added to or "
        "removed from the key, keyed to keyless and back), from its change log.",
        rebuilding=True,
    ),
    OperatorJob(
        PROTECT_JOB,
        "protect",
        rq.ProtectConfig,
        protect.protect,
        "Rewrite a table (change log, history, current table) for the hash_columns and "
        "block_columns its config now names.",
        keyring="if_needed",
        rebuilding=True,
    ),
    OperatorJob(
        erase.ERASE,
        "erase",
        rq.EraseConfig,
        erase.erase,
        "Erase keys for a data subject's request: their rows and events leave the change log, "
        "the history, the current table, the quarantine and the ledgers, and are never logged "
        "again.",
        keyring="always",
    ),
)


def operator_jobs(platform: PlatformConfig) -> list[dg.JobDefinition]:
    return [build_job(platform, spec) for spec in OPERATOR_JOBS]


def operator_job(platform: PlatformConfig, name: str) -> dg.JobDefinition:
    """The operator job named ``name`` (a registry entry's)."""
    return build_job(platform, next(spec for spec in OPERATOR_JOBS if spec.name == name))


def build_job(platform: PlatformConfig, spec: OperatorJob) -> dg.JobDefinition:
    """The job of one registry entry: one op, its run config ``spec.config``, taking the
    keyring resource only if the entry says it needs one."""

    def run(
        context: dg.OpExecutionContext,
        config: RunConfig,
        spark: SparkResource,
        keyring: KeyringResource | None,
    ) -> None:
        table_named(platform, config.table)  # an unknown table is refused first
        with refused(Refusal):  # a value that cannot be meant: before waiting for the table
            request = config.request(platform, context.run.run_id)
        with operator_run(
            context,
            platform,
            config,  # pyright: ignore[reportArgumentType]
            spark,
            keyring,
            rebuilding=spec.rebuilding,
            keyring_always=spec.keyring == "always",
        ) as held:
            result = spec.operation(held.history_table, _stamped(request, held, spec))
            held.finish(result, checked=spec.checked)

    def without_keyring(context: dg.OpExecutionContext, config: Any, spark: SparkResource) -> None:
        run(context, config, spark, None)

    def with_keyring(
        context: dg.OpExecutionContext,
        config: Any,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        run(context, config, spark, keyring)

    body = without_keyring if spec.keyring == "none" else with_keyring
    body.__annotations__["config"] = spec.config  # Dagster reads the run config's schema here
    op = dg.op(name=spec.op)(body)

    @dg.job(name=spec.name, description=spec.description)
    def job() -> None:
        op()

    return job


def _stamped(request: Request, run: OperatorRun, spec: OperatorJob) -> Request:
    """The request as of now, when the run holds its table (the operation's clock), and told
    whether the slot is held where the operation needs to know."""
    request = replace(request, now=to_ms(datetime.now(UTC)))
    if spec.needs_slot_held:
        request = replace(request, slot_held=run.holds_slot)  # type: ignore[call-arg]
    return request
