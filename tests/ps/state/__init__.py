"""Tests of a shard's state (tensorx._ps.state): shard layout and state, checkpoints."""
