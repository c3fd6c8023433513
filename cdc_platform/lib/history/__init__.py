"""The history engine: the change log, the fold of docs/HISTORY_MODE.md and the merge.

``changelog`` keeps every event that ever landed; ``versions`` folds a key's events into
versions (rules 1-3); ``merge/`` brings the history table up to date, stage by stage;
``invariants`` checks the result (section 6); ``current_table`` and ``provenance`` are views
of it.
"""
