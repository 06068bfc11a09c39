"""A request resumed from its output so far (a migrated request: `GenerateTask.
output_token_ids`) samples exactly the tokens an uninterrupted run would have, greedy
or seeded with penalties: sampling is keyed on (seed, output index), and the penalties
and stop checks see the output it carries."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core import EngineCore

PROMPT = [1, 504, 3458, 282, 4649, 314]  # any short prompt of the embedded model
PARAMS = {
    "greedy": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(
        max_tokens=24, temperature=0.8, seed=1234, frequency_penalty=0.5, ignore_eos=True
    ),
}


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineCore]:
    engine = EngineCore(num_threads=1, kv_cache_memory=16 << 20, max_model_len=256)
    yield engine
    engine.shutdown()


def generate(engine: EngineCore, request_id: str, params, output=None) -> list[int]:
    request = engine.make_request(request_id, PROMPT, params, output_token_ids=output)
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return list(request.output_token_ids)


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_resumed_request_goes_on_as_if_never_interrupted(engine, kind) -> None:
    params = PARAMS[kind]
    whole = generate(engine, f"whole-{kind}", params)
    assert len(whole) == params.max_tokens
    for cut in (1, 9):
        resumed = generate(engine, f"resumed-{kind}-{cut}", params, whole[:cut])
        assert resumed == whole, (kind, cut)


def test_output_outside_the_vocabulary_is_refused(engine) -> None:
    with pytest.raises(ValueError, match="output holds token id"):
        engine.make_request("bad", PROMPT, PARAMS["greedy"], output_token_ids=[10**9])
