"""The offline Python API, shaped like vLLM's:

    from pdserve import LLM, SamplingParams
    llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

This is a front end: it tokenizes, runs one `EngineCore` to completion, detokenizes
and applies stop strings (instances stop on token ids and lengths only).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from pdserve.common.messages import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams, generation_config_defaults
from pdserve.engine.core import EngineCore
from pdserve.engine.model_source import resolve_model
from pdserve.text.choice import ChoiceText, choice_seeds
from pdserve.text.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    # Shortcuts to the first (usually only) completion.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(kw_only=True)
class _Tracked(ChoiceText):
    """Front-end state of one engine request (one of a prompt's n completions)."""

    prompt_index: int
    completion_index: int


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        revision: str | None = None,
        download_dir: str | None = None,
        **engine_args,
    ):
        """`model`: a checkpoint folder or a Hugging Face id (from its cache; see
        `engine.model_source`); None: the embedded model."""
        if model is not None:
            model = str(resolve_model(model, revision, download_dir))
        self.engine = EngineCore(model=model, dtype=dtype, seed=seed, **engine_args)
        self.tokenizer = Tokenizer.from_folder(self.engine.model_path)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults applied."""
        return SamplingParams(**generation_config_defaults(self.engine.info.generation_defaults))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = self._as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        return self._run(prompt_list, encoded, params)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        nested = messages and isinstance(messages[0], list)
        conversations = cast(list[list[dict[str, Any]]], messages if nested else [messages])
        texts = [
            self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for conv in conversations
        ]
        # The template already holds the special tokens (bos etc.): add none on top.
        encoded = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        params = self._params_per_prompt(sampling_params, len(texts))
        return self._run(texts, encoded, params)

    # ---- internals ------------------------------------------------------------------

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            return [prompts]
        return list(prompts)

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            return self._encode(prompt["prompt"])
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def _run(
        self, prompts: list, encoded: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        tracked: dict[str, _Tracked] = {}
        try:
            for index, (ids, sp) in enumerate(zip(encoded, params, strict=True)):
                # No seed: None each, and the engine draws them from its own seeded generator.
                for completion, seed in enumerate(choice_seeds(sp.seed, sp.n)):
                    request_id = f"{next(self._ids)}"
                    child = sp if seed == sp.seed else _with_seed(sp, seed)
                    request = self.engine.make_request(request_id, ids, child)
                    self.engine.add_request(request)
                    tracked[request_id] = _Tracked.for_params(
                        self.tokenizer, sp, prompt_index=index, completion_index=completion
                    )
            while self.engine.has_unfinished_requests():
                if not self.engine.scheduler.has_unfinished_requests():
                    time.sleep(0.002)  # only grammars compiling: leave their thread the GIL
                for delta in self.engine.step():
                    if delta.finish_reason == "error":  # e.g. a grammar that did not compile
                        raise ValueError(delta.error or "the engine failed the request")
                    if tracked[delta.request_id].absorb(delta).end_request:
                        self.engine.finish_request(delta.request_id)  # a stop string matched
        except BaseException:
            for request_id, state in tracked.items():
                if not state.finished:
                    self.engine.abort_request(request_id)
            raise
        return self._collect(prompts, encoded, tracked)

    def _collect(self, prompts, encoded, tracked: dict[str, _Tracked]) -> list[RequestOutput]:
        results = [
            RequestOutput(str(i), p if isinstance(p, str) else None, ids, [])
            for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True))
        ]
        for state in tracked.values():
            result = results[state.prompt_index]
            result.num_cached_tokens = state.num_cached_tokens
            if state.prompt_logprobs is not None and state.completion_index == 0:
                result.prompt_logprobs = [None, *state.prompt_logprobs]
            cumulative = (
                sum(lp.logprob for lp in state.logprobs) if state.logprobs is not None else None
            )
            result.outputs.append(
                CompletionOutput(
                    index=state.completion_index,
                    text=state.stream.text,
                    token_ids=state.token_ids,
                    cumulative_logprob=cumulative,
                    logprobs=state.logprobs,
                    finish_reason=state.finish_reason,
                    stop_reason=state.stop_reason,
                )
            )
        for result in results:
            result.outputs.sort(key=lambda c: c.index)
        return results


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)
