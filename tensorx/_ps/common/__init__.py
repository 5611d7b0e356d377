"""Helpers a shard and a worker both use, neither side's own: the A/B timer and what it
remembers between runs, awaiting several things at once, step-time histograms, meeting
through the launcher's store, and where (CPU or which GPU) memory lives."""
