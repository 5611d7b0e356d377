"""What a worker and a shard agree on, imported by both sides: the control messages
(:mod:`.protocol`), the optimizer's hyperparameters and state as they travel
(:mod:`.hyper`, :mod:`.optim_state`), and the checksum of each update (:mod:`.checksum`).
Pure: no I/O."""
