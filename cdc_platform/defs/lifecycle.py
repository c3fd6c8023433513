"""The table lifecycle jobs, from the Launchpad: ``truncate_table`` (Fivetran's Truncate),
``adopt_table`` (an existing table switched to history mode), ``resync_table`` (a re-sync
from a snapshot), ``rekey_table`` (the history rebuilt under the key the config now names),
``protect_columns`` (the table rewritten for the hashed and blocked columns it now names) and
``erase_key`` (a data subject's keys erased).

Each names its table in run config; ``truncate_table`` adds ``before`` (an ISO-8601 time; when
left out, everything written up to the run, its catch-up merge included) and ``soft``;
``adopt_table`` the source to adopt; ``resync_table`` the snapshot folder and ``at``;
``erase_key`` the keys and a reason. The work is ``lib.operations``'; each run is reported and
checked as ``defs.operations`` does for every operator job, on the hour partition of the
operation's time (an erasure names none: it is reported as an observation).
"""

from datetime import UTC, datetime
from typing import Literal

import dagster as dg
from pydantic import Field

from cdc_platform.defs.operations import TableRunConfig, operator_run, table_named
from cdc_platform.defs.resources import KeyringResource, SparkResource
from cdc_platform.lib.config import PlatformConfig
from cdc_platform.lib.history.table_key import PROTECT_JOB, REKEY_JOB, named
from cdc_platform.lib.operations.adoption import AdoptionError, adopt
from cdc_platform.lib.operations.erasure import ErasureError, erase
from cdc_platform.lib.operations.protection import ProtectionError, reprotect
from cdc_platform.lib.operations.rekey import RekeyError, rekey
from cdc_platform.lib.operations.resync import ResyncError, resync
from cdc_platform.lib.operations.truncation import truncate
from cdc_platform.lib.pipeline import to_ms

TRUNCATE_JOB = "truncate_table"
ADOPT_JOB = "adopt_table"
RESYNC_JOB = "resync_table"
ERASE_JOB = "erase_key"


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


class AdoptConfig(TableRunConfig):
    source: str = Field(
        description="The table to adopt: a Delta table or a folder of Parquet files (an "
        "absolute path, file:// or object-store URI under one of the config's adoption_roots), "
        "in live or soft-delete mode."
    )
    format: Literal["auto", "delta", "parquet"] = Field(
        default="auto", description="auto: Delta if the source has a _delta_log, else Parquet."
    )


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


def parse_before(text: str | None, default: datetime, name: str = "before") -> datetime:
    """A time as given in the run config; a clear failure if it is not a zoned time."""
    if text is None or not text.strip():
        return default
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise dg.Failure(
            f"{name} {text!r} is not an ISO-8601 time (like 2024-01-02T00:00:00Z)"
        ) from None
    if value.tzinfo is None:
        raise dg.Failure(f"{name} {text!r} has no time zone: add Z for UTC, or an offset")
    return value.astimezone(UTC)


def build_lifecycle_jobs(platform: PlatformConfig) -> list[dg.JobDefinition]:
    return [
        _truncate_job(platform),
        _adopt_job(platform),
        _resync_job(platform),
        _rekey_job(platform),
        _protect_job(platform),
        _erase_job(platform),
    ]


def _truncate_job(platform: PlatformConfig) -> dg.JobDefinition:
    """Fivetran's Truncate, soft or hard (``lib.operations.truncation``)."""

    @dg.op(name="truncate")
    def truncate_op(
        context: dg.OpExecutionContext, config: TruncateConfig, spark: SparkResource
    ) -> None:
        # Refused before waiting for the slot, after an unknown table; None: the millisecond
        # after the catch-up merge (what it writes is truncated too).
        table_named(platform, config.table)
        before = parse_before(config.before, datetime.now(UTC)) if config.before else None
        with operator_run(context, platform, config, spark) as run:
            r = truncate(
                run.session,
                run.table,
                platform.warehouse_root,
                before,
                config.soft,
                datetime.now(UTC),
            )
            if not r.table_existed:
                context.log.info(f"{run.table.name}: no table yet, nothing to truncate")
                return
            kind, done = ("soft", "closed") if r.soft else ("hard", "removed")
            meta = {
                "operation": TRUNCATE_JOB,
                "before": r.before.isoformat(),
                "soft": r.soft,
                f"keys_{done}": r.keys,
                "events_logged": r.events_logged,
                "events_removed": r.events_removed,
                "versions_closed": r.merge.versions_closed,
                "files_removed": r.merge.files_removed,
                "files_added": r.merge.files_added,
                "delta_version": r.merge.history_version,
            }
            run.done(
                f"{kind} truncate before {r.before.isoformat()}: {r.keys} key(s) {done}, "
                f"history version {r.merge.history_version}",
                (r.before.replace(minute=0, second=0, microsecond=0),),
                meta,
            )

    @dg.job(
        name=TRUNCATE_JOB,
        description="Truncate a table before a time: soft closes live versions (history "
        "kept), hard removes the rows and their events.",
    )
    def truncate_table() -> None:
        truncate_op()

    return truncate_table


def _adopt_job(platform: PlatformConfig) -> dg.JobDefinition:
    """An existing table switched to history mode (``lib.operations.adoption``)."""

    @dg.op(name="adopt")
    def adopt_op(
        context: dg.OpExecutionContext,
        config: AdoptConfig,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        with operator_run(
            context, platform, config, spark, keyring, refuse=(AdoptionError, ValueError)
        ) as run:
            r = adopt(
                run.session,
                run.table,
                platform.warehouse_root,
                config.source,
                config.format,
                adoption_roots=platform.adoption_roots,
                landing_root=platform.landing_root,
                keyring=run.keyring(),
            )
            meta = {
                "operation": ADOPT_JOB,
                "source": r.source,
                "format": r.format,
                "adopted_at": r.adopted_at.isoformat(),
                "live_rows": r.live_rows,
                "deleted_rows": r.deleted_rows,
                "events_new": r.events_new,
                "dropped_columns": dg.MetadataValue.json(list(r.dropped_columns)),
                "versions_opened": r.merge.versions_opened,
                "delta_version": r.merge.history_version,
            }
            run.done(
                f"adopted {r.live_rows} live and {r.deleted_rows} soft-deleted row(s) from "
                f"{r.source} at {r.adopted_at.isoformat()}; {r.events_new} event(s) new, "
                f"history version {r.merge.history_version}",
                (r.adopted_at.replace(minute=0, second=0, microsecond=0),),
                meta,
            )

    @dg.job(
        name=ADOPT_JOB,
        description="Adopt an existing table (live or soft-delete mode) into history mode: "
        "live rows start at its latest _fivetran_synced, soft-deleted rows at 0001-01-01.",
    )
    def adopt_table() -> None:
        adopt_op()

    return adopt_table


def _resync_job(platform: PlatformConfig) -> dg.JobDefinition:
    """A re-sync from a snapshot folder (``lib.operations.resync``)."""

    @dg.op(name="resync")
    def resync_op(
        context: dg.OpExecutionContext,
        config: ResyncConfig,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        table_named(platform, config.table)  # an unknown table is refused first
        given_at = parse_before(config.at, datetime.now(UTC), "at") if config.at else None
        refuse = (ResyncError, ValueError)
        with operator_run(context, platform, config, spark, keyring, refuse) as run:
            started = datetime.now(UTC)
            r = resync(
                run.session,
                run.table,
                platform.landing_root,
                platform.warehouse_root,
                config.snapshot,  # as typed: checked against snapshot_roots, never resolved here
                given_at or started,  # default: when the run holds the table
                run.keyring(),
                started,
                snapshot_roots=platform.snapshot_roots,
            )
            meta = {
                "operation": RESYNC_JOB,
                "at": r.at.isoformat(),
                "snapshot": config.snapshot,
                "files": r.files,
                "rows": r.rows,
                "keys_closed": r.keys_closed,
                "keys_replaced": r.keys_replaced,
                "events_new": r.events_new,
                "versions_opened": r.merge.versions_opened,
                "versions_closed": r.merge.versions_closed,
                "delta_version": r.merge.history_version,
            }
            run.done(
                f"re-synced {r.rows} row(s) from {r.files} file(s) at {r.at.isoformat()}: "
                f"{r.keys_closed} key(s) closed, {r.keys_replaced} replaced, history version "
                f"{r.merge.history_version}",
                (r.at.replace(minute=0, second=0, microsecond=0),),
                meta,
            )

    @dg.job(
        name=RESYNC_JOB,
        description="Re-sync a table from a snapshot: changed keys get a new version, absent "
        "keys are closed, unchanged keys keep theirs.",
    )
    def resync_table() -> None:
        resync_op()

    return resync_table


def _rekey_job(platform: PlatformConfig) -> dg.JobDefinition:
    """The history rebuilt under the config's key from the change log (``lib.operations.rekey``),
    reported on the hour of the table's last event."""

    @dg.op(name="rekey")
    def rekey_op(
        context: dg.OpExecutionContext, config: TableRunConfig, spark: SparkResource
    ) -> None:
        refuse = (RekeyError,)  # anything else after the first commit keeps its traceback
        with operator_run(context, platform, config, spark, refuse=refuse, rebuilding=True) as run:
            r = rekey(run.session, run.table, run.paths, to_ms(datetime.now(UTC)))
            if not r.changed:
                context.log.info(
                    f"{run.table.name}: the table is already folded under {named(r.new_key)}"
                    " (or has no history yet): nothing to do"
                )
                return
            c = r.counts
            assert c is not None
            meta = {
                "operation": REKEY_JOB,
                "old_key": named(r.old_key),
                "new_key": named(r.new_key),
                "events": c.events,
                "keys_before": c.keys_before,
                "keys_after": c.keys_after,
                "keys_merged": c.merged,
                "keys_split": c.split,
                "events_counted_once": c.counted_once,
                "versions": r.versions,
                "versions_synced_kept": r.synced_kept,
                "changelog_rewritten": r.changelog_rewritten,
                "old_rows_at_version": r.from_version,
                "delta_version": r.history_version,
            }
            hours = (
                (c.last_event_at.replace(minute=0, second=0, microsecond=0),)
                if c.last_event_at
                else ()
            )
            run.done(
                f"history rebuilt under {named(r.new_key)} (was {named(r.old_key)}): "
                f"{c.keys_before} key(s) became {c.keys_after}, {c.merged} merged and {c.split} "
                f"split; {r.versions} version(s); the old rows are version {r.from_version}",
                hours,
                meta,
            )

    @dg.job(
        name=REKEY_JOB,
        description="Rebuild a table's history under the key its config now names (columns "
        "added to or removed from the key, keyed to keyless and back), from its change log.",
    )
    def rekey_table() -> None:
        rekey_op()

    return rekey_table


def _protect_job(platform: PlatformConfig) -> dg.JobDefinition:
    """The table rewritten for the config's hash_columns and block_columns
    (``lib.operations.protection``), reported as a rekey is."""

    @dg.op(name="protect")
    def protect_op(
        context: dg.OpExecutionContext,
        config: TableRunConfig,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        refuse = (ProtectionError, RekeyError)
        with operator_run(
            context, platform, config, spark, keyring, refuse=refuse, rebuilding=True
        ) as run:
            r = reprotect(
                run.session, run.table, run.paths, run.keyring(), to_ms(datetime.now(UTC))
            )
            if not r.changed:
                context.log.info(f"{run.table.name}: the table already follows its lists")
                return
            meta = {
                "operation": PROTECT_JOB,
                "hashed_before": dg.MetadataValue.json(r.before["hash"]),
                "blocked_before": dg.MetadataValue.json(r.before["block"]),
                "hashed": dg.MetadataValue.json(r.after["hash"]),
                "blocked": dg.MetadataValue.json(r.after["block"]),
                "old_rows_at_version": r.rebuild.from_version if r.rebuild else None,
                "delta_version": r.rebuild.history_version if r.rebuild else None,
            }
            last = r.rebuild.last_event_at if r.rebuild else None
            run.done(
                f"rewritten hashing {r.after['hash']} and blocking {r.after['block']} (was "
                f"{r.before['hash']} and {r.before['block']}); the cleartext stays in replaced "
                "files until a VACUUM past the retention",
                (last.replace(minute=0, second=0, microsecond=0),) if last else (),
                meta,
            )

    @dg.job(
        name=PROTECT_JOB,
        description="Rewrite a table (change log, history, current table) for the hash_columns "
        "and block_columns its config now names.",
    )
    def protect_columns() -> None:
        protect_op()

    return protect_columns


def _erase_job(platform: PlatformConfig) -> dg.JobDefinition:
    """A data subject's request: keys erased from every live file of the table
    (``lib.operations.erasure``), reported as an observation (no hour is named)."""

    @dg.op(name="erase")
    def erase_op(
        context: dg.OpExecutionContext,
        config: EraseConfig,
        spark: SparkResource,
        keyring: KeyringResource,
    ) -> None:
        with operator_run(context, platform, config, spark, keyring, (ErasureError,)) as run:
            r = erase(
                run.session,
                run.table,
                run.paths,
                config.keys,
                config.reason,
                context.run.run_id,
                keyring.load(),  # the salt, whether or not the table's files need the keyring
                to_ms(datetime.now(UTC)),
                allow_absent=config.allow_absent,
            )
            meta = {
                "operation": ERASE_JOB,
                "key_hashes": dg.MetadataValue.json(list(r.key_hashes)),
                "keys_newly_recorded": r.newly_recorded,
                "keys_found": r.keys_found,
                "events_removed": r.events_removed,
                "changelog_files_rewritten": r.changelog_files_rewritten,
                "forgotten_rows_removed": r.forgotten_rows_removed,
                "quarantine_reasons_withheld": r.reasons_withheld,
                "delta_version": r.merge.history_version,
            }
            run.done(
                f"erased {len(config.keys)} key(s) ({r.keys_found} with events): "
                f"{r.events_removed} event(s) removed; the replaced files stay until a VACUUM "
                "past the retention",
                (),
                meta,
            )

    @dg.job(
        name=ERASE_JOB,
        description="Erase keys for a data subject's request: their rows and events leave the "
        "change log, the history, the current table, the quarantine and the ledgers, and are "
        "never logged again.",
    )
    def erase_key() -> None:
        erase_op()

    return erase_key
