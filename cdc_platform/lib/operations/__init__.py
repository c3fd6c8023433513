"""Operator operations: adopt, re-sync, truncate, un-apply and re-admit, plan, maintenance.

Each takes the table's handles and commits once; ``defs.operations.operator_run`` wires them
to Dagster jobs.
"""
