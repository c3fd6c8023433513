"""The platform's own errors: one base, and the refusals a run's input can meet.

A ``Refusal`` is raised before anything is written (or once what was written is whole): the
request cannot be done as asked, and its message says what to do instead. The Dagster layer
fails the run with that message alone, no traceback (``defs.jobs.skeleton.refused``). Anything
else is a fault and keeps its traceback.
"""


class PlatformError(Exception):
    """Every error the platform raises on purpose."""


class Refusal(PlatformError, ValueError):
    """A request refused as asked: nothing half-done, and the message says why and what to do
    instead (a ``ValueError`` too, as the refusals were before they had a base)."""
