"""Experiment scripts behind BENCHMARKS.md and the GPU check; not installed."""
