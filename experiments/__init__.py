"""Experiment scripts behind BENCHMARKS.md and the GPU check; not installed.

Run them from a checkout (`python -m experiments.NAME`); product code never imports
them, and they import nothing from `tests/`. The GPU check (`gpu_check.py`) runs each
section in a process of its own (`gpu_sections.py`), with the serving wheels for a GPU
machine without network from `gpu_wheels.sh`. The real-server code the tests share
with the scripts: `serving.py` (`ServeProcess`, `served`), `two_nodes.py` and
`otlp_receiver.py` (an OTLP/HTTP trace receiver in process).
"""
