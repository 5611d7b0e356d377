"""Tests of the worker side (tensorx.worker, tensorx._ps.worker, RemoteOptimizer, shared memory)."""
