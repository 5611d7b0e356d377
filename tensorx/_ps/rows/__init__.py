"""The dynamic (sparse) path end to end: the rows a worker stages and pushes and a shard
receives (:mod:`.sparse`), the rows kept per table (:mod:`.tables`), which rows each update
changed (:mod:`.changed`), and the pull of only those (:mod:`.pull`)."""
