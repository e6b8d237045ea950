"""The Tinker API under /api/v1: the typed requests, and one part of the control plane per area (training, sampling,
runs and checkpoints, sessions, heartbeats, timing) over the cluster's actors. Builds on serve.http."""
