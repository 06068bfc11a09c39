"""The `serve` section of the device check: `pdserve serve --launcher local` with one
prefill and one decode instance sharing the GPU, the KV moving over UCX (CUDA memory to
CUDA memory) and over the zmq copy, each against a colocated server on the same model.

A synthetic checkpoint (`experiments.gpu_model`) is written to a temporary folder and
served with `--model FOLDER`. The three servers start at once; then every prompt goes to
each in turn, greedy, one request at a time. Per transport the table gives: the text
equal to the colocated server's, KV bytes and blocks per request, the mean pull time
(`pdserve:kv_transfer_seconds` on the decode side: the handoff), and the median request
time beside the colocated server's. The decode side must compute no prompt token (the
KV really moved: `--kv-failure-policy fail`, so a broken transfer cannot hide behind a
recompute) and no transfer may fail. A transport the machine refuses (its package
missing, UCX built without CUDA) is skipped with the reason.
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.gpu_model import model_shape, prompt_text, write_checkpoint
from experiments.gpu_outcome import Outcome
from experiments.serving import ServeProcess, tail

TRANSPORTS = ("ucx", "zmq")
TOPOLOGY = {
    "colocated": ("--mode", "colocated", "--num-colocated", "1"),
    "ucx": ("--num-prefill", "1", "--num-decode", "1", "--kv-transport", "ucx"),
    "zmq": ("--num-prefill", "1", "--num-decode", "1", "--kv-transport", "zmq"),
}
NAME = "synthetic"
BLOCK_SIZE = 16


def transport_refusal(transport: str, device: torch.device) -> str | None:
    """Why this machine cannot move KV over `transport`, or None."""
    if transport == "zmq":
        try:
            import zmq  # noqa: F401
        except ImportError as exc:
            return f"pyzmq does not import ({exc})"
        return None
    try:
        import ucxx._lib.libucxx as ucx
    except ImportError as exc:
        return f"ucxx does not import ({exc})"
    try:
        context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
    except Exception as exc:  # UCX reports a refused context by its own exception classes
        return f"UCX context refused: {type(exc).__name__}: {exc}"
    if device.type == "cuda" and not context.cuda_support:
        return "UCX here has no CUDA support (UCXContext.cuda_support is False)"
    return None


def server_args(model: str, device: torch.device, dry_run: bool) -> tuple[str, ...]:
    memory = (
        ("--kv-cache-memory", "32MiB")
        if device.type == "cpu"
        else ("--gpu-memory-utilization", "0.1")  # three servers share the GPU
    )
    return (
        "--model", model, "--served-model-name", NAME, "--dtype", "float32",
        "--launcher", "local", "--threads-per-instance", "1", "--device", device.type,
        "--max-model-len", "512" if dry_run else "2048", "--kv-failure-policy", "fail",
        "--enable-test-hooks",  # /debug/instances: wait until every instance is idle
        *memory,
    )  # fmt: skip


def prompts(vocab_size: int, dry_run: bool) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 40, 100] if dry_run else [5, 40, 300, 1000]
    ids = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    return [prompt_text(i) for i in ids]


def complete(server: ServeProcess, prompt: str, max_tokens: int) -> tuple[str, float]:
    """Greedy text and the request's seconds."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    began = time.perf_counter()
    response = server.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code} from {server.base_url}: {response.text}")
    return response.json()["choices"][0]["text"], time.perf_counter() - began


def metric(server: ServeProcess, name: str, role: str) -> float:
    """A metric summed over every instance of `role`."""
    pattern = rf'^pdserve:{name}{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, server.get("/metrics").text, re.M))


@dataclass
class TransportRow:
    transport: str
    equal: int
    requests: int
    kv_bytes: float
    blocks: float
    pull_ms: float
    request_ms: float
    problems: list[str]


def measure(
    transport: str,
    server: ServeProcess,
    texts: list[str],
    baseline: list[str],
    block_bytes: int,
    max_tokens: int,
) -> TransportRow:
    results = [complete(server, p, max_tokens) for p in texts]
    server.wait_idle()
    moved = metric(server, "kv_transfer_bytes_total", "decode")
    pulls = metric(server, "kv_transfer_seconds_count", "decode")
    problems = [f"request {i}: text differs from colocated" for i, ((text, _), want)
                in enumerate(zip(results, baseline, strict=True)) if text != want]  # fmt: skip
    for role in ("prefill", "decode"):
        if failures := metric(server, "kv_transfer_failures_total", role):
            problems.append(f"{failures:.0f} failed transfers ({role})")
    if recomputed := metric(server, "prompt_tokens_computed_total", "decode"):
        problems.append(f"the decode side computed {recomputed:.0f} prompt tokens")
    if moved <= 0 or moved % block_bytes:
        problems.append(f"{moved:.0f} KV bytes moved, not whole blocks of {block_bytes}")
    seconds = metric(server, "kv_transfer_seconds_sum", "decode")
    return TransportRow(
        transport, len(texts) - sum("text differs" in p for p in problems), len(texts),
        moved / len(texts), moved / block_bytes / len(texts),
        1e3 * seconds / pulls if pulls else float("nan"),
        1e3 * statistics.median(s for _, s in results), problems,
    )  # fmt: skip


def start_servers(names: list[str], args: tuple[str, ...]) -> dict[str, ServeProcess]:
    """All at once (their start-up dominates the section); any that fails stops the rest."""
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(ServeProcess.start, *TOPOLOGY[n], *args) for n in names}
    servers, errors = {}, []
    for name, future in futures.items():
        try:
            servers[name] = future.result()
        except RuntimeError as exc:  # the whole log tail to the section's log, a line here
            print(f"--- {name} server did not come up ---\n{exc}", file=sys.stderr)
            errors.append(f"{name} server did not come up: {str(exc).splitlines()[-1]}")
    if errors:
        stop_servers(servers)
        raise RuntimeError("; ".join(errors))
    return servers


def print_server_logs(servers: dict[str, ServeProcess]) -> None:
    """Each server's log tail to the section's log: why a request failed lies there."""
    for name, server in servers.items():
        print(f"--- {name} server log ---\n{tail(server.log_path, 120)}", file=sys.stderr)


def stop_servers(servers: dict[str, ServeProcess]) -> None:
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda s: s.stop(timeout_s=20), servers.values()))


def print_table(rows: list[TransportRow], colocated_ms: float, where: str) -> None:
    print(f"  KV in {where} memory; colocated median request {colocated_ms:.1f} ms")
    print(f"  {'transport':<9} {'equal':>7} {'KV bytes/req':>13} {'blocks/req':>10} "
          f"{'pull ms':>8} {'request ms':>10}")  # fmt: skip
    for r in rows:
        print(f"  {r.transport:<9} {r.equal:>3}/{r.requests:<3} {r.kv_bytes:>13,.0f} "
              f"{r.blocks:>10.1f} {r.pull_ms:>8.2f} {r.request_ms:>10.1f}")  # fmt: skip
        for problem in r.problems:
            print(f"    FAIL {problem}")


def run_section(device: torch.device, dry_run: bool) -> Outcome:
    cfg = model_shape(dry_run)
    refused = {t: why for t in TRANSPORTS if (why := transport_refusal(t, device))}
    runnable = [t for t in TRANSPORTS if t not in refused]
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    block_bytes = kv_per_token * BLOCK_SIZE * 4  # float32
    max_tokens = 8 if dry_run else 16
    print("pdserve serve --launcher local, 1 prefill + 1 decode against 1 colocated, greedy:")
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        model = write_checkpoint(Path(tmp) / "model", cfg)
        texts = prompts(cfg.vocab_size, dry_run)
        servers = start_servers(["colocated", *runnable], server_args(model, device, dry_run))
        try:
            base = [complete(servers["colocated"], p, max_tokens) for p in texts]
            want = [text for text, _ in base]
            rows = [measure(t, servers[t], texts, want, block_bytes, max_tokens) for t in runnable]
        except Exception:
            print_server_logs(servers)
            raise
        finally:
            stop_servers(servers)
    print_table(rows, 1e3 * statistics.median(s for _, s in base), device.type)
    for transport, why in refused.items():
        print(f"  {transport:<9} skipped: {why}")
    failed = [f"{r.transport}: {r.problems[0]}" for r in rows if r.problems]
    short = [i for i, (text, _) in enumerate(base) if len(text.split()) != max_tokens]
    if short:  # an empty baseline would make every comparison pass
        failed.insert(0, f"colocated: requests {short} did not return {max_tokens} words")
    if failed:
        return Outcome.failed("; ".join(failed))
    if refused:
        ran = ", ".join(f"{t} ok" for t in runnable) or "no transport ran"
        refusals = "; ".join(f"{t} refused: {w}" for t, w in refused.items())
        return Outcome.skipped(f"{refusals}; {ran}")
    return Outcome.ok()
