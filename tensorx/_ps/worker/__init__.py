"""The worker's side (:class:`tensorx.Worker`, :class:`tensorx.RemoteOptimizer`): its links
to the shards (:mod:`.links`), gradient buckets pushed during backward (:mod:`.buckets`), a
shard's memory mapped on the same host (:mod:`.samehost`), and the optimizer's state
fetched or loaded (:mod:`.optim_client`)."""
