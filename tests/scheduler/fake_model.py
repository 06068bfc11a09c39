"""A stand-in for the model runner that keeps a paged "KV cache" of token ids.

Each chunk checks that the KV of its earlier positions is really in its blocks (the
prefix cache or earlier chunks put it there), writes its own positions, and — when it
samples — derives the next token from what it reads back through the block table. A
scheduler that hands out the wrong blocks, reuses a block still in use, or loses track
of what is computed therefore produces different tokens or fails these checks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.scheduler.outputs import SchedulerOutput
from pdserve.scheduler.step_scheduler import Scheduler


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int | None = 16,
    salt: str = "",
    eos: frozenset[int] = frozenset(),
    **params: object,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=eos,
        cache_salt=salt,
    )


def next_token(context: list[int], vocab: int) -> int:
    """A deterministic 'model': the next token as a function of the whole context."""
    digest = hashlib.sha256(repr(context).encode()).digest()
    return int.from_bytes(digest[:4], "little") % vocab


class FakeModel:
    def __init__(self, scheduler: Scheduler, vocab: int = 1000) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.config.block_size
        self.vocab = vocab
        # slot contents per block: the token id at that position, or None
        self.kv: list[list[int | None]] = [
            [None] * self.block_size for _ in range(scheduler.config.num_blocks)
        ]
        self.tokens_computed = 0
        self.mixed_steps = 0
        # (request id, start, num_new_tokens, samples) of every chunk executed
        self.chunk_log: list[tuple[str, int, int, bool]] = []

    def slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        return block_ids[position // self.block_size], position % self.block_size

    def read(self, block_ids: list[int], end: int) -> list[int | None]:
        return [self.kv[b][o] for b, o in (self.slot(block_ids, p) for p in range(end))]

    def write(self, block_ids: list[int], start: int, tokens: list[int]) -> None:
        for position, token in enumerate(tokens, start):
            block, offset = self.slot(block_ids, position)
            self.kv[block][offset] = token

    def execute(
        self, output: SchedulerOutput, choose: Callable[[Request, list[int]], int] | None = None
    ) -> dict[str, int]:
        owners = self.scheduler.block_manager.owners()
        sampled: dict[str, int] = {}
        prefills = decodes = 0
        for chunk in output.chunks:
            request, rid = chunk.request, chunk.request.request_id
            assert len(chunk.block_ids) * self.block_size >= chunk.end, f"{rid}: too few blocks"
            cached = self.read(chunk.block_ids, chunk.start)
            assert cached == request.tokens_between(0, chunk.start), f"{rid}: stale KV"
            first_written = chunk.start // self.block_size
            last_written = (chunk.end - 1) // self.block_size
            for block in chunk.block_ids[first_written : last_written + 1]:
                assert owners[block] == {rid}, f"{rid} writes block {block} of {owners[block]}"
            self.write(chunk.block_ids, chunk.start, request.tokens_between(chunk.start, chunk.end))
            self.tokens_computed += chunk.num_new_tokens
            self.chunk_log.append((rid, chunk.start, chunk.num_new_tokens, chunk.samples))
            is_decode = chunk.num_new_tokens == 1 and request.num_output_tokens > 0
            decodes += is_decode
            prefills += not is_decode
            if chunk.samples:
                context = self.read(chunk.block_ids, chunk.end)
                assert None not in context
                token = next_token(context, self.vocab)  # type: ignore[arg-type]
                sampled[rid] = token if choose is None else choose(request, context)
        self.mixed_steps += bool(prefills and decodes)
        return sampled

    def fill_remote(self, block_ids: list[int], request: Request, start: int, end: int) -> None:
        """Plays the KV transfer: writes the remote tokens' KV into the pulled blocks."""
        self.write(block_ids, start, request.tokens_between(start, end))

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        output = self.scheduler.schedule()
        self.scheduler.check_invariants()
        left = self.scheduler.update_from_output(output, self.execute(output))
        self.scheduler.check_invariants()
        return output, left

    def run_to_completion(self, max_steps: int = 10_000) -> list[SchedulerOutput]:
        outputs = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return outputs
            outputs.append(self.step()[0])
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def reference_output(prompt: list[int], max_tokens: int, vocab: int = 1000) -> list[int]:
    """What any correct schedule must produce for a request with no eos."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, vocab))
    return tokens[len(prompt) :]
