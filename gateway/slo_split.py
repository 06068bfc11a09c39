"""Each prefill:decode split of the budget scored against the SLOs with the latency model.

Closed form per split, no simulation, so a 128-instance budget scores in well under a
millisecond's worth of arithmetic per split:

- TTFT: the forecast prompts over p prefill instances, each computing at most
  `max_num_batched_tokens` per step (its throughput from the prefill step model at that
  batch, per band of prompt lengths): the own compute time of the longest band's
  prompts (among bands with `MIN_CLASS_SHARE` of the requests), plus an M/G/c queueing
  wait at that load (the service times' spread from the bands' and each band's second
  moment), plus the time to drain what is queued now.
- ITL: the decode concurrency per instance that Little's law gives at the forecast
  output-token rate (the bands' context weighted by the tokens each decodes), solved
  against the decode step model (each step gives every
  running sequence one token, so the step time is the ITL); the requests running now
  are spread over the split's decode instances and are a floor. The KV usage now,
  spread the same way, guards it: a pool predicted past the limit is at risk.

A margin is 1 - predicted / SLO (1: idle, 0: at the SLO, negative: over it); an
overloaded pool (utilisation at or past 1, more sequences than seats) scores below any
finite prediction, and worse the more it is overloaded, so even among splits that all
miss the SLOs the least overloaded wins. Headroom is the smaller of the two margins.
"""

from __future__ import annotations

import math

import msgspec

from pdserve.gateway.slo_types import Forecast, Observation, PolicyConfig
from pdserve.planner.sim.latency import Calibration, prefill_pairs

# Below any margin a finite prediction gets: the worst finite margin is clipped here.
OVERLOAD_MARGIN = -10.0
# A band of prompt lengths with at least this share of the requests sets the TTFT: the
# requests of a rarer band may miss it (each such band costs at most this share).
MIN_CLASS_SHARE = 0.05


class SplitScore(msgspec.Struct, frozen=True):
    prefill: int
    decode: int
    ttft_ms: float  # predicted; inf when the prefill pool is overloaded
    itl_ms: float  # predicted; inf when the decode pool is overloaded
    ttft_margin: float
    itl_margin: float

    @property
    def headroom(self) -> float:
        return min(self.ttft_margin, self.itl_margin)

    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


def feasible_splits(config: PolicyConfig) -> list[tuple[int, int]]:
    """Splits within the floors and maxima using as much of the budget as they allow."""
    max_prefill = config.max_prefill if config.max_prefill is not None else config.instance_budget
    max_decode = config.max_decode if config.max_decode is not None else config.instance_budget
    total = min(config.instance_budget, max_prefill + max_decode)
    return [
        (prefill, total - prefill)
        for prefill in range(config.min_prefill, min(max_prefill, total) + 1)
        if config.min_decode <= total - prefill <= max_decode
    ]


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits in an M/M/c queue (`offered` = arrival rate x service)."""
    blocking = 1.0  # Erlang B, built up one server at a time
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    utilisation = offered / servers
    return blocking / (1.0 - utilisation * (1.0 - blocking))


def margin(predicted: float, slo: float) -> float:
    return max(1.0 - predicted / slo, OVERLOAD_MARGIN)


def overload_margin(utilisation: float) -> float:
    return OVERLOAD_MARGIN - utilisation


class SplitScorer:
    """Predicts TTFT and ITL of a split for a forecast and the pools' state now."""

    def __init__(self, config: PolicyConfig, calibration: Calibration) -> None:
        self.config = config
        self.prefill_model = calibration.prefill
        self.decode_model = calibration.decode

    def score(self, prefill: int, decode: int, load: Forecast, now: Observation) -> SplitScore:
        ttft_s, ttft_margin = self.predict_ttft(prefill, load, now)
        itl_s, itl_margin = self.predict_itl(decode, load, now)
        return SplitScore(prefill, decode, ttft_s * 1e3, itl_s * 1e3, ttft_margin, itl_margin)

    def score_all(self, load: Forecast, now: Observation) -> list[SplitScore]:
        """Every feasible split, scored, in order of prefill instances."""
        return [self.score(p, d, load, now) for p, d in feasible_splits(self.config)]

    def prompt_seconds(self, prompt: float) -> float:
        """One prompt alone on a prefill instance, chunked at the token budget."""
        budget = self.config.max_num_batched_tokens
        remaining, done, seconds = max(1, round(prompt)), 0, 0.0
        while remaining > 0:
            chunk = min(remaining, budget)
            seconds += self.prefill_model.predict(chunk, prefill_pairs(chunk, done))
            remaining, done = remaining - chunk, done + chunk
        return seconds

    def prefill_tokens_per_s(self, prompt: float) -> float:
        """A prefill instance's throughput with full steps of prompts this long."""
        budget = self.config.max_num_batched_tokens
        length = max(1, round(prompt))
        if length >= budget:
            return length / self.prompt_seconds(length)
        per_step = budget // length
        pairs = per_step * prefill_pairs(length)
        return per_step * length / self.prefill_model.predict(per_step * length, pairs)

    def predict_ttft(self, prefill: int, load: Forecast, now: Observation) -> tuple[float, float]:
        slo_s = self.config.ttft_slo_ms / 1e3
        classes = load.by_class()
        rate = sum(c.rate for c in classes)
        weights = [c.rate / rate if rate > 0 else 1.0 / len(classes) for c in classes]
        # An instance's time per prompt of each band at full steps.
        services = [
            max(c.prompt_tokens, 1.0) / self.prefill_tokens_per_s(c.prompt_tokens) for c in classes
        ]
        service = sum(w * s for w, s in zip(weights, services, strict=True))
        offered = rate * service  # instances' worth of prefill work
        if offered >= prefill:
            return math.inf, overload_margin(offered / prefill)
        # M/G/c (Lee and Longton): the M/M/c wait scaled by (1 + cv^2) / 2 of the prompts'
        # service times, which a mix of short and long prompts makes large. Within a band,
        # a service time varies as its prompt length does.
        square = sum(
            w * s * s * max(c.prompt_tokens_sq / max(c.prompt_tokens, 1.0) ** 2, 1.0)
            for w, s, c in zip(weights, services, classes, strict=True)
        )
        variation = square / (service * service) - 1.0
        wait = (1.0 + variation) / 2.0 * erlang_c(prefill, offered) * service / (prefill - offered)
        backlog = now.prefill.queued * service / prefill
        # The longest prompts that are not rare: their requests miss the SLO first.
        own = max(
            self.prompt_seconds(max(c.prompt_tokens, 1.0))
            for w, c in zip(weights, classes, strict=True)
            if w >= MIN_CLASS_SHARE or w == max(weights)
        )
        seconds = own + wait + backlog
        return seconds, margin(seconds, slo_s)

    def predict_itl(self, decode: int, load: Forecast, now: Observation) -> tuple[float, float]:
        slo_s = self.config.itl_slo_ms / 1e3
        model = self.decode_model
        classes = load.by_class()
        # Decode tokens per second, and the mean context a decode step reads per sequence
        # (weighted by the tokens each band decodes).
        output_rate = sum(c.rate * max(c.output_tokens - 1.0, 0.0) for c in classes)
        weighted = sum(
            c.rate * max(c.output_tokens - 1.0, 0.0) * (c.prompt_tokens + c.output_tokens / 2.0)
            for c in classes
        )
        context = (
            weighted / output_rate
            if output_rate > 0
            else load.prompt_tokens + load.output_tokens / 2.0
        )
        tokens_per_s = output_rate / decode
        per_sequence = model.per_token_s + model.per_pair_s * context
        busy = tokens_per_s * per_sequence  # step time spent per second on sequences
        if busy >= 1.0:
            return math.inf, overload_margin(1.0 + busy)
        concurrency = tokens_per_s * model.intercept_s / (1.0 - busy)
        in_pool = (now.decode.running + now.decode.queued) / decode
        concurrency = max(concurrency, in_pool)
        seats = self.config.max_num_seqs
        if concurrency > seats:
            return math.inf, overload_margin(concurrency / seats)
        pairs = concurrency * context
        seconds = model.predict(max(1, math.ceil(concurrency)), round(pairs))
        itl_margin = margin(seconds, slo_s)
        kv = self.predicted_kv_usage(decode, now)
        limit = self.config.kv_usage_limit
        if kv > limit:
            itl_margin = min(itl_margin, (limit - kv) / limit)
        return seconds, itl_margin

    def predicted_kv_usage(self, decode: int, now: Observation) -> float:
        """Today's KV blocks in use, spread over `decode` instances."""
        current = now.decode.serving + now.decode.starting
        if current <= 0:
            return 0.0
        return now.decode.kv_usage * current / decode
