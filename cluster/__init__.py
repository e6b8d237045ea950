"""Ray-side pieces of lilo: the local cluster, and (in later work) the trainer, futures DB and timing actors."""
