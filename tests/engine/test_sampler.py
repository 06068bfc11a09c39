"""The sampler on hand-made logits: each knob changes exactly what it should."""

import math

import pytest
import torch

from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sampler import Sampler, describe_rows, noise_seed


def _req(rid="r", prompt=(1, 2), out=(), seed=7, eos=frozenset({0}), **params):
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=eos, seed=seed)
    r.output_token_ids = list(out)
    return r


def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 4.0]])
    tokens, lps = Sampler().sample(logits, [_req(temperature=0), _req(temperature=0)])
    assert tokens == [1, 0] and lps == [None, None]


def test_seeded_sampling_depends_only_on_seed_and_output_index():
    logits = torch.randn(1, 1000)
    s = Sampler()
    first = [s.sample(logits, [_req(seed=3, out=[5] * i)])[0][0] for i in range(20)]
    again = [s.sample(logits, [_req(seed=3, out=[5] * i)])[0][0] for i in range(20)]
    # Same position in a different batch (another row before it) gives the same token.
    mixed = [
        s.sample(logits.repeat(2, 1), [_req(seed=99), _req(seed=3, out=[5] * i)])[0][1]
        for i in range(20)
    ]
    other = [s.sample(logits, [_req(seed=4, out=[5] * i)])[0][0] for i in range(20)]
    assert first == again == mixed
    assert first != other
    assert len(set(first)) > 5  # temperature 1 over 1000 flat-ish logits really varies


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    counts = torch.zeros(4)
    n = 4000
    for i in range(n):
        counts[Sampler().sample(logits, [_req(seed=i)])[0][0]] += 1
    for p, c in zip(probs.tolist(), counts.tolist(), strict=True):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    s = Sampler()
    seen_k = {s.sample(logits, [_req(seed=i, top_k=2)])[0][0] for i in range(300)}
    assert seen_k == {0, 1}
    # probs ≈ .64 .24 .09 .03 .01: top_p .8 keeps the first two (mass before #3 is .87)
    seen_p = {s.sample(logits, [_req(seed=i, top_p=0.8)])[0][0] for i in range(300)}
    assert seen_p == {0, 1}
    seen_min_p = {s.sample(logits, [_req(seed=i, min_p=0.3)])[0][0] for i in range(300)}
    assert seen_min_p == {0, 1}  # .09 < .3 × .64


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.9, -1.0]])
    req = _req(prompt=[0], out=[1], temperature=0, repetition_penalty=2.0)
    # token 0 falls to 1.0 < 1.9, so token 2 wins
    assert Sampler().sample(logits, [req])[0] == [2]
    assert Sampler()._apply_penalties(logits, [req])[0].tolist() == pytest.approx(
        [1.0, -4.0, 1.9, -1.0]
    )


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    req = _req(prompt=[3, 3], out=[1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    got = Sampler()._apply_penalties(logits, [req])[0].tolist()
    assert got == [0.0, -1.25, -0.75, 0.0]


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]])
    early = _req(out=[1], temperature=0, min_tokens=3, stop_token_ids=[2])
    late = _req(out=[1, 1, 1], temperature=0, min_tokens=3, stop_token_ids=[2])
    assert Sampler().sample(logits.repeat(2, 1), [early, late])[0] == [1, 0]


def test_logprobs_report_raw_distribution_rank_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, lps = Sampler().sample(logits, [_req(temperature=0, logprobs=2)])
    want = torch.log_softmax(logits[0], -1)
    lp = lps[0]
    assert tokens == [1] and lp.token_id == 1 and lp.rank == 1
    assert lp.logprob == pytest.approx(float(want[1]))
    assert lp.top_ids == [1, 2]
    assert lp.top_logprobs == pytest.approx([float(want[1]), float(want[2])])


def test_noise_seed_mixes_both_inputs():
    seeds = {noise_seed(s, i) for s in range(30) for i in range(30)}
    assert len(seeds) == 900 and all(0 <= x < 2**63 for x in seeds)


def test_logit_bias_moves_the_choice_but_not_the_logprobs():
    logits = torch.tensor([[4.0, 3.0, 2.0]])
    biased = _req(temperature=0, logprobs=1, logit_bias={2: 5.0})
    tokens, lps = Sampler().sample(logits, [biased])
    assert tokens == [2]
    # The logprobs are the model's raw distribution (vLLM's default `raw_logprobs`).
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lps[0].logprob == pytest.approx(float(raw[2])) and lps[0].rank == 3
    banned = _req(temperature=0, logit_bias={0: -100.0})
    assert Sampler().sample(logits, [banned])[0] == [1]
    # Another row of the batch keeps its own logits.
    both = Sampler().sample(logits.repeat(2, 1), [biased, _req(temperature=0)])[0]
    assert both == [2, 0]


def test_describe_rows_scores_given_tokens_with_ranks_and_alternatives():
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]]), dim=-1)
    rows = describe_rows(logprobs, [2, 2], 2)
    assert [r.token_id for r in rows] == [2, 2] and [r.rank for r in rows] == [2, 1]
    assert rows[0].logprob == pytest.approx(float(logprobs[0, 2]))
    assert rows[0].top_ids == [1, 2] and rows[1].top_ids[0] == 2
    assert describe_rows(logprobs, [0, 1], 0)[1].top_ids == []
