"""First-token latency of a long prompt per tenant: what cache isolation costs the second
tenant, and what the prefix cache saves the first.

    python -m experiments.tenant_isolation [--blocks 48] [--rounds 5]

Starts `pdserve serve` (colocated, the embedded model, `--api-keys-file` with tenants a
and b). Each round sends a fresh prompt of `--blocks` full KV blocks as tenant a (cold),
again as a (its own prefix cache: warm), then the same prompt as tenant b (isolated: it
must not hit a's blocks, so it pays a's cold cost). Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from experiments.serving import LOCAL, MODEL, served

KEYS = {"tenants": [{"name": "a", "keys": ["a-key"]}, {"name": "b", "keys": ["b-key"]}]}
BLOCK = 16


def first_token_s(base_url: str, key: str, prompt: list[int]) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                      timeout=120) as response:  # fmt: skip
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"a, first": [], "a, repeat": [], "b, same prompt": []}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        serve_args = (*LOCAL, "--mode", "colocated", "--num-colocated", "1",
                      "--max-model-len", "2048", "--api-keys-file", str(keys))  # fmt: skip
        with served(*serve_args, api_key="a-key") as server:
            for round_ in range(args.rounds):
                prompt = [1000 + 7 * round_ + i for i in range(args.blocks * BLOCK)]
                rows["a, first"].append(first_token_s(server.base_url, "a-key", prompt))
                rows["a, repeat"].append(first_token_s(server.base_url, "a-key", prompt))
                rows["b, same prompt"].append(first_token_s(server.base_url, "b-key", prompt))
    cold = statistics.median(rows["a, first"])
    print(f"{args.blocks * BLOCK}-token prompt, {args.rounds} rounds, median time to first token")
    print("| request | TTFT (ms) | / a's first |")
    print("|---|---|---|")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"| {name} | {1000 * median:.0f} | {median / cold:.2f} |")


if __name__ == "__main__":
    main()
