"""Turns the logits of one step into next tokens.

Randomness is keyed on (request seed, output index): each sampled row draws its noise
from a generator seeded with both, so the token at output index i does not depend on
the batch it ran in or on which instance ran it (a prefill instance samples index 0,
the decode instance the rest, and together they equal a colocated run).
"""

from __future__ import annotations

import torch

from pdserve.common.messages import TokenLogprobs
from pdserve.common.request import Request

Tensor = torch.Tensor
_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, output_index: int) -> int:
    """Mixes (seed, index) into a 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def sample(
        self, logits: Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [len(requests), vocab] float32 → one token (and logprobs) per request.
        Logprobs are those of the logits given: after a structured-output mask, if any."""
        params = [r.sampling_params for r in requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_logit_bias(logits, requests)
        logits = self._suppress_stops_before_min_tokens(logits, requests)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample_random(logits[rows], [requests[i] for i in random_rows])
        token_list = tokens.tolist()
        logprobs = [
            None
            if p.logprobs is None or raw_logprobs is None
            else self._describe(raw_logprobs[i], token_list[i], p.logprobs)
            for i, p in enumerate(params)
        ]
        return token_list, logprobs

    # ---- logits processing ------------------------------------------------------------

    def _apply_penalties(self, logits: Tensor, requests: list[Request]) -> Tensor:
        rows = [
            i
            for i, r in enumerate(requests)
            if r.sampling_params.repetition_penalty != 1.0
            or r.sampling_params.presence_penalty
            or r.sampling_params.frequency_penalty
        ]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            req, p = requests[i], requests[i].sampling_params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device
                )
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
                out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.zeros(vocab, device=logits.device)
                counts.scatter_add_(0, out, torch.ones(len(out), device=logits.device))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    @staticmethod
    def _apply_logit_bias(logits: Tensor, requests: list[Request]) -> Tensor:
        """Each request's biases added to its row (after the raw logprobs were taken)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logit_bias]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            bias = requests[i].sampling_params.logit_bias or {}
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, values)
        return logits

    def _suppress_stops_before_min_tokens(self, logits: Tensor, requests: list[Request]) -> Tensor:
        cloned = False
        for i, req in enumerate(requests):
            p = req.sampling_params
            if req.num_output_tokens >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops |= req.eos_token_ids
            in_vocab = [t for t in stops if t < logits.shape[1]]
            if not in_vocab:
                continue
            # A complete structured output allows only its end: then the end it is.
            allowed = torch.isfinite(logits[i])
            if int(allowed.sum()) <= int(allowed[in_vocab].sum()):
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            logits[i, in_vocab] = float("-inf")
        return logits

    def _sample_random(self, logits: Tensor, requests: list[Request]) -> Tensor:
        params = [r.sampling_params for r in requests]
        device = logits.device
        temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=device)
        logits = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        if any(top_k):
            logits = self._keep_top_k(logits, top_k)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
            logits = self._keep_top_p(logits, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if bool((min_p > 0).any()):
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # Exponential race: argmax(p / q) with q ~ Exp(1) draws from p. The generator
        # lives on the logits' device (CUDA draws differ from CPU ones for one seed).
        noise = torch.empty_like(probs)
        for i, req in enumerate(requests):
            gen = torch.Generator(device=device)
            gen.manual_seed(noise_seed(req.seed, req.num_output_tokens))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _keep_top_k(logits: Tensor, top_k: list[int]) -> Tensor:
        vocab = logits.shape[1]
        k = torch.tensor([vocab if t <= 0 else min(t, vocab) for t in top_k], device=logits.device)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))

    @staticmethod
    def _keep_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first stays.
        drop = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _describe(row_logprobs: Tensor, token: int, num_top: int) -> TokenLogprobs:
        chosen = float(row_logprobs[token])
        rank = int((row_logprobs > chosen).sum()) + 1
        top_ids: list[int] = []
        top_logprobs: list[float] = []
        if num_top:
            top = row_logprobs.topk(num_top)
            # A structured-output mask leaves forbidden tokens at -inf: they are no
            # alternatives, and JSON has no infinity.
            for token_id, logprob in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if logprob != float("-inf"):
                    top_ids.append(token_id)
                    top_logprobs.append(logprob)
        return TokenLogprobs(
            token_id=token, logprob=chosen, rank=rank, top_ids=top_ids, top_logprobs=top_logprobs
        )


def describe_rows(logprobs: Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's logprob and rank of its token in `token_ids`, with its `num_top` most
    likely alternatives: the logprobs of tokens given rather than sampled (a prompt's)."""
    targets = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, targets)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=v, rank=r, top_ids=i, top_logprobs=tv)
        for t, v, r, i, tv in zip(
            token_ids, chosen[:, 0].tolist(), ranks, top_ids, top_values, strict=True
        )
    ]
