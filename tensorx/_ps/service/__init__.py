"""The shard's side (:class:`tensorx.ParameterServer`): one object assembled from parts
(:mod:`.core`). Pure cores that decide: when to update and answer (:mod:`.schedule`, the
sync barrier), a round applied part by part (:mod:`.round`), who may join
(:mod:`.admission`), a load of optimizer state (:mod:`.optim_load`). The I/O around them:
sessions (:mod:`.loop`, :mod:`.session`), steps (:mod:`.steps`, :mod:`.pipelined`),
answers (:mod:`.answer`, :mod:`.outbox`, :mod:`.samehost`), and the checks between
averaging and the step (:mod:`.nonfinite`, :mod:`.grads`, :mod:`.norm_exchange`)."""
