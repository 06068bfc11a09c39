"""Per-tenant limits (docs/security.md): each trips at exactly its
configured number with a 429 and `Retry-After`, and resets; tokens reserved at
admission are corrected with what a run used. The clock is a fake one handed to the
gateway's constructor."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.rate_limits import RateLimited, RateLimiter
from pdserve.gateway.tenants import Tenant, TenantEntry
from tests.gateway.tenant_fakes import FakeClock, completion, key, keys_file, tenant_gateway


def test_requests_per_minute_trip_at_the_limit_and_refill() -> None:
    clock = FakeClock()
    limiter, tenant = RateLimiter(clock), Tenant("t", requests_per_minute=3)
    for _ in range(3):
        limiter.release(limiter.admit(tenant, 0), 0)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(tenant, 0)
    assert refused.value.retry_after_s == 20  # one request's worth: 60 s / 3
    clock.advance(19.5)
    with pytest.raises(RateLimited):
        limiter.check(tenant)
    clock.advance(0.5)
    limiter.release(limiter.admit(tenant, 0), 0)  # one came back ...
    with pytest.raises(RateLimited):
        limiter.admit(tenant, 0)  # ... and only one
    clock.advance(60)
    for _ in range(3):  # a minute later the whole minute is back, and no more
        limiter.release(limiter.admit(tenant, 0), 0)
    with pytest.raises(RateLimited):
        limiter.admit(tenant, 0)
    assert limiter.running("t") == 0


def test_tokens_per_minute_reserve_then_give_back_what_went_unused() -> None:
    clock = FakeClock()
    limiter, tenant = RateLimiter(clock), Tenant("t", tokens_per_minute=100)
    ticket = limiter.admit(tenant, 60)
    with pytest.raises(RateLimited) as refused:
        limiter.admit(tenant, 41)  # 40 left
    assert refused.value.retry_after_s == 1  # 1 token at 100/min: 0.6 s, rounded up
    limiter.release(ticket, 10)
    limiter.release(ticket, 10)  # idempotent
    limiter.release(limiter.admit(tenant, 90), 90)  # 90 left after the correction: all used
    with pytest.raises(RateLimited) as refused:
        limiter.admit(tenant, 30)
    assert refused.value.retry_after_s == 18  # 30 tokens short at 100/min
    clock.advance(18)
    limiter.admit(tenant, 30)
    with pytest.raises(ValueError, match="more than this key's limit of 100 tokens"):
        limiter.admit(tenant, 101)  # never fits: not a 429


def test_concurrent_requests_take_and_give_back_seats() -> None:
    limiter, tenant = RateLimiter(FakeClock()), Tenant("t", max_concurrent_requests=2)
    first, second = limiter.admit(tenant, 0), limiter.admit(tenant, 0)
    with pytest.raises(RateLimited) as refused:
        limiter.check(tenant)
    assert refused.value.retry_after_s == 1
    limiter.release(first, 0)
    limiter.release(limiter.admit(tenant, 0), 0)
    limiter.release(second, 0)
    assert limiter.running("t") == 0


def test_a_refused_request_takes_nothing() -> None:
    limiter = RateLimiter(FakeClock())
    tenant = Tenant("t", requests_per_minute=5, tokens_per_minute=100)
    limiter.admit(tenant, 90)
    for _ in range(10):
        with pytest.raises(RateLimited):
            limiter.admit(tenant, 20)  # the tokens refuse it: no request is counted
    for _ in range(4):
        limiter.admit(tenant, 1)


LIMITED = TenantEntry(
    "limited",
    ["limited-key"],
    requests_per_minute=2,
    tokens_per_minute=200,
    max_concurrent_requests=1,
    max_tokens_per_request=50,
)
OTHER = TenantEntry("other", ["other-key"])
KEYS = keys_file(LIMITED, OTHER)


def assert_429(response, retry_after: int) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["Retry-After"] == str(retry_after)
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


def test_limits_answer_429_with_retry_after_over_http() -> None:
    clock = FakeClock()

    async def scenario() -> str:
        async with tenant_gateway(clock, api_keys=KEYS) as (_, instance, client):
            mine, theirs = key("limited-key"), key("other-key")
            for _ in range(2):
                ok = await client.post("/v1/completions", json=completion(), headers=mine)
                assert ok.status_code == 200, ok.text
            assert_429(await client.post("/v1/completions", json=completion(), headers=mine), 30)
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert_429(await client.post("/v1/chat/completions", json=chat, headers=mine), 30)
            for _ in range(3):  # another tenant is not limited by this one
                ok = await client.post("/v1/completions", json=completion(), headers=theirs)
                assert ok.status_code == 200
            clock.advance(30)
            assert (
                await client.post("/v1/completions", json=completion(), headers=mine)
            ).is_success
            assert len(instance.tasks) == 6
            return (await client.get("/metrics", headers=mine)).text

    text = asyncio.run(scenario())
    assert 'pdserve:tenant_rate_limited_total{tenant="limited"} 2.0' in text
    assert 'pdserve:tenant_requests_total{tenant="limited"} 3.0' in text


def test_a_held_request_holds_its_seat_until_it_ends() -> None:
    async def scenario() -> None:
        async with tenant_gateway(FakeClock(), api_keys=KEYS) as (gateway, instance, client):
            instance.hold = True
            mine = key("limited-key")
            first = asyncio.ensure_future(
                client.post("/v1/completions", json=completion(), headers=mine)
            )
            while not instance.held:
                await asyncio.sleep(0.01)
            assert_429(await client.post("/v1/completions", json=completion(), headers=mine), 1)
            instance.finish_held()
            assert (await first).status_code == 200
            assert gateway.limiter.running("limited") == 0
            instance.hold = False
            streamed = await client.post(
                "/v1/completions", json=completion(stream=True), headers=mine
            )
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            assert gateway.limiter.running("limited") == 0  # a stream gives its seat back too

    asyncio.run(scenario())


def test_max_tokens_per_request_is_a_400_and_caps_the_default() -> None:
    async def scenario() -> None:
        async with tenant_gateway(FakeClock(), api_keys=KEYS) as (_, instance, client):
            mine = key("limited-key")
            refused = await client.post("/v1/completions", json=completion(51), headers=mine)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 99}
            refused = await client.post("/v1/chat/completions", json=chat, headers=mine)
            assert refused.json()["error"]["param"] == "max_completion_tokens"
            chat = {"messages": [{"role": "user", "content": "Hi"}]}  # the cap, not the room
            assert (await client.post("/v1/chat/completions", json=chat, headers=mine)).is_success
            assert instance.tasks[-1].sampling_params.max_tokens == 50
            too_big = await client.post("/v1/completions", json=completion(50, n=4), headers=mine)
            assert too_big.status_code == 400 and "tokens per minute" in too_big.text

    asyncio.run(scenario())


def test_tokens_per_minute_count_what_was_used() -> None:
    clock = FakeClock()
    # 200 tokens a minute, 50 at most a request, one token generated each time: the
    # reservation (prompt + 50) is corrected to prompt + 1 when the run ends, so far
    # more than 200 / 50 = 4 requests fit in the minute.
    limits = TenantEntry("t", ["t-key"], tokens_per_minute=200, max_tokens_per_request=50)

    async def scenario() -> tuple[int, int]:
        async with tenant_gateway(clock, api_keys=keys_file(limits)) as (_, _, client):
            prompt = 0
            for done in range(100):
                response = await client.post(
                    "/v1/completions", json=completion(50), headers=key("t-key")
                )
                if response.status_code == 429:
                    return done, prompt
                prompt = response.json()["usage"]["prompt_tokens"]
        return 100, prompt

    served, prompt = asyncio.run(scenario())
    assert served == (200 - (prompt + 50)) // (prompt + 1) + 1 > 4
