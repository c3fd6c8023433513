"""The merge's constants and working-column names (never stored: under the internal
prefix, never a source name). The bottom of the package: every stage imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_platform.lib.columns import HISTORY_SYSTEM_COLUMNS, STATE_COLUMNS, internal
from cdc_platform.lib.storage import delta

if TYPE_CHECKING:
    pass


APP_ID = "cdc_platform/changelog"


# History files are smaller than the change log's: a late event rewrites whole closed files.
HISTORY_ROWS_PER_FILE = delta.ROWS_PER_FILE // 4


COMMIT_ATTEMPTS = delta.COMMIT_ATTEMPTS


FAULT_ENV = "CDC_PLATFORM_FAULT"


SYSTEM_COLUMNS = (*HISTORY_SYSTEM_COLUMNS, *STATE_COLUMNS)


# Working columns of the merge, never stored, under the internal prefix (never a source name).
FILE = internal("file")


MIN_MS = internal("min_ms")


SLOW = internal("slow")


SEGMENT = internal("segment")


OLD_FILE = internal("old_file")


OLD_SYNCED = internal("old_synced")


OLD_ACTIVE = internal("old_active")


# A version's restated valid time (``fold._restated``): from, to, and whether it had closed.
RESTATED_FROM = internal("restated_from")
RESTATED_TO = internal("restated_to")
RESTATED_CLOSED = internal("restated_closed")


DELETE_ONLY = internal("delete_only")


FORCED = internal("forced")


MARKED = internal("marked")  # a key's pending events carry an unmodified marker (rule 1)


CHECKPOINT = internal("checkpoint")


# The seq of a replayed version (``_slow_events``): below any logged event of its millisecond.
REPLAY_SEQ = -(2**63)


# Column of the retracted-keys side table: the change-log version its removal commit followed.
AFTER_LOG_VERSION = "_cdc_after_log_version"


# In a history commit's metadata: the keys it recomputed (a JSON list; a small run's only), so
# that the checks after the run verify those keys (``invariants.touched_keys``).
TOUCHED_KEYS = "cdc_platform.touched_keys"


MAX_TOUCHED_KEYS_BYTES = 32_768  # the log is read by every reader: keep its commits small
