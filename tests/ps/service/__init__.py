"""Tests of a shard's service (tensorx._ps.service): admission, rounds, outbox, faults, metrics."""
