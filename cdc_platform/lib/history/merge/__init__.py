"""Bringing the history table up to date with the change log, as one atomic Delta commit.

The history table records, in each commit, the change-log version it reflects (a Delta app
transaction). Whatever was logged after that version is *pending*. A run costs what the pending
events touch, not what the table holds:

* **Files by segment.** Every history file holds rows of one segment only: *live* (active
  rows), *deleted* (the last version of a deleted key) or *closed* (every version that is no
  longer a key's latest). The live and deleted segments hold one row per key at most; the
  closed segment only grows by appends. File statistics (min = max of ``_fivetran_active`` and
  ``_cdc_current``) say which segment a file is, so readers skip the closed part of
  ``WHERE _fivetran_active`` and a run never opens a closed file unless it must.
* **Fast path.** A key whose pending events are all later than the last event it received
  (``_cdc_last_event_at`` on its current row) is folded from its current row alone: the row
  stands in for the key's whole past (its image, whether it is live, and when it last changed).
  Such a key never reads the change log nor a closed file.
* **Slow path.** A key with a pending event at or before its last event (a late event, even in
  the same millisecond) is refolded from the change log. Only its versions ending at or after
  the earliest late event can change (``unchanged_before``): closed files are clustered by the
  time their versions ended, so those that ended earlier are neither read nor rewritten, and
  an hour's late events rewrite the recent closed files only. The refold starts from the
  key's latest version read that started before its late event, replayed (``_slow_events``),
  so the change-log files logged before it are skipped too.
* **Keys with no version.** A key whose every event is a delete has no row in the table, yet
  its deletes matter if an older insert lands later. Such keys, with their last event time,
  are kept in a small side table (``delete_only_keys``) so that a new key can be told from one.
* **Retracted keys.** Un-applying a landing file (``lib.operations.unapply``) takes its events out of
  the change log, so a key may lose events without gaining any. Such keys are listed in a side
  table (``retracted_keys``) with the change-log version the removal followed; until the
  history table has caught up past it, they are recomputed (slow path), even with no event left.

Only files holding a row that changes are rewritten (copy-on-write); rows that stay as they
were keep their ``_fivetran_synced``. Removes and adds are committed together with the new
watermark. A crash at any point leaves the previous version intact, and the next run finds the
same pending work.
"""

from cdc_platform.lib.history.merge.apply import apply_pending, record_settings
from cdc_platform.lib.history.merge.classify import unchanged_before
from cdc_platform.lib.history.merge.columns import (
    APP_ID,
    COMMIT_ATTEMPTS,
    FAULT_ENV,
    HISTORY_ROWS_PER_FILE,
    TOUCHED_KEYS,
)
from cdc_platform.lib.history.merge.side_tables import (
    drop_caught_up_retractions,
    record_retracted_keys,
    stamp_delete_only_keys,
)
from cdc_platform.lib.history.merge.snapshot import (
    RESTATED_KEYS,
    HistoryColumnsError,
    MergeResult,
    Restated,
    fault_point,
    is_closed_file,
    table_relative,
)
from cdc_platform.lib.history.merge.write import write_segments

__all__ = [
    "APP_ID",
    "COMMIT_ATTEMPTS",
    "FAULT_ENV",
    "HISTORY_ROWS_PER_FILE",
    "RESTATED_KEYS",
    "TOUCHED_KEYS",
    "HistoryColumnsError",
    "MergeResult",
    "Restated",
    "apply_pending",
    "drop_caught_up_retractions",
    "fault_point",
    "is_closed_file",
    "record_retracted_keys",
    "record_settings",
    "stamp_delete_only_keys",
    "table_relative",
    "unchanged_before",
    "write_segments",
]
