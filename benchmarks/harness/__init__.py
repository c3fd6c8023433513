"""The benchmarks' one harness: ``generate`` (landing data, configs, cached tables),
``measure`` (time, process-tree memory, Delta commit bytes, the Dagster CLI), ``report``
(printing figures and targets) and ``deployment`` (the services as ``deploy/`` wires them)."""
