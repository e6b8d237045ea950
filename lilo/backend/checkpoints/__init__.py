"""Checkpoints: an adapter's saved state, their paths, and the index of what a run saved."""
