"""The prefill kind against a real decode instance and against a decode socket the test
holds (which receives the handoff and never pulls): first token, handoff contents,
holds released after the pull, on abort, and at lease expiry."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from pdserve.common.frame_seal import TASKS, Sealer
from pdserve.common.messages import AbortTask, GenerateTask, InstanceAddress
from pdserve.common.sampling_params import SamplingParams
from pdserve.instance.loop import StepLoop
from pdserve.kvtransfer import KVHandoff
from tests.prefill.instances import Gateway, Running, reference_tokens, spec, until

pytestmark = pytest.mark.slow

LEASE = {"lease_s": 3.0, "heartbeat_interval_s": 0.5, "transfer_timeout_s": 1.5,
         "handshake_timeout_s": 1.5}  # fmt: skip
PROMPT = list(range(200, 240))  # 40 tokens: two full blocks and a partial one


class SilentDecode:
    """A decode instance's task socket that takes handoffs and never pulls."""

    def __init__(self, gateway: Gateway) -> None:
        self.socket = gateway.context.socket(zmq.PULL)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = InstanceAddress("silent-decode", "decode", f"tcp://127.0.0.1:{port}")
        self.decoder = msgspec.msgpack.Decoder(KVHandoff)
        self.opener = Sealer(TASKS, "silent-decode", responder=True)

    def receive(self, timeout_s: float = 10.0) -> KVHandoff | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return self.decoder.decode(self.opener.open(self.socket.recv()).payload)


@pytest.fixture(scope="module")
def pair(gateway) -> Iterator[tuple[Running, Running]]:
    prefill = Running(StepLoop(spec(gateway, "prefill-t", "prefill", kv_transfer=LEASE)))
    decode = Running(StepLoop(spec(gateway, "decode-t", "decode", kv_transfer=LEASE)))
    yield prefill, decode
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def silent(gateway) -> Iterator[SilentDecode]:
    decode = SilentDecode(gateway)
    yield decode
    decode.socket.close(linger=0)


def generate_to(gateway, runtime, request_id, target, prompt=PROMPT, **params) -> None:
    """A GenerateTask whose decode target may be any address (the test's socket too)."""
    max_tokens = params.pop("max_tokens", 4)
    params.setdefault("seed", 7)  # the gateway always sets one
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    task = GenerateTask(request_id, prompt, sampling, arrival_time=time.time(),
                        decode_target=target)  # fmt: skip
    gateway.send(runtime, task)


def test_first_token_from_prefill_rest_from_decode_and_the_hold_ends(gateway, pair) -> None:
    prefill, decode = pair
    gateway.generate(prefill.runtime, "r1", PROMPT, max_tokens=5, decode=decode.runtime)
    got = gateway.wait_finished("r1")
    assert gateway.tokens("r1") == reference_tokens(PROMPT, 5)
    by_index = {r.delta.output_index: r for r in got}
    assert by_index[0].instance == "prefill-t" and by_index[0].delta.finish_reason is None
    assert {r.instance for i, r in by_index.items() if i > 0} == {"decode-t"}
    assert by_index[0].at <= by_index[1].at
    assert by_index[4].delta.finish_reason == "length"
    # the prefill side let go of its blocks (into its prefix cache) once D had them
    books = gateway.idle_books(prefill.runtime)
    assert books.block_owners == {} and books.invariant_error is None
    assert books.num_cached_blocks >= 2 and books.num_free_blocks == books.num_total_blocks
    layout = decode.runtime.role.link.layout
    until(lambda: gateway.counter("decode-t", "kv_transfer_blocks_total") == 3, what="counters")
    assert gateway.counter("decode-t", "kv_transfer_bytes_total") == 3 * layout.bytes_per_block
    assert gateway.counter("prefill-t", "prompt_tokens_computed_total") == len(PROMPT)
    assert gateway.counter("decode-t", "prompt_tokens_computed_total") == 0
    assert gateway.idle_books(decode.runtime).block_owners == {}


def test_the_handoff_carries_what_decode_needs_and_abort_frees_the_hold(
    gateway, pair, silent
) -> None:
    prefill, _ = pair
    generate_to(gateway, prefill.runtime, "held", silent.address, logprobs=2)
    handoff = silent.receive()
    assert handoff is not None, "no handoff reached the decode socket"
    # The first token went to the gateway too, on its own socket: it may land after the
    # handoff reached decode.
    until(lambda: gateway.of("held"), what="the first token at the gateway")
    [first] = gateway.of("held")
    assert first.instance == "prefill-t" and first.delta.output_index == 0
    assert handoff.request_id == "held" and handoff.prompt_token_ids == PROMPT
    assert handoff.first_token_id == first.delta.new_token_ids[0]
    assert handoff.first_token_logprob == pytest.approx(first.delta.logprobs[0].logprob)
    assert set(handoff.first_token_top_logprobs) == set(first.delta.logprobs[0].top_ids)
    assert handoff.sampling_params.seed == 7 and handoff.sampling_params.max_tokens == 4
    source = handoff.source
    assert source.instance_id == "prefill-t" and source.layout == prefill.runtime.role.link.layout
    assert source.rank_addresses == prefill.runtime.role.link.rank_addresses
    assert len(source.block_ids) == 3
    books = gateway.inspect(prefill.runtime)
    assert books.unfinished_request_ids == ["held"]
    assert {b: o for b, o in books.block_owners.items()} == {b: ["held"] for b in source.block_ids}
    gateway.send(prefill.runtime, AbortTask(["held"]))
    books = gateway.idle_books(prefill.runtime)
    assert books.block_owners == {} and books.invariant_error is None


def test_a_first_token_that_ends_the_request_is_never_handed_off(gateway, pair, silent) -> None:
    prefill, _ = pair
    sent = prefill.runtime.role.handoffs_sent
    generate_to(gateway, prefill.runtime, "one", silent.address, max_tokens=1)
    [only] = gateway.wait_finished("one")
    assert only.delta.finish_reason == "length" and only.delta.output_index == 0
    assert silent.receive(timeout_s=0.5) is None
    assert prefill.runtime.role.handoffs_sent == sent
    assert gateway.idle_books(prefill.runtime).block_owners == {}


def test_a_retry_of_a_held_request_waits_for_the_earlier_attempt(gateway, pair, silent) -> None:
    prefill, decode = pair
    generate_to(gateway, prefill.runtime, "again", silent.address)
    assert silent.receive() is not None  # the first attempt holds its blocks
    gateway.send(prefill.runtime, AbortTask(["again"]))
    generate_to(gateway, prefill.runtime, "again", decode.runtime.address)
    got = gateway.wait_finished("again")
    assert [r.delta.error for r in got if r.delta.error] == []
    tokens = sorted((r.delta.output_index, r.delta.new_token_ids[0]) for r in got[1:])
    assert [t for _, t in tokens] == reference_tokens(PROMPT, 4)
    assert gateway.idle_books(prefill.runtime).block_owners == {}


def test_a_lease_that_runs_out_frees_the_blocks(gateway, pair, silent) -> None:
    prefill, _ = pair
    generate_to(gateway, prefill.runtime, "orphan", silent.address)
    assert silent.receive() is not None
    started = time.monotonic()
    assert gateway.inspect(prefill.runtime).unfinished_request_ids == ["orphan"]
    books = gateway.idle_books(prefill.runtime, timeout_s=LEASE["lease_s"] + 5)
    assert books.unfinished_request_ids == [] and books.block_owners == {}
    assert time.monotonic() - started >= LEASE["lease_s"] - 1.0  # not before the lease
    until(lambda: gateway.counter("prefill-t", "kv_transfer_lease_expiries_total") == 1,
          timeout_s=30.0, what="the lease expiry counter")  # fmt: skip
