"""Spark: the session with its non-negotiable settings, its pinned jars, and run costs."""
