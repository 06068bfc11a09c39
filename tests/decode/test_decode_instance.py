"""The decode kind: handoffs from a real prefill instance (pull only what the local
prefix cache lacks, continuous batching, aborts) and handcrafted ones that cannot be
served (another KV layout, an unreachable prefill instance under each failure policy,
a handoff voided by an abort before it arrived); a request migrated here with its output
so far, whose aborted pull still held its id; FP8 KV blocks handed off between two FP8
instances, and refused by a 16-bit one."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest

from pdserve.common.messages import AbortTask, GenerateTask
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.instance.loop import StepLoop
from pdserve.kvtransfer import KVHandoff, KVSource
from tests.prefill.instances import ENGINE, Gateway, Running, reference_tokens, spec, until

pytestmark = pytest.mark.slow

LIMITS = {"lease_s": 4.0, "heartbeat_interval_s": 0.5, "transfer_timeout_s": 2.0,
          "handshake_timeout_s": 0.5}  # fmt: skip
PROMPT = list(range(300, 340))  # two full blocks and a partial one


@pytest.fixture(scope="module")
def instances(gateway) -> Iterator[dict[str, Running]]:
    running = {
        "prefill": Running(StepLoop(spec(gateway, "p", "prefill", kv_transfer=LIMITS))),
        "decode": Running(StepLoop(spec(gateway, "d", "decode", kv_transfer=LIMITS))),
        "strict": Running(
            StepLoop(
                spec(gateway, "d-fail", "decode", kv_transfer={**LIMITS, "failure_policy": "fail"})
            )
        ),
    }
    yield running
    for instance in running.values():
        instance.stop()


@pytest.fixture(scope="module")
def fp8_instances(gateway) -> Iterator[dict[str, Running]]:
    engine = EngineConfig(**ENGINE, kv_cache_dtype="fp8")
    running = {
        role: Running(
            StepLoop(spec(gateway, f"{role[0]}8", role, engine=engine, kv_transfer=LIMITS))
        )  # fmt: skip
        for role in ("prefill", "decode")
    }
    yield running
    for instance in running.values():
        instance.stop()


def unreachable_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def crafted(decode: StepLoop, request_id: str, prompt: list[int], first: int,
            source_id: str = "p-gone", **layout_changes) -> KVHandoff:  # fmt: skip
    """A handoff from a prefill instance that is not there."""
    layout = msgspec.structs.replace(decode.role.link.layout, **layout_changes)
    blocks = list(range(-(-len(prompt) // layout.block_size)))
    source = KVSource(source_id, [unreachable_address()], blocks, layout)
    return KVHandoff(request_id=request_id, prompt_token_ids=prompt, first_token_id=first,
                     sampling_params=SamplingParams(max_tokens=4, temperature=0.0, seed=7),
                     source=source)  # fmt: skip


def blocks_pulled(gateway: Gateway) -> float:
    return gateway.counter("d", "kv_transfer_blocks_total")


def test_pulls_only_the_blocks_the_local_prefix_cache_lacks(gateway, instances) -> None:
    prefill, decode = instances["prefill"].runtime, instances["decode"].runtime
    expected = reference_tokens(PROMPT, 4)
    pulled = []
    for request_id in ("first", "second"):
        before = gateway.counter("d", "kv_transfer_blocks_total")
        gateway.generate(prefill, request_id, PROMPT, max_tokens=4, decode=decode)
        gateway.wait_finished(request_id)
        assert gateway.tokens(request_id) == expected
        until(lambda: blocks_pulled(gateway) > before, what="the pull")  # noqa: B023
        pulled.append(blocks_pulled(gateway) - before)
    # the two full prompt blocks stayed in D's prefix cache: only the partial one moves again
    assert pulled == [3, 1]
    moved = 4 * decode.role.link.layout.bytes_per_block
    until(lambda: gateway.counter("d", "kv_transfer_bytes_total") == moved, what="bytes")
    assert gateway.counter("d", "prompt_tokens_computed_total") == 0
    assert gateway.counter("d", "kv_transfer_failures_total") == 0


def test_concurrent_handoffs_decode_in_one_batch(gateway, instances) -> None:
    prefill, decode = instances["prefill"].runtime, instances["decode"].runtime
    prompts = {f"c{i}": [400 + 13 * i + j for j in range(20 + 7 * i)] for i in range(6)}
    for request_id, prompt in prompts.items():
        gateway.generate(prefill, request_id, prompt, max_tokens=6, decode=decode)
    for request_id, prompt in prompts.items():
        gateway.wait_finished(request_id)
        assert gateway.tokens(request_id) == reference_tokens(prompt, 6), request_id
    books = gateway.idle_books(decode)
    assert books.block_owners == {} and books.invariant_error is None
    assert gateway.idle_books(prefill).block_owners == {}


def test_abort_mid_decode_frees_both_sides(gateway, instances) -> None:
    prefill, decode = instances["prefill"].runtime, instances["decode"].runtime
    gateway.generate(prefill, "long", PROMPT[:20], max_tokens=200, decode=decode,
                     ignore_eos=True)  # fmt: skip
    until(lambda: len(gateway.of("long")) >= 3, timeout_s=30, what="decoding")
    for instance in (prefill, decode):
        gateway.send(instance, AbortTask(["long"], handoffs_from="p"))
    assert gateway.idle_books(decode).block_owners == {}
    count = len(gateway.of("long"))
    time.sleep(0.5)
    assert len(gateway.of("long")) <= count + 1  # at most the step already under way
    assert not any(r.delta.finished for r in gateway.of("long"))
    assert gateway.idle_books(prefill).block_owners == {}


def test_another_kv_layout_fails_the_request_before_anything_is_allocated(
    gateway, instances
) -> None:
    decode = instances["decode"].runtime
    gateway.send(decode, crafted(decode, "odd", PROMPT, 1, dtype="bfloat16", num_layers=12))
    [error] = gateway.wait_finished("odd")
    assert error.delta.finish_reason == "error" and error.delta.output_index == 1
    assert "KV layout mismatch with prefill instance p-gone" in error.delta.error
    assert "num_layers 12 there vs 30 here" in error.delta.error
    assert "dtype bfloat16 there vs float32 here" in error.delta.error
    books = gateway.inspect(decode)
    assert books.unfinished_request_ids == [] and books.block_owners == {}


def test_an_unreachable_prefill_instance_under_recompute_prefills_here(gateway, instances) -> None:
    decode = instances["decode"].runtime
    prompt = list(range(900, 933))  # nothing of it cached here
    expected = reference_tokens(prompt, 4)
    computed = gateway.counter("d", "prompt_tokens_computed_total")
    before = gateway.latest_stats("d")
    gateway.send(decode, crafted(decode, "lost", prompt, expected[0]))
    got = gateway.wait_finished("lost")
    assert [r.delta.error for r in got] == [None] * len(got)
    assert [t for r in got for t in r.delta.new_token_ids] == expected[1:]
    assert min(r.delta.output_index for r in got) == 1
    until(lambda: gateway.counter("d", "kv_transfer_recomputed_requests_total") == 1,
          what="recompute counter")  # fmt: skip
    assert gateway.counter("d", "prompt_tokens_computed_total") - computed == len(prompt)
    assert gateway.counter("d", "kv_transfer_failures_total") == 1
    assert gateway.idle_books(decode).block_owners == {}
    # Its stats say so beside the counter: the gateway's /health and recompute gauge.
    stats = gateway.latest_stats("d")
    assert stats.kv_pulls_recomputed == before.kv_pulls_recomputed + 1
    assert stats.kv_pulls_recent == before.kv_pulls_recent + 1
    assert "no handshake reply from prefill instance p-gone" in stats.kv_pull_last_failure


def test_an_unreachable_prefill_instance_under_fail_ends_the_request(gateway, instances) -> None:
    strict = instances["strict"].runtime
    gateway.send(strict, crafted(strict, "doomed", PROMPT, 5))
    [error] = gateway.wait_finished("doomed")
    assert error.delta.finish_reason == "error" and error.delta.output_index == 1
    assert error.delta.error.startswith("KV transfer failed: ")
    assert "no handshake reply from prefill instance p-gone" in error.delta.error
    books = gateway.idle_books(strict)
    assert books.block_owners == {} and books.num_free_blocks == books.num_total_blocks
    assert gateway.counter("d-fail", "prompt_tokens_computed_total") == 0
    stats = gateway.latest_stats("d-fail")  # a failed pull, but nothing recomputed
    assert (stats.kv_pulls_recent, stats.kv_pulls_recomputed) == (1, 0)
    assert "no handshake reply" in stats.kv_pull_last_failure


def test_a_handoff_voided_by_an_abort_is_dropped_but_a_retry_is_not(gateway, instances) -> None:
    decode = instances["decode"].runtime
    expected = reference_tokens(PROMPT, 4)
    gateway.send(decode, AbortTask(["late"], handoffs_from="p-old"))
    gateway.send(decode, crafted(decode, "late", PROMPT, expected[0], source_id="p-old"))
    time.sleep(1.0)  # past the handshake timeout: it would have ended by now
    assert gateway.of("late") == []
    assert gateway.inspect(decode).unfinished_request_ids == []
    # the same request retried through another prefill instance is served
    gateway.send(decode, crafted(decode, "late", PROMPT, expected[0], source_id="p-new"))
    got = gateway.wait_finished("late")
    assert [t for r in got for t in r.delta.new_token_ids] == expected[1:]


def test_a_migrated_request_waits_for_its_aborted_pull_then_goes_on(gateway, instances) -> None:
    decode = instances["decode"].runtime
    expected = reference_tokens(PROMPT, 4)
    handoff = crafted(decode, "moved", PROMPT, expected[0])  # its prefill instance is gone
    gateway.send(decode, handoff)
    until(lambda: "moved" in gateway.inspect(decode).unfinished_request_ids, what="the pull")
    # The gateway saw the prefill instance die: it drops the request here, then migrates
    # it here with the tokens its client already has, as output.
    gateway.send(decode, AbortTask(["moved"], handoffs_from="p-gone"))
    migrated = GenerateTask("moved", PROMPT, handoff.sampling_params, arrival_time=time.time(),
                            output_token_ids=expected[:2])  # fmt: skip
    gateway.send(decode, migrated)
    got = gateway.wait_finished("moved")
    assert [r.delta.error for r in got] == [None] * len(got)
    assert [t for r in got for t in r.delta.new_token_ids] == expected[2:]
    assert min(r.delta.output_index for r in got) == 2
    assert gateway.idle_books(decode).block_owners == {}


def _fp8_reference(prompt: list[int], max_tokens: int) -> list[int]:
    from pdserve.engine.core import EngineCore

    engine = EngineCore(**ENGINE, kv_cache_dtype="fp8")
    request = engine.make_request("ref", prompt, SamplingParams(max_tokens=max_tokens,
                                                                 temperature=0))  # fmt: skip
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return list(request.output_token_ids)


def test_fp8_blocks_are_handed_off_and_a_16_bit_decode_refuses_them(
    gateway, instances, fp8_instances
) -> None:
    prefill, decode = fp8_instances["prefill"].runtime, fp8_instances["decode"].runtime
    layout = decode.role.link.layout
    wide = instances["decode"].runtime.role.link.layout
    assert layout.dtype == "float8_e4m3fn" and layout.k_scales == [1.0] * layout.num_layers
    assert layout.bytes_per_block * 4 == wide.bytes_per_block  # of float32's (bf16's: half)
    gateway.generate(prefill, "fp8", PROMPT, max_tokens=4, decode=decode)
    gateway.wait_finished("fp8")
    assert gateway.tokens("fp8") == _fp8_reference(PROMPT, 4)
    moved = 3 * layout.bytes_per_block  # 40 prompt tokens: 3 blocks
    until(lambda: gateway.counter("d8", "kv_transfer_bytes_total") == moved, what="bytes")
    assert gateway.counter("d8", "prompt_tokens_computed_total") == 0
    print(f"FP8 handoff of {len(PROMPT)} prompt tokens: {moved} bytes "
          f"(float32 cache: {3 * wide.bytes_per_block})")  # fmt: skip
    gateway.generate(prefill, "mixed", PROMPT[:20], max_tokens=4,
                     decode=instances["decode"].runtime)  # fmt: skip
    error = gateway.wait_finished("mixed")[-1]  # after the first token, from p8
    assert error.delta.finish_reason == "error"
    assert (
        "KV layout mismatch with prefill instance p8: dtype float8_e4m3fn there vs float32 "
        "here (--kv-cache-dtype must be the same on both)"
    ) in error.delta.error
