"""bench: `pdserve bench serve|sweep`, the load generator over HTTP. Torch-free.

`cli.py` (flags as `vllm bench serve`'s), `runner.py` and `client.py` (requests and
their timings), `datasets.py` and `rag.py` (random, sharegpt, jsonl, prefix_repetition,
rag), `arrivals.py` (Poisson and replayed arrivals), `metrics.py` (goodput against
SLOs, percentiles), `sweep.py` and `sweep_plot.py` (concurrency sweeps),
`server_metrics.py` (the server's `/metrics` around a run), `auth.py`
(`OPENAI_API_KEY`).
"""
