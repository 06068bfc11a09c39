"""One colocated server shared by the gateway tests (loading weights takes seconds).

One torch thread per instance: the test machine is shared, and OpenMP threads that
compete for busy cores slow a step down many times. fp32 so greedy outputs match the
offline engine exactly (bfloat16 has near-ties); max-model-len 512 so over-long
prompts are cheap to build. After every module the server must be idle with every KV
block free or cached (ARCHITECTURE.md's invariant); modules opt in with
`pytestmark = pytest.mark.usefixtures("idle_after_module")`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from experiments.serving import ServeProcess, served

MAX_MODEL_LEN = 512
TTFT_SLO_MS = 30_000  # exported for the alert rules; changes nothing else
SERVER_ARGS = (
    "--mode", "colocated", "--launcher", "local", "--num-colocated", "1",
    "--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-model-len", str(MAX_MODEL_LEN),
    "--enable-test-hooks", "--threads-per-instance", "1", "--ttft-slo-ms", str(TTFT_SLO_MS),
)  # fmt: skip


@pytest.fixture(scope="session")
def server() -> Iterator[ServeProcess]:
    with served(*SERVER_ARGS, exit_zero=True) as process:
        yield process


@pytest.fixture(scope="module")
def idle_after_module(server: ServeProcess) -> Iterator[None]:
    """Modules that drive the shared server use this: it checks the invariant after them."""
    yield
    server.assert_blocks_free_or_cached()


@pytest.fixture(scope="session")
def offline_llm():
    """The single-instance engine, the oracle for greedy outputs."""
    from pdserve import LLM

    return LLM(
        dtype="float32", num_threads=1, kv_cache_memory=64 << 20, max_model_len=MAX_MODEL_LEN
    )
