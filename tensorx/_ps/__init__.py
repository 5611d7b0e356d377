"""Parameter-server internals: control messages, scheduling, shard state, sparse and
bucketed transfers, rendezvous. The public names live in :mod:`tensorx.ps` and
:mod:`tensorx.worker`."""
