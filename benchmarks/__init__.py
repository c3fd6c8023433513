"""Speed figures for cdc_platform, never timed tests: run each as ``python -m benchmarks.<name>``.

Every script uses one harness (``benchmarks.harness``): the landing data and configs it
generates, how it measures (time, process-tree memory, bytes committed), and how it prints
the figures beside the reference they are compared with.
"""
