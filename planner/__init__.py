"""planner: `pdserve plan` and `pdserve bench calibrate`. Torch-free.

Memory (`memory.py`), capacity (`capacity.py`) and cost (`cost.py`) of a deployment
from a model's `config.json` (`model_config.py`), and the simulator (`sim/`:
`SimulatedPrefill`, `SimulatedDecode`, `SimulatedColocated`, calibrated step times,
the placement search; `elastic.py`: pools whose split a policy changes while it runs).
Calibration loads the public `pdserve.LLM` inside a function, so importing the planner
never loads torch.
"""
