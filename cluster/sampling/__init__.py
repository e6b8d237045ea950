"""The sampling plane: the vLLM sampler actors (``actor``) and where they sit and what a trainer relays to them
(``plane``). It imports nothing of ``cluster.trainer``, which uses it."""
