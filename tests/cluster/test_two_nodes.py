"""Two nodes: `pdserve serve --ray-address` on a two-node Ray cluster (node B
in a network namespace of its own), the prefill pool pinned to node A and the decode
pool to node B by custom resources, KV over UCX TCP between the two addresses.

Needs root for `ip netns`: skipped (saying so) without it; as root, a refused
`ip netns` fails the test rather than hiding the check.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections.abc import Iterator

import pytest

from experiments.serving import MODEL, ServeProcess, served
from experiments.two_nodes import (
    HEAD_IP,
    NAMESPACE,
    NODE_B_IP,
    NODE_ENV,
    TwoNodes,
    established,
    listening,
    two_nodes,
)
from pdserve.common.sampling_params import SamplingParams
from tests.cluster.conftest import in_network_namespace

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a",
]
MAX_TOKENS = 24
# Both pools' actors are of the role-neutral class (ss shows 15 characters of a name).
INSTANCE = "ray::Instance"
WILDCARDS = {"*", "0.0.0.0", "::"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    yield from in_network_namespace(lambda: two_nodes(tmp_path_factory.mktemp("two-nodes")))


@pytest.fixture(scope="module")
def server(cluster: TwoNodes) -> Iterator[ServeProcess]:
    with served(
        "--ray-address", cluster.address, "--num-prefill", "1", "--num-decode", "1",
        "--prefill-resources", '{"node_a": 1}', "--decode-resources", '{"node_b": 1}',
        "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
        "--threads-per-instance", "1", "--enable-test-hooks",
        env=NODE_ENV, clean=True,
    ) as process:  # fmt: skip
        yield process


@pytest.fixture(scope="module")
def greedy() -> dict[str, str]:
    """The single-node run: the offline engine in this process."""
    from pdserve import LLM

    llm = LLM(dtype="float32", num_threads=1, kv_cache_memory=64 << 20, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


class Connections:
    """Polls `ss` on node A while requests run; keeps every connection it saw."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.seen.update(established())
            self._stop.wait(0.05)

    def __enter__(self) -> Connections:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def ip(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")


def test_pools_on_two_nodes_serve_the_single_node_greedy_text(server, greedy) -> None:
    client = server.openai()

    def complete(prompt: str) -> str:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return result.choices[0].text

    with Connections() as connections, concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
    assert texts == greedy

    # Each pool is where its resources put it.
    instances = server.instances()
    assert {i["role"] for i in instances.values()} == {"prefill", "decode"}
    # One instance on each node; which is where shows in the KV's direction below.
    b_listeners, a_listeners = listening(NAMESPACE), listening(None)
    assert any(process == INSTANCE for _, process in b_listeners), b_listeners
    assert any(process == INSTANCE for _, process in a_listeners), a_listeners

    # KV moved over TCP from node A's prefill instance to node B: a connection the
    # prefill process opened to node B beyond the one ZMQ socket it has there (its
    # handoffs to D's task socket, which the gateway reaches too).
    gateway_ports = {peer for _, peer, proc in connections.seen if proc == "python"}
    to_b = {
        peer
        for local, peer, proc in connections.seen
        if proc == INSTANCE and ip(local) == HEAD_IP and ip(peer) == NODE_B_IP
    }
    assert to_b - gateway_ports, (to_b, gateway_ports)

    metrics = server.get("/metrics").text
    for role in ("prefill", "decode"):
        moved = re.findall(
            rf'^pdserve:kv_transfer_bytes_total{{[^}}]*role="{role}"[^}}]*}} (\S+)$',
            metrics,
            re.MULTILINE,
        )
        assert moved and float(moved[0]) > 0, (role, moved)


def test_no_instance_listens_only_on_loopback(server) -> None:
    for namespace, node_ip in ((None, HEAD_IP), (NAMESPACE, NODE_B_IP)):
        addresses = {ip(local) for local, proc in listening(namespace) if proc == INSTANCE}
        # Its task, event and KV control sockets and UCX's TCP sockets are all on its
        # node's address; only Ray's own worker server listens on every interface.
        assert addresses - WILDCARDS == {node_ip}, (node_ip, addresses)
    gateway = {ip(local) for local, proc in listening() if proc == "python"}
    assert HEAD_IP in gateway  # the output socket instances on node B push to
