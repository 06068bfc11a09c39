"""What the recovery suites (local processes and Ray actors) send: one prompt, greedy or
seeded, whole or streamed on a thread while instances are killed, paused or drained."""

from __future__ import annotations

from dataclasses import dataclass

from experiments.serving import MODEL, BackgroundStream, ServeProcess, wait_for

GREEDY = {"temperature": 0}


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

    def streams(self, server: ServeProcess, samplings: list[dict]) -> list[BackgroundStream]:
        """One stream a sampling, each begun (two chunks in) before the next starts, so
        that round robin alternates them over the decode instances."""
        streams = []
        for sampling in samplings:
            streams.append(BackgroundStream(server, self.body(sampling, stream=True)))
            wait_for(lambda s=streams[-1]: len(s.chunks) >= 2, 60, "the stream to begin")
        return streams
