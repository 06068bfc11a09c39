"""The serving simulator: per-step latency models, a discrete-event simulation, placement search."""
