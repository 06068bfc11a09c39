"""Capacity planning and the simulator: sizes, prices and predicts deployments."""
