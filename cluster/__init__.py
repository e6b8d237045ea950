"""Ray-side pieces of lilo: the local cluster, the trainer, futures DB, timing and recovery actors, placement, and
the service's start and stop."""
