"""The jobs role: every operator job (``registry``: one registry, one factory, one skeleton)
and the maintenance schedules that launch ``table_maintenance`` for each table."""

import dagster as dg

from cdc_platform.defs.jobs.maintenance_schedules import build_maintenance_schedules
from cdc_platform.defs.jobs.registry import MAINTENANCE_JOB, operator_jobs
from cdc_platform.lib.config import PlatformConfig


def definitions(platform: PlatformConfig) -> dg.Definitions:
    """The operator jobs and the maintenance schedules. One job each, the table named in the
    run config: the Jobs page lists the same jobs whatever the table count; each table keeps
    its own maintenance schedule (a fleet: one for all)."""
    jobs = operator_jobs(platform)
    maintenance = next(j for j in jobs if j.name == MAINTENANCE_JOB)
    return dg.Definitions(jobs=jobs, schedules=build_maintenance_schedules(platform, maintenance))
