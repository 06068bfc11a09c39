"""One request's tokens and logprobs do not depend on the load: alone, inside a full
batch, with its prompt chunked at several token budgets, and from a prefix-cache hit,
its greedy and seeded outputs are the same to the bit (float32 and bfloat16 weights:
both run the row-invariant C kernels on CPU, bfloat16 on bf16 dot products where the
CPU has AVX512-BF16). On an AVX-512 machine the same holds on the AVX2 kernels
(PDSERVE_CPU_ISA=avx2, in a child process).
The two paths are not asserted equal to each other: torch's own CPU reductions (the
RMSNorm's mean, the sampler's softmax) sum in an order set by the vector width.

A 1P+1D handoff is checked against the offline engine in tests/cluster/test_pd_openai.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.common.sampling_params import SamplingParams

# ~150 tokens: several blocks, a tail that is not a whole block, and chunks at 16 and 37.
PROMPT = "The history of the river begins " + "with stories of kings, bridges and floods, " * 14
OTHERS = [f"Request {i}: say something about the number {i}. " * (1 + i % 4) for i in range(15)]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True
)


def outputs(dtype: str) -> dict[str, list]:
    """(tokens, logprobs with the top-2 of each position) of the greedy and the seeded
    request, under each load."""
    from pdserve import LLM

    def run(llm, others: list[str]) -> list:
        prompts = [PROMPT, PROMPT, *others]
        params = [GREEDY, SEEDED, *[GREEDY] * len(others)]
        result = []
        for out in llm.generate(prompts, params)[:2]:
            o = out.outputs[0]
            result.append(
                [o.token_ids, [[lp.logprob, lp.top_ids, lp.top_logprobs] for lp in o.logprobs]]
            )
        return result

    common = {"dtype": dtype, "kv_cache_memory": 256 << 20, "max_model_len": 1024}
    seen = {}
    llm = LLM(**common)
    seen["alone"] = run(llm, [])
    seen["prefix-cache hit"] = run(llm, [])
    seen["full batch"] = run(llm, OTHERS)
    del llm
    for budget in (16, 37):
        llm = LLM(**common, max_num_batched_tokens=budget)
        seen[f"chunks of {budget}"] = run(llm, OTHERS[:4])
        del llm
    return seen


def assert_invariant(seen: dict[str, list]) -> None:
    alone = seen["alone"]
    for load, got in seen.items():
        for which, (a, b) in zip(("greedy", "seeded"), zip(alone, got, strict=True), strict=True):
            assert b[0] == a[0], f"{which} tokens differ {load}"
            assert b[1] == a[1], f"{which} logprobs differ {load}"


def test_float32_outputs_do_not_depend_on_the_load():
    assert_invariant(outputs("float32"))


def test_bfloat16_outputs_do_not_depend_on_the_load():
    assert_invariant(outputs("bfloat16"))


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="the native path is the AVX2 path here")
def test_the_avx2_path_is_invariant_too():
    env = {**os.environ, "PDSERVE_CPU_ISA": "avx2"}
    code = (
        "import json; from tests.engine.test_load_invariance import outputs; "
        "print(json.dumps(outputs('float32')))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-2000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert_invariant(seen)
