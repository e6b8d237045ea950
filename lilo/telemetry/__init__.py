"""Always-on telemetry: the critical-path observer and its bounded accumulator."""
