"""Prefill and decode step loops in this process, wired like a server without the gateway.

`Gateway` binds the PULL socket every instance sends its outputs to and collects them
on a thread (deltas with their arrival time and sender, summed metric counters);
`Running` starts a step loop on a thread and stops it. The instances use real
ZMQ sockets and real KV transfer workers (UCX over shared memory); only the gateway's
routing is played by the test, which sends `GenerateTask`s straight to an instance.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pdserve.common.frame_seal import OUTPUTS, TASKS, Sealer
from pdserve.common.messages import (
    GenerateTask,
    InspectTask,
    InstanceInspection,
    InstanceOutput,
    InstanceStats,
    RequestDelta,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.instance.loop import StepLoop
from pdserve.instance.spec import InstanceSpec
from pdserve.kvtransfer.config import KVTransferConfig

# 24 MiB hold 34 blocks of 16 fp32 tokens: max_model_len must fit in them (512 <= 544).
# Block counts in the prefill and decode tests are of 16-token blocks.
ENGINE = {
    "dtype": "float32", "num_threads": 1, "kv_cache_memory": 24 << 20, "max_model_len": 512,
    "block_size": 16,
}  # fmt: skip
ENCODER = msgspec.msgpack.Encoder()
SEALER = Sealer(TASKS, "gateway")  # the instances' secret: this process's
OPENER = Sealer(OUTPUTS, "gateway", responder=True)


@dataclass
class Received:
    at: float
    instance: str
    delta: RequestDelta


@dataclass
class Gateway:
    context: zmq.Context = field(default_factory=zmq.Context)
    deltas: list[Received] = field(default_factory=list)
    counters: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    observations: dict[tuple[str, str], list[float]] = field(
        default_factory=lambda: defaultdict(list)
    )
    inspections: dict[str, InstanceInspection] = field(default_factory=dict)
    stats: dict[str, InstanceStats] = field(default_factory=dict)  # the latest, by instance

    def __post_init__(self) -> None:
        self._pull = self.context.socket(zmq.PULL)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        decoder = msgspec.msgpack.Decoder(InstanceOutput)
        while not self._stop.is_set():
            if not self._pull.poll(50):
                continue
            output = decoder.decode(OPENER.open(self._pull.recv()).payload)
            now = time.monotonic()
            instance = output.instance.instance_id
            with self._lock:
                for delta in output.deltas:
                    self.deltas.append(Received(now, instance, delta))
                if output.stats is not None:
                    self.stats[instance] = output.stats
                if output.inspection is not None:
                    self.inspections[output.inspection.query_id] = output.inspection
                if output.metrics is not None:
                    for name, value in output.metrics.counters.items():
                        self.counters[(instance, name)] += value
                    for name, values in output.metrics.histograms.items():
                        self.observations[(instance, name)].extend(values)

    def send(self, runtime: StepLoop, task: Any) -> None:
        address = runtime.address.task_address
        if address not in self._push:
            self._push[address] = self.context.socket(zmq.PUSH)
            self._push[address].connect(address)
        self._push[address].send(SEALER.seal(ENCODER.encode(task)))

    def generate(
        self,
        runtime: StepLoop,
        request_id: str,
        prompt: list[int],
        max_tokens: int = 4,
        decode: StepLoop | None = None,
        **params: Any,
    ) -> None:
        params.setdefault("seed", 7)  # the gateway always sets one
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        self.send(
            runtime,
            GenerateTask(
                request_id, prompt, sampling, arrival_time=time.time(),
                decode_target=None if decode is None else decode.address,
            ),
        )  # fmt: skip

    def inspect(self, runtime: StepLoop, timeout_s: float = 10.0) -> InstanceInspection:
        """The instance's books, asked for over its task socket (thread-safe)."""
        query_id = f"q{time.monotonic_ns()}"
        self.send(runtime, InspectTask(query_id))
        until(lambda: query_id in self.inspections, timeout_s, f"inspection {query_id}")
        with self._lock:
            return self.inspections.pop(query_id)

    def idle_books(self, runtime: StepLoop, timeout_s: float = 10.0) -> InstanceInspection:
        """Inspections until no request is left on the instance; the last one."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.inspect(runtime)
            if not found.unfinished_request_ids or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def of(self, request_id: str) -> list[Received]:
        with self._lock:
            return [r for r in self.deltas if r.delta.request_id == request_id]

    def wait_finished(self, request_id: str, timeout_s: float = 60.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.of(request_id)
            if any(r.delta.finished for r in got):
                return got
            time.sleep(0.02)
        raise AssertionError(f"{request_id} did not finish; got {self.of(request_id)}")

    def tokens(self, request_id: str) -> list[int]:
        """The request's tokens in output order (as the gateway would release them)."""
        ordered = sorted(self.of(request_id), key=lambda r: r.delta.output_index)
        return [t for r in ordered for t in r.delta.new_token_ids]

    def latest_stats(self, instance: str) -> InstanceStats:
        with self._lock:
            return self.stats.get(instance, InstanceStats())

    def counter(self, instance: str, name: str) -> float:
        with self._lock:
            return self.counters.get((instance, name), 0.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._push.values():
            sock.close(linger=0)
        self._pull.close(linger=0)
        self.context.term()


class Running:
    """A loaded runtime whose step loop runs on a thread until `stop()`."""

    def __init__(self, runtime: StepLoop) -> None:
        self.runtime = runtime
        runtime.load()
        self._thread = threading.Thread(target=runtime.run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.runtime.stop()
        self._thread.join(timeout=15)


def spec(gateway: Gateway, instance_id: str, role: str, **overrides: Any) -> InstanceSpec:
    kv_transfer = KVTransferConfig(instance_id, **overrides.pop("kv_transfer", {}))
    settings: dict[str, Any] = {"engine": EngineConfig(**ENGINE), "kv_transfer": kv_transfer}
    settings.update(overrides)
    return InstanceSpec(
        instance_id=instance_id, role=role, gateway_address=gateway.address, **settings
    )


def until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from one colocated engine (fp32), the oracle."""
    from pdserve.engine.core import EngineCore

    engine = _reference_engine()
    request = engine.make_request(
        f"ref-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert isinstance(engine, EngineCore)
    return list(request.output_token_ids)


_engines: list[Any] = []


def _reference_engine():
    if not _engines:
        from pdserve.engine.core import EngineCore

        _engines.append(EngineCore(**ENGINE))
    return _engines[0]
