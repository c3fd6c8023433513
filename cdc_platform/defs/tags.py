"""Names that cross the Dagster layer's roles: the run tags the sensors and jobs put on runs
(the alerts and the in-flight checks read them back), and the landing backlog's metadata keys
the per-table sensor reports and the source alerts read.

Dagster's own tag names are spelled out: the installed Dagster exports no public constant for
them.
"""

PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
TABLE_TAG = "cdc_platform/table"
REASON_TAG = "cdc_platform/reason"

# Metadata of the landing backlog, reported on the table's asset as an observation when it
# changes (the asset's page charts it): hours landed and not yet applied, the oldest's age.
BACKLOG_HOURS = "landing/unapplied_hours"
BACKLOG_OLDEST = "landing/oldest_unapplied_hour"
BACKLOG_AGE = "landing/oldest_unapplied_minutes"
BACKLOG_SINCE = "landing/unapplied_since"  # epoch seconds the oldest was first requested
