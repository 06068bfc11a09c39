"""Capacity planning: memory, GPU counts and cost from a model config and a load profile."""
