"""No tenant hits another's prefix-cache blocks: on a real `pdserve serve` with a keys
file, tenant A's repeat of a long prompt is served
from the prefix cache (the positive control), while tenant B's identical prompt finds
nothing cached: its hit counter and computed-prompt-token count equal a first sight's.
The salt is the gateway's HMAC of the tenant, so a `cache_salt` B chooses cannot reach
A's blocks either."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT = [1000 + i for i in range(20 * BLOCK)]  # 20 full blocks of token ids
KEYS = {"tenants": [{"name": "a", "keys": ["a-key"]}, {"name": "b", "keys": ["b-key"]}]}
ARGS = (*LOCAL, "--mode", "colocated", "--num-colocated", "1", "--dtype", "float32",
        "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
        "--block-size", str(BLOCK))  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with served(*ARGS, "--api-keys-file", str(keys), api_key="a-key", clean=True) as process:
        yield process


def counters(server: ServeProcess) -> tuple[float, float]:
    """(prefix-cache hits, prompt tokens computed) summed over instances."""
    text = server.get("/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^pdserve:{name}{{.*}} (\S+)$", text, re.M))

    return total("prefix_cache_hits_total"), total("prompt_tokens_computed_total")


def send(server: ServeProcess, key: str, **extra: object) -> tuple[float, float]:
    """The counters' growth from one request of PROMPT by the tenant with `key`."""
    before = counters(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **extra}
    response = server.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10  # the instance's counters come with its outputs
    while True:
        after = counters(server)
        grown = (after[0] - before[0], after[1] - before[1])
        if sum(grown) >= len(PROMPT) or time.monotonic() > deadline:
            return grown
        time.sleep(0.1)


def test_a_tenant_never_hits_another_tenants_blocks(server: ServeProcess) -> None:
    first = send(server, "a-key")
    assert first == (0, len(PROMPT))  # nobody cached it yet
    hits, computed = send(server, "a-key")
    assert hits >= len(PROMPT) - BLOCK and computed <= BLOCK  # positive control: A's own repeat
    assert send(server, "b-key") == first  # B: as if nobody had cached it
    assert send(server, "b-key", cache_salt="")[0] > 0  # B's own repeat hits B's blocks
    assert send(server, "b-key", cache_salt="x") == first  # a salt only narrows
