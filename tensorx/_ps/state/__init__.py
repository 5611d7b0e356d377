"""One shard's memory, no I/O on the wire: its layout (:mod:`.shard_layout`), its arenas,
slots and optimizer (:mod:`.shard`), and its checkpoints: the files kept durable and
private (:mod:`.checkpoint`), what one holds (:mod:`.checkpoint_format`), and its optimizer
state judged before a resume (:mod:`.resume`)."""
