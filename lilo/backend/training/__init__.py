"""A training pass's parts: the losses and their inputs, target logprobs, recomputed layers, the pass budget and
the memory cap."""
