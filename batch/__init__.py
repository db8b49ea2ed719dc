"""vbatch.batch: batch files in and out (readers, validation, writers, ordering, resume, shards) for `vbatch run`."""
