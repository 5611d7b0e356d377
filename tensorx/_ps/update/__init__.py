"""The math of a shard's update, no I/O: what the optimizer sees (:mod:`.optim`), one way
of stepping chosen per shard (:mod:`.step`: per tensor, flat parameters or flat ranges
(:mod:`.flat`), in parts (:mod:`.parts`)), the dense gradient folded (:mod:`.fold`), plain
SGD on sparse rows (:mod:`.rowsgd`, :mod:`.rowkernel`), and what a peer may put into an
optimizer (:mod:`.optim_check`)."""
