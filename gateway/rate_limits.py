"""Per-tenant limits at the gateway: requests and tokens per minute, requests at once.

Per minute limits are token buckets holding a minute's worth: a tenant may spend its
whole minute in a burst (the limit trips at exactly the configured number), and the
bucket refills evenly, full again a minute after it was emptied. Tokens are
`usage.total_tokens`: a run reserves prompt tokens plus `max_tokens` for every choice
at admission, and gives back what it did not use when it ends. Everything runs on the
gateway's event loop, so there are no locks; the clock is injected for tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.gateway.errors import APIError
from pdserve.gateway.tenants import Tenant

MINUTE_S = 60.0
CONCURRENCY_RETRY_AFTER_S = 1


class RateLimited(Exception):
    """A tenant's limit refused a request: a 429 with `Retry-After`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    def api_error(self) -> APIError:
        headers = {"Retry-After": str(self.retry_after_s)}
        return APIError(429, str(self), code="rate_limit_exceeded", headers=headers)


@dataclass
class TokenBucket:
    """`per_minute` units, refilled at `per_minute / 60` a second up to `per_minute`."""

    per_minute: int
    level: float
    updated: float

    def refill(self, now: float) -> None:
        rate = self.per_minute / MINUTE_S
        self.level = min(self.per_minute, self.level + (now - self.updated) * rate)
        self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0: now); call `refill` first."""
        deficit = amount - self.level
        if deficit <= 1e-9:  # what a float refill leaves short of a whole unit
            return 0.0
        return deficit * MINUTE_S / self.per_minute

    def give_back(self, amount: float) -> None:
        self.level = min(self.per_minute, self.level + amount)


@dataclass
class Ticket:
    """One admitted run's claim: its concurrency seat and its reserved tokens."""

    tenant: str
    reserved_tokens: int
    released: bool = False


@dataclass
class TenantState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    running: int = 0


@dataclass
class RateLimiter:
    clock: Callable[[], float] = time.monotonic
    _states: dict[str, TenantState] = field(default_factory=dict)

    def check(self, tenant: Tenant) -> None:
        """Raises RateLimited if a request of `tenant` would be refused now whatever its
        size: before its prompt is tokenized, so a tenant over its limit costs no CPU."""
        state = self._state(tenant)
        self._check_seats(tenant, state)
        if state.requests is not None:
            state.requests.refill(self.clock())
            self._check_bucket(state.requests, 1, "requests")

    def admit(self, tenant: Tenant, tokens: int) -> Ticket:
        """Takes a request, `tokens` tokens and a seat, all or none (raises RateLimited;
        ValueError for a request larger than a whole minute of tokens)."""
        state = self._state(tenant)
        limit = tenant.tokens_per_minute
        if limit is not None and tokens > limit:
            raise ValueError(
                f"this request needs {tokens} tokens (prompt and max_tokens for every "
                f"choice), more than this key's limit of {limit} tokens per minute: "
                "lower max_tokens or n"
            )
        self._check_seats(tenant, state)
        now = self.clock()
        wanted = ((state.requests, 1, "requests"), (state.tokens, tokens, "tokens"))
        for bucket, amount, what in wanted:
            if bucket is not None:
                bucket.refill(now)
                self._check_bucket(bucket, amount, what)
        for bucket, amount, _ in wanted:  # every check passed: take them all
            if bucket is not None:
                bucket.level -= amount
        state.running += 1
        return Ticket(tenant.name, tokens)

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """The run ended having used `used_tokens`: its seat and unused tokens come
        back (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        state = self._states[ticket.tenant]
        state.running -= 1
        if state.tokens is not None:
            state.tokens.refill(self.clock())
            state.tokens.give_back(ticket.reserved_tokens - used_tokens)

    def running(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return 0 if state is None else state.running

    def _state(self, tenant: Tenant) -> TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            now = self.clock()
            rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
            state = TenantState(
                None if rpm is None else TokenBucket(rpm, rpm, now),
                None if tpm is None else TokenBucket(tpm, tpm, now),
            )
            self._states[tenant.name] = state
        return state

    @staticmethod
    def _check_seats(tenant: Tenant, state: TenantState) -> None:
        limit = tenant.max_concurrent_requests
        if limit is not None and state.running >= limit:
            raise RateLimited(
                f"rate limit reached: {limit} concurrent requests for this key; "
                "retry when one finishes",
                CONCURRENCY_RETRY_AFTER_S,
            )

    @staticmethod
    def _check_bucket(bucket: TokenBucket, amount: float, what: str) -> None:
        wait = bucket.wait_s(amount)
        if wait > 0:
            raise RateLimited(
                f"rate limit reached: {bucket.per_minute} {what} per minute for this key",
                wait,
            )
