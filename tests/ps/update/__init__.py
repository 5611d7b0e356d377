"""Tests of a shard's update (tensorx._ps.update): flat update, row kernel, row SGD, optimizers."""
