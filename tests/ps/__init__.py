"""Tests of the parameter server (tensorx.ps, tensorx._ps), the worker and RemoteOptimizer."""
