"""Internals of :mod:`tensorx.graph_analyzer` (pure planning, no I/O)."""
