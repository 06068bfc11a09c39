"""What the recovery suites (local processes and Ray actors) send: one prompt, greedy or
seeded, whole or streamed on a thread while instances are killed, paused or drained;
and the checks they share on streams and on scaling the decode pool."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from experiments.serving import (
    ADMIN_KEY,
    MODEL,
    BackgroundStream,
    ServeProcess,
    assert_health_answers_within,
    gateway_threads,
    wait_for,
)

GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "seed": 1234}
# Streams begun in this order under round robin: each of two decode instances gets one of each.
MIXED = [GREEDY, GREEDY, SEEDED, SEEDED]
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass(frozen=True)
class RecoveryRequests:
    prompt: str
    max_tokens: int

    def body(self, sampling: dict, stream: bool) -> dict:
        return {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": stream,
            **sampling,
        }

    def complete(self, server: ServeProcess, sampling: dict) -> str:
        response = server.post("/v1/completions", json=self.body(sampling, stream=False))
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    def texts(self, server: ServeProcess, samplings: list[dict]) -> list[str]:
        """What each sampling's request ends with, from whole completions (each distinct
        sampling completed once): what streams of the same samplings must end with."""
        done: list[tuple[dict, str]] = []
        for sampling in samplings:
            if all(sampling != seen for seen, _ in done):
                done.append((sampling, self.complete(server, sampling)))
        return [next(text for seen, text in done if seen == sampling) for sampling in samplings]

    @staticmethod
    def assert_streams_end_as(streams: list[BackgroundStream], expected: list[str]) -> None:
        """Each stream ends with its expected text, without an error."""
        for stream, want in zip(streams, expected, strict=True):
            assert stream.join(120) == want and stream.errors == []

    def streams(self, server: ServeProcess, samplings: list[dict]) -> list[BackgroundStream]:
        """One stream a sampling, each begun (two chunks in) before the next starts, so
        that round robin alternates them over the decode instances."""
        streams = []
        for sampling in samplings:
            streams.append(BackgroundStream(server, self.body(sampling, stream=True)))
            wait_for(lambda s=streams[-1]: len(s.chunks) >= 2, 60, "the stream to begin")
        return streams


def scale_decode(server: ServeProcess, size: int) -> httpx.Response:
    return server.post("/admin/pools/decode/scale", json={"size": size}, headers=ADMIN)


def assert_scaling_up_answers_at_once(server: ServeProcess, size: int, new_threads: int) -> None:
    """A scale past `--max-pool-size` is a 400 and one to `size` (starting decode-2) a
    202, each within a second, `/health` answering throughout; the gateway gains at
    most `new_threads` threads (its starters, nothing per instance or request)."""
    threads = gateway_threads(server)
    began = time.monotonic()
    huge = scale_decode(server, 100000)
    assert time.monotonic() - began < 1.0
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "size"
    assert "--max-pool-size" in huge.json()["error"]["message"]
    assert_health_answers_within(server, 1.0)
    scaled = scale_decode(server, size)
    assert scaled.status_code == 202
    assert scaled.json() == {
        "role": "decode",
        "size": size,
        "starting": ["decode-2"],
        "draining": [],
    }
    assert_health_answers_within(server, 1.0)
    assert gateway_threads(server) <= threads + new_threads
