"""eval: `pdserve eval compare`. Torch-free.

One set of prompts, greedy and seeded, against a baseline and a candidate
OpenAI-compatible server (`client.py`, `compare.py`); each reply scored by its item's
kind (`scoring.py`: exact match, the choice named, JSON validity, repetition loops in
long generations), per category and overall (`summary.py`), the drop in percentage
points and its verdict (`verdict.py`: <= 1.5 normal, 1.5-3 look at the categories, > 3
roll back). The dataset format is `items.py`; the shipped set, made for
SmolLM2-135M-Instruct, is written by `dataset.py` into `data/smollm2_quality.jsonl`
from `words.py`.
"""
