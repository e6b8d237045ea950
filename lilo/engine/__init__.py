"""The engine: per-model ordered queues, the coalescing scheduler and the lanes around a backend (no Ray here)."""
