"""Structured output on the engine side: the gate that holds requests while their grammar
compiles, the rank's grammar book (masks, replay, cache, errors) and the offline `LLM`."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured_output import StructuredOutput
from pdserve.engine.embedded import embedded_model_path
from pdserve.engine.grammar import GrammarBook, GrammarError
from pdserve.engine.grammar_gate import GrammarGate
from pdserve.text.tokenizer import Tokenizer
from tests.cluster.test_structured_openai import is_json_prefix

CHOICE = StructuredOutput(choice=("yes", "no"))


def _request(request_id: str, spec: StructuredOutput | None) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(structured_outputs=spec))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_structured_output_takes_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutput(choice=("a", ""))
    assert StructuredOutput(regex="a").key != StructuredOutput(grammar="a").key
    assert StructuredOutput(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="json and json_object only"):
        StructuredOutput(regex="a", disable_any_whitespace=True)
    spec = StructuredOutput(json_object=True)
    assert spec.key != StructuredOutput(json_object=True, disable_any_whitespace=True).key


def test_the_gate_holds_a_request_until_its_grammar_compiled() -> None:
    pending: Future = Future()
    entered: list[str] = []
    gate = GrammarGate(lambda spec: pending, timeout_s=5.0, clock=Clock())
    gate.admit(_request("plain", None), lambda: entered.append("plain"))
    gate.admit(_request("guided", CHOICE), lambda: entered.append("guided"))
    assert entered == ["plain"] and "guided" in gate and len(gate) == 1
    assert gate.poll() == [] and entered == ["plain"]
    pending.set_result(object())
    assert gate.poll() == [] and entered == ["plain", "guided"] and len(gate) == 0


def test_the_gate_fails_a_grammar_that_errs_or_runs_past_its_budget() -> None:
    clock = Clock()
    failing: Future = Future()
    slow: Future = Future()
    futures = {"bad": failing, "slow": slow}
    gate = GrammarGate(lambda spec: futures[spec.regex or ""], timeout_s=5.0, clock=clock)
    entered: list[str] = []
    gate.admit(_request("a", StructuredOutput(regex="bad")), lambda: entered.append("a"))
    gate.admit(_request("b", StructuredOutput(regex="slow")), lambda: entered.append("b"))
    failing.set_exception(GrammarError("the regex constraint does not compile: x"))
    [(request, reason)] = gate.poll()
    assert request.request_id == "a" and "does not compile" in reason
    clock.now = 6.0
    [(request, reason)] = gate.poll()
    assert request.request_id == "b" and "within 5 s" in reason
    assert entered == [] and len(gate) == 0


def test_an_aborted_request_leaves_the_gate() -> None:
    gate = GrammarGate(lambda spec: Future(), timeout_s=5.0)
    gate.admit(_request("a", CHOICE), lambda: pytest.fail("must not enter"))
    assert gate.abort("a") and not gate.abort("a") and gate.poll() == []


def test_a_rank_waits_a_bounded_time_for_a_grammar_it_needs(monkeypatch) -> None:
    """A rank's copy of a grammar that never compiles fails the step at the deadline
    instead of holding the rank (and its group) forever."""
    stuck = GrammarBook(str(embedded_model_path()), 49152, [0], compile_timeout_s=0.2)
    monkeypatch.setattr(stuck, "prepare", lambda spec: Future())
    started = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile on this rank within 0.2 s"):
        stuck.start("r", CHOICE, [])
    assert time.monotonic() - started < 5
    assert "r" not in stuck.matchers
    stuck.shutdown()


@pytest.fixture(scope="module")
def book():
    folder = str(embedded_model_path())
    tokenizer = Tokenizer.from_folder(folder)
    vocab = 49152  # the embedded model's
    book = GrammarBook(folder, vocab, tokenizer.eos_token_ids)
    yield book, tokenizer
    book.shutdown()


def test_the_mask_allows_exactly_the_grammars_next_tokens(book) -> None:
    book, tokenizer = book
    book.prepare(CHOICE).result(timeout=60)
    book.start("r", CHOICE, [])
    logits = torch.zeros(2, book.vocab_size)
    book.mask(logits, ["r", "free"])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert torch.isfinite(logits[1]).all()  # a request without a grammar is untouched
    book.drop("r")


def test_a_matcher_replays_the_tokens_sampled_elsewhere(book) -> None:
    """A decode instance receives the prefill instance's first token: its matcher must
    start past it, and a token the grammar forbids is refused."""
    book, tokenizer = book
    [first] = tokenizer.encode("y", add_special_tokens=False)
    book.start("r", CHOICE, [first])
    logits = torch.zeros(1, book.vocab_size)
    book.mask(logits, ["r"])
    allowed = {tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten()}
    assert allowed and all("es".startswith(t) for t in allowed), allowed
    [bad] = tokenizer.encode("x", add_special_tokens=False)
    with pytest.raises(GrammarError, match="breaks its grammar"):
        book.start("s", CHOICE, [bad])


def test_compiled_grammars_are_cached_and_errors_are_one_line(book) -> None:
    book, _ = book
    spec = StructuredOutput(regex="[0-9]+")
    assert book.prepare(spec) is book.prepare(StructuredOutput(regex="[0-9]+"))
    broken = book.prepare(StructuredOutput(grammar="root ::= ("))
    with pytest.raises(GrammarError) as caught:
        broken.result(timeout=60)
    message = str(caught.value)
    assert message.startswith("the grammar constraint does not compile") and "\n" not in message
    assert ".cc:" not in message


@pytest.fixture(scope="module")
def llm():
    from pdserve import LLM

    return LLM(num_threads=1, kv_cache_memory=32 << 20, max_model_len=512)


def test_offline_generation_follows_each_kind_of_constraint(llm) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    specs = [
        StructuredOutput(json=json.dumps(schema)),
        StructuredOutput(json_object=True),
        StructuredOutput(regex="[0-9]{3}-[a-z]{2}"),
        StructuredOutput(choice=("left", "right")),
        StructuredOutput(grammar='root ::= "a" ("b" | "c")'),
    ]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=s)
              for i, s in enumerate(specs)]  # fmt: skip
    results = [o.outputs[0] for o in llm.generate(["Answer:"] * len(specs), params)]
    outputs = [r.text for r in results]
    jsonschema.validate(json.loads(outputs[0]), schema)
    # Free-form JSON may run out of tokens: then it is still the start of an object.
    if results[1].finish_reason == "stop":
        assert isinstance(json.loads(outputs[1]), dict)
    else:
        assert outputs[1].startswith("{") and is_json_prefix(outputs[1]), outputs[1]
    assert outputs[2][:3].isdigit() and outputs[2][3] == "-" and len(outputs[2]) == 6
    assert outputs[3] in ("left", "right")
    assert outputs[4] in ("ab", "ac")


def test_offline_generation_raises_on_a_grammar_that_does_not_compile(llm) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutput(grammar="("))
    with pytest.raises(ValueError, match="does not compile"):
        llm.generate(["x"], params)
    assert not llm.engine.has_unfinished_requests()


def test_generation_config_names_where_sampling_defaults_come_from(tmp_path) -> None:
    from pdserve.engine.core import EngineCore

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_k": 7}')
    engine_args = dict(num_threads=1, kv_cache_memory=32 << 20, max_model_len=256)
    other = EngineCore(**engine_args, generation_config=str(tmp_path))
    bare = EngineCore(**engine_args, generation_config="vllm")
    assert other.info.generation_defaults == {"temperature": 0.3, "top_k": 7}
    assert bare.info.generation_defaults == {}
    other.shutdown()
    bare.shutdown()


def test_min_tokens_gives_way_to_a_complete_grammar(llm) -> None:
    """Once the constraint is complete only its end is allowed: min_tokens cannot forbid
    that too (the row would have no token left to sample)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=6, structured_outputs=StructuredOutput(
            choice=("yes", "no")),
    )  # fmt: skip
    [out] = [o.outputs[0] for o in llm.generate(["Answer:"], params)]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


CITY = {"type": "object", "properties": {"name": {"type": "string"},
        "population_millions": {"type": "number"}},
        "required": ["name", "population_millions"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize("compact", [False, True])
def test_a_float_field_ends_within_max_tokens(llm, compact: bool) -> None:
    """Greedy, the embedded model writes `123.0000000000000012300…` for this float when
    its digits are unbounded and separators compact: the number must end, and the object
    with it, whichever the whitespace policy."""
    spec = StructuredOutput(json=json.dumps(CITY), disable_any_whitespace=compact)
    params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=spec)
    messages = [{"role": "user", "content": "Tell me about Tokyo."}]
    [out] = [o.outputs[0] for o in llm.chat(messages, params)]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), CITY)
    assert ("\n" not in out.text) == compact, out.text  # free whitespace, and this model uses it
