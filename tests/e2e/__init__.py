"""End to end: the CLI, examples, docs, faults, network namespaces, load, the wheel."""
