"""What every operator job shares, in one skeleton (``operator_run``): finding the table a run
names, holding its pool slot while it works on it, and reporting what it did
(``OperatorRun.finish``). The jobs themselves are one registry (``defs.jobs.registry``).

**One job for every table.** Each of these jobs names its table in its run config
(``TableRunConfig``), so the Jobs page lists the same dozen jobs whatever the table count. A
name that is not a table of the config is refused before anything is read or waited for,
with a message that names the known tables (a few close ones when there are many).

**One writer per table.** Every operator job that writes a table runs inside
``table_pool_slot``: it claims the table's concurrency pool (``cdc_table_<name>``, limit 1 in
``dagster.yaml``), as the table's materializations and maintenance do, so none of them runs
beside another. The job names its table in run config, so its op cannot declare the pool: the
slot is claimed from the instance at run time, waiting (logged) for the run that holds it, up
to ``POOL_WAIT_SECONDS``. Each operation also fences its commits on the change-log version it
decided on (``lib``), so an event logged by anything else meanwhile is never removed unseen.

A run that changed a table reports a materialization of the hour partitions it concerns (so
the UI shows the table changed and ``<table>_current`` refreshes), or an observation when no
partition does, and runs the invariants over the keys it recomputed: a failing invariant fails
the run (the run-failure alert fires).
"""

import difflib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.defs.tags import TABLE_TAG
from cdc_platform.lib.config import PlatformConfig, TableConfig
from cdc_platform.lib.errors import Refusal
from cdc_platform.lib.history import invariants
from cdc_platform.lib.history.table import HistoryTable
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.landing.where.layout import hour_to_partition_key
from cdc_platform.lib.operations.operation import Result
from cdc_platform.lib.pipeline import needs_keyring
from cdc_platform.lib.storage.warehouse import TablePaths

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# How long an operator job waits for its table's pool slot (a backfill may hold it a while),
# and how often it says so in the run's log.
POOL_WAIT_SECONDS = 3600.0
POOL_LOG_EVERY_SECONDS = 60.0
_POLL_SECONDS = 2.0
# An unknown table's message lists every table up to this many, else the closest names.
TABLES_LISTED = 20


class TableRunConfig(dg.Config):
    """The run config every operator job starts with: the table it works on."""

    table: str = Field(description="The table, as named in the config.")


@dataclass(frozen=True)
class OperatorRun:
    """What an operator job's op works with once it holds its table (``operator_run``): the
    table, its session, roots and keyring, and the history version before it wrote."""

    context: dg.OpExecutionContext
    platform: PlatformConfig
    table: TableConfig
    spark: SparkResource
    keyring_resource: KeyringResource | None
    # Whether the table's pool slot is held (False: an instance without pools or limits).
    holds_slot: bool = True
    # An erasure's: its ledger is keyed by the salt, whatever the table's files need.
    keyring_always: bool = False

    @property
    def session(self) -> "SparkSession":
        return self.spark.session(self.platform.warehouse_root)

    @cached_property
    def history_table(self) -> HistoryTable:
        """The table's handle for the run, opened once; the keyring only if the job needs
        one and the table does (``keyring``)."""
        return HistoryTable.of(self.session, self.platform, self.table, self.keyring())

    @cached_property
    def version_before(self) -> int | None:
        """The history version before the work: the checks after it cover what changed."""
        return self.history_table.history.version

    def keyring(self) -> Keyring | None:
        """The keyring, loaded only for a table that needs it (decryption keys, the hash salt,
        erased keys), or for a job that always does (``keyring_always``)."""
        if self.keyring_resource is None:
            return None
        if not self.keyring_always and not needs_keyring(self.table, self.platform.warehouse_root):
            return None
        return self.keyring_resource.load()

    def finish(self, result: Result, checked: bool = True) -> None:
        """Log what the run did and report it on its hours; a ``checked`` run also checks the
        keys it recomputed (``check_and_report``). A result that changed nothing is logged."""
        self.context.log.info(f"{self.table.name}: {result.summary()}")
        if not result.changed:
            return
        meta = as_metadata(result.metadata())
        if not checked:
            report(self.context, self.table, result.hours, meta)
            return
        check_and_report(
            self.context,
            self.spark,
            self.platform,
            self.table,
            self.version_before,
            result.hours,
            meta,
        )


def as_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """A result's metadata for Dagster: lists and dicts as JSON values."""
    return {
        k: dg.MetadataValue.json(v) if isinstance(v, list | dict) else v for k, v in meta.items()
    }


@contextmanager
def operator_run(
    context: dg.OpExecutionContext,
    platform: PlatformConfig,
    config: "TableRunConfig",
    spark: SparkResource,
    keyring: KeyringResource | None = None,
    rebuilding: bool = False,
    keyring_always: bool = False,
) -> Iterator[OperatorRun]:
    """The skeleton every operator job shares: find the table the run names, hold its pool
    slot, refuse a config whose key or protected columns are not the table's (``table_key``,
    ``protected_columns``; but for ``rebuilding``, the jobs that change them, which check what
    they need), refuse a keyring whose hash salt is not the one the table's erased keys or
    hashed columns were recorded under (a job given the keyring: it reads landing files or logs
    events; ``HistoryTable.check_salts``), note the history version before the work (the checks
    after it cover what changed since), and turn the library's refusals (``Refusal``) into a
    failure without a traceback."""
    table = table_named(platform, config.table)
    tag_run_with_table(context, table)
    with table_pool_slot(context, table) as held, refused(Refusal):
        run = OperatorRun(context, platform, table, spark, keyring, held, keyring_always)
        run.history_table.check(rebuilding)  # before the job writes anything
        if keyring is not None and needs_keyring(table, platform.warehouse_root):
            # A job that reads landing files or logs events: not with another hash salt.
            run.history_table.check_salts(keyring.load())
        yield run


def pool_name(table: TableConfig) -> str:
    """One concurrency pool per table (limit 1 in dagster.yaml): one writer per table at a time."""
    return f"cdc_table_{table.name}"


@contextmanager
def table_pool_slot(
    context: dg.OpExecutionContext, table: TableConfig, wait_seconds: float | None = None
) -> Iterator[bool]:
    """Hold ``table``'s pool slot for the block (see the module docstring); whether it is
    held (``pool_slot``)."""
    step_key = context.get_step_execution_context().step.key
    with pool_slot(
        context.instance,
        pool_name(table),
        context.run.run_id,
        step_key,
        context.log,
        POOL_WAIT_SECONDS if wait_seconds is None else wait_seconds,
    ) as held:
        yield held


@contextmanager
def pool_slot(
    instance: dg.DagsterInstance,
    pool: str,
    run_id: str,
    step_key: str,
    log: Any,
    wait_seconds: float,
    poll_seconds: float | None = None,
) -> Iterator[bool]:
    """Claim a slot of ``pool`` for ``(run_id, step_key)`` as Dagster's executor does for an op
    with a static pool (``instance_concurrency_context.py``), waiting while another run holds
    it; free it (or the pending claim) on the way out, whatever happens. After
    ``wait_seconds`` the run fails, naming the holder. An instance whose storage has no
    concurrency pools (an in-memory one), or a pool without a limit, runs the block without a
    slot, saying so; the block is given whether the slot is held."""
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        log.warning(f"{pool}: this Dagster instance has no concurrency pools; running without one")
        yield False
        return
    storage.initialize_concurrency_limit_to_default(pool)
    if storage.get_concurrency_info(pool).limit is None:
        log.warning(f"{pool}: the pool has no limit (dagster.yaml sets pools.default_limit: 1)")
        yield False
        return
    poll = _POLL_SECONDS if poll_seconds is None else poll_seconds
    started = time.monotonic()
    next_log = started
    try:
        while True:
            if storage.claim_concurrency_slot(pool, run_id, step_key, 0).is_claimed:
                break
            now = time.monotonic()
            holders = sorted({s.run_id for s in storage.get_concurrency_info(pool).claimed_slots})
            if now - started >= wait_seconds:
                raise dg.Failure(
                    f"{pool}: the table is still being written by run(s) {', '.join(holders)} "
                    f"after {wait_seconds:.0f} s of waiting; nothing was done: launch this job "
                    "again once they finished"
                )
            if now >= next_log:
                log.info(
                    f"{pool}: waiting for run(s) {', '.join(holders)} to finish writing the table "
                    f"({now - started:.0f} s of at most {wait_seconds:.0f} s)"
                )
                next_log = now + POOL_LOG_EVERY_SECONDS
            time.sleep(max(0.0, min(poll, wait_seconds - (now - started))))
        log.info(f"{pool}: holding the table's slot")
        yield True
    finally:
        storage.free_concurrency_slot_for_step(run_id, step_key)


def table_named(platform: PlatformConfig, name: str) -> TableConfig:
    """The table a run config names; a ``dg.Failure`` naming the known tables if none is.

    The name is echoed (shortened): run config cannot hold ``{env: ...}`` (the resources
    refuse it first), so it holds nothing the Launchpad user did not type."""
    try:
        return platform.table(name)
    except KeyError:
        pass
    names = [t.name for t in platform.tables]
    if len(names) <= TABLES_LISTED:
        known = ", ".join(names)
    else:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
        known = f"{len(names)} tables" + (f", closest: {', '.join(close)}" if close else "")
        known += "; the asset catalog lists them"
    shown = name if len(name) <= 100 else name[:100] + "..."
    raise dg.Failure(f"no table {shown!r} in the config (tables: {known})")


@contextmanager
def refused(*errors: type[Exception]) -> Iterator[None]:
    """``errors`` raised in the block fail the run with their message alone (no traceback):
    the library's refusals of a run's input, which say what to do instead."""
    try:
        yield
    except errors as exc:
        raise dg.Failure(str(exc)) from None


def tag_run_with_table(context: dg.OpExecutionContext, table: TableConfig) -> None:
    """Tag the run with its table, as a sensor's or a schedule's run is, so the Runs page
    filters by it and a failure alert names it."""
    if context.run.tags.get(TABLE_TAG) != table.name:
        context.instance.add_run_tags(context.run.run_id, {TABLE_TAG: table.name})


def check_and_report(
    context: dg.OpExecutionContext,
    spark: SparkResource,
    platform: PlatformConfig,
    table: TableConfig,
    version_before: int | None,
    hours: tuple[datetime, ...],
    meta: dict[str, Any],
) -> None:
    """Run the invariants over the keys this run recomputed, report the change (with the
    checks' results) and then fail the run if an invariant failed: the commit happened, so
    the UI shows it either way."""
    paths = TablePaths.of(platform.warehouse_root, table.name)
    session = spark.session(platform.warehouse_root)
    scope = invariants.touched_keys(session, paths, table.key, version_before)
    outcomes = invariants.run_checks(
        session, paths, table.key, scope, hide_keys=table.encryption != "none"
    )
    failed = [o for o in outcomes if not o.passed and o.name != invariants.NO_QUARANTINE]
    for o in failed:
        context.log.error(f"{table.name}: check {o.name} failed for {o.failing} key(s) {o.sample}")
    meta = {
        **meta,
        "checks_passed": [o.name for o in outcomes if o.passed],
        "checks_failed": [o.name for o in failed],
    }
    report(context, table, hours, meta)
    if failed:
        raise dg.Failure(
            f"{table.name}: invariants failed after the run: {', '.join(o.name for o in failed)}",
            metadata={o.name: o.failing for o in failed},
        )


def report(
    context: dg.OpExecutionContext,
    table: TableConfig,
    hours: tuple[datetime, ...],
    meta: dict[str, Any],
) -> None:
    # Partitions of the asset only: from the table's start to the last closed hour.
    last = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    hours = tuple(h for h in hours if table.start <= h <= last)
    for hour in hours:
        context.log_event(
            dg.AssetMaterialization(
                asset_key=dg.AssetKey(table.name),
                partition=hour_to_partition_key(hour),
                metadata=meta,
            )
        )
    if not hours:
        context.log_event(dg.AssetObservation(asset_key=dg.AssetKey(table.name), metadata=meta))
