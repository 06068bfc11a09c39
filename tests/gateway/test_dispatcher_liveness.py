"""The dispatcher's liveness against scripted instances (plain ZMQ sockets, no model):
an instance silent past the timeout (paused) is fenced: its epoch retired (what it
says when it resumes counts for nothing), the cluster told to kill and replace it, the
fence counted, and its replacement in the next epoch serves; a dead instance's gauges
leave /metrics at once; a prefill instance's death spares a request whose decode
instance already streams it; a request past `--request-timeout` fails and is aborted
on its instance."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

import msgspec
import pytest
import zmq

from pdserve.common.frame_seal import OUTPUTS, TASKS, Sealer
from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InstanceOutput,
    InstanceStats,
    RequestDelta,
    SnapshotTask,
    Task,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.dispatcher import Dispatcher
from pdserve.gateway.generation import GenerationFailed, GenerationRun
from pdserve.gateway.global_scheduler import (
    AdmissionRejected,
    GlobalScheduler,
    GlobalSchedulerConfig,
)
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.prompts import Prompt
from pdserve.gateway.request_stream import StreamEvent
from pdserve.text.tokenizer import Tokenizer
from tests.gateway.instances import instance_info

TIMEOUT_S = 0.3  # the dispatcher checks every 0.5 s: death is noticed within ~1 s


class ScriptedInstance:
    """An instance the test speaks for: it reads the tasks the gateway sends and sends
    whatever outputs the test writes."""

    def __init__(self, context: zmq.Context, instance_id: str, role: str, gateway: str) -> None:
        self.tasks = context.socket(zmq.PULL)
        port = self.tasks.bind_to_random_port("tcp://127.0.0.1")
        events = context.socket(zmq.PUB)
        events_port = events.bind_to_random_port("tcp://127.0.0.1")
        self.events = events
        self.outputs = context.socket(zmq.PUSH)
        self.outputs.connect(gateway)
        self.info = instance_info(
            instance_id,
            role,
            tasks_address=f"tcp://127.0.0.1:{port}",
            events_address=f"tcp://127.0.0.1:{events_port}",
        )
        self.address = self.info.address
        self.epoch = 0
        # Its ends of the channels, under this process's secret (the dispatcher's too).
        self.seal = Sealer(OUTPUTS, instance_id)
        self.opener = Sealer(TASKS, instance_id, responder=True)
        self._decoder = msgspec.msgpack.Decoder(Task)

    def say(self, *deltas: RequestDelta, running: int = 0) -> None:
        output = InstanceOutput(
            self.address, list(deltas), epoch=self.epoch, stats=InstanceStats(num_running=running)
        )
        self.outputs.send(self.seal.seal(msgspec.msgpack.encode(output)))

    async def next_task(self, kind: type, timeout_s: float = 5.0):
        """The next task of `kind` (others are skipped); heartbeats meanwhile."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if self.tasks.poll(0):
                task = self._decoder.decode(self.opener.open(self.tasks.recv()).payload)
                if isinstance(task, kind):
                    return task
            else:
                self.say()
                await asyncio.sleep(0.02)
        raise AssertionError(f"no {kind.__name__} reached {self.address.instance_id}")

    def close(self) -> None:
        for sock in (self.tasks, self.events, self.outputs):
            sock.close(linger=0)


def run(scenario: Callable[[Dispatcher, zmq.Context], Awaitable[None]]) -> None:
    """Runs `scenario` on a fresh loop with a started dispatcher."""

    async def main() -> None:
        config = GlobalSchedulerConfig(instance_timeout_s=TIMEOUT_S)
        dispatcher = Dispatcher(GlobalScheduler(config), GatewayMetrics("m"))
        dispatcher.start()
        context = zmq.Context()
        try:
            await scenario(dispatcher, context)
        finally:
            await dispatcher.close()
            context.term()

    asyncio.run(main())


def task(request_id: str) -> GenerateTask:
    params = SamplingParams(max_tokens=8, seed=1)
    return GenerateTask(request_id, [1, 2, 3, 4, 5], params, arrival_time=0.0)


async def until(condition, timeout_s: float, what: str, keep_alive=()) -> None:
    """Waits for `condition`; meanwhile the instances in `keep_alive` heartbeat."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        for instance in keep_alive:
            instance.say()
        await asyncio.sleep(0.05)


def gauge_lines(dispatcher: Dispatcher, instance_id: str) -> list[str]:
    text = dispatcher.metrics.render().decode()
    return re.findall(rf'^\S*num_requests_running{{[^}}]*instance="{instance_id}"[^}}]*}} .*$',
                      text, re.M)  # fmt: skip


def test_a_request_past_its_deadline_fails_and_is_aborted_on_its_instance() -> None:
    run(past_the_deadline)


def test_a_paused_instance_is_fenced_and_its_replacement_serves() -> None:
    run(paused_then_replaced)


def test_a_prefill_death_spares_requests_whose_kv_reached_decode() -> None:
    run(prefill_dies_after_handoff)


def test_a_stream_whose_instance_dies_goes_on_elsewhere_then_runs_out_of_retries() -> None:
    run(migrated_twice)


async def paused_then_replaced(dispatcher: Dispatcher, context: zmq.Context) -> None:
    fenced: list[str] = []
    dispatcher.on_fenced = fenced.append
    d0 = ScriptedInstance(context, "d0", "colocated", dispatcher.output_address)
    replacement = None
    try:
        dispatcher.register(d0.info)
        d0.say(running=1)
        events: list[StreamEvent] = []
        dispatcher.submit(task("r1"), events.append)
        first = await d0.next_task(GenerateTask)
        assert (first.request_id, first.epoch) == ("r1", 0)  # tasks name the epoch
        d0.say(RequestDelta("r1", [7], 0), running=1)  # it started, then it pauses
        view = dispatcher.scheduler.views["d0"]
        await until(lambda: not view.alive, 5, "d0 to be fenced")
        assert fenced == ["d0"] and view.epoch == 1
        assert events[-1].error and "failed mid-request" in events[-1].error
        assert "fenced" in events[-1].error
        assert gauge_lines(dispatcher, "d0") == []  # its last load went with it
        text = dispatcher.metrics.render().decode()
        assert re.search(r'^pdserve:num_instances_fenced_total{[^}]*"d0"[^}]*} 1\.0$', text, re.M)
        with pytest.raises(AdmissionRejected, match="no instance"):
            dispatcher.scheduler.admit()

        # It resumes before the cluster killed it: what it says counts for nothing.
        count = len(events)
        for _ in range(5):
            d0.say(RequestDelta("r1", [8], 1), running=1)
            await asyncio.sleep(0.05)
        assert not view.alive and len(events) == count
        d0.close()

        # Its replacement starts in the next epoch and serves.
        replacement = ScriptedInstance(context, "d0", "colocated", dispatcher.output_address)
        replacement.epoch = 1
        dispatcher.register(msgspec.structs.replace(replacement.info, epoch=1))
        assert dispatcher.metrics.restarted._value.get() == 1
        snapshot = await replacement.next_task(SnapshotTask)  # its prefix cache afresh
        assert snapshot.epoch == 1  # the replacement's epoch, not the retired one
        assert gauge_lines(dispatcher, "d0")  # its gauges are back
        dispatcher.scheduler.admit()
        dispatcher.submit(task("r2"), events.append)
        second = await replacement.next_task(GenerateTask)
        assert (second.request_id, second.epoch) == ("r2", 1)
        replacement.say(RequestDelta("r2", [9], 0, finish_reason="length"))
        await until(lambda: events[-1].request_id == "r2", 5, "r2 to finish",
                    keep_alive=[replacement])  # fmt: skip
        assert events[-1].delta is not None and events[-1].delta.finished
    finally:
        d0.close()
        if replacement is not None:
            replacement.close()


async def prefill_dies_after_handoff(dispatcher: Dispatcher, context: zmq.Context) -> None:
    p0 = ScriptedInstance(context, "p0", "prefill", dispatcher.output_address)
    d0 = ScriptedInstance(context, "d0", "decode", dispatcher.output_address)
    try:
        for instance in (p0, d0):
            dispatcher.register(instance.info)
        events: list[StreamEvent] = []
        for rid in ("decoding", "prefilling"):
            dispatcher.submit(task(rid), events.append)
            assert (await p0.next_task(GenerateTask)).request_id == rid
        p0.say(RequestDelta("decoding", [7], 0), RequestDelta("prefilling", [5], 0))
        d0.say(RequestDelta("decoding", [8], 1))  # its KV is on d0: decoding goes on
        await until(lambda: len(events) == 3, 5, "the first tokens", keep_alive=[p0, d0])

        dispatcher.instance_lost("p0", "its process exited with code -9")
        assert not any(e.error for e in events)
        # "prefilling" still needed p0's KV: dropped on d0, then migrated there alone
        # with the token its client has, and d0 computes it from the prompt.
        assert (await d0.next_task(AbortTask)).request_ids == ["prefilling"]
        moved = await d0.next_task(GenerateTask)
        assert moved.request_id == "prefilling" and moved.output_token_ids == [5]
        assert moved.decode_target is None
        assert dispatcher.metrics.migrated._value.get() == 1

        d0.say(RequestDelta("decoding", [9], 2, finish_reason="length"))
        d0.say(RequestDelta("prefilling", [6], 1, finish_reason="length"))
        await until(lambda: len(events) == 5, 5, "both to finish", keep_alive=[d0])
        assert all(e.delta.finished for e in events[-2:]) and not any(e.error for e in events)
        assert [e.delta.new_token_ids[0] for e in events if e.request_id == "decoding"] == [7, 8, 9]
        assert [e.delta.new_token_ids[0] for e in events if e.request_id == "prefilling"] == [5, 6]
    finally:
        for instance in (p0, d0):
            instance.close()


async def past_the_deadline(dispatcher: Dispatcher, context: zmq.Context) -> None:
    c0 = ScriptedInstance(context, "c0", "colocated", dispatcher.output_address)
    try:
        dispatcher.register(c0.info)
        tokenizer = Tokenizer.from_folder(embedded_model_path())
        params = SamplingParams(max_tokens=8, seed=1)
        run = GenerationRun("slow", [Prompt([1, 2, 3])], params, dispatcher, tokenizer,
                            dispatcher.metrics, timeout_s=0.5)  # fmt: skip
        run.start()
        assert (await c0.next_task(GenerateTask)).request_id == "slow-0"
        c0.say(RequestDelta("slow-0", [7], 0))  # one token, then nothing: it never ends
        waiting = asyncio.ensure_future(run.wait())
        await until(waiting.done, 5, "the deadline", keep_alive=[c0])  # c0 lives on
        with pytest.raises(GenerationFailed, match="request-timeout") as failed:
            waiting.result()
        assert failed.value.timed_out and not failed.value.rejected
        assert (await c0.next_task(AbortTask)).request_ids == ["slow-0"]
        assert "slow-0" not in dispatcher.scheduler.assignments
    finally:
        c0.close()


async def migrated_twice(dispatcher: Dispatcher, context: zmq.Context) -> None:
    instances = [
        ScriptedInstance(context, f"c{i}", "colocated", dispatcher.output_address) for i in range(3)
    ]
    try:
        for instance in instances:
            dispatcher.register(instance.info)
        events: list[StreamEvent] = []
        dispatcher.submit(task("r"), events.append)
        first = dispatcher.scheduler.assignments["r"].route.decode.instance_id
        c0 = next(i for i in instances if i.address.instance_id == first)
        await c0.next_task(GenerateTask)
        c0.say(RequestDelta("r", [7, 8], 0), RequestDelta("r", [10], 3))  # index 2 never came
        await until(lambda: len(events) == 1, 5, "the first tokens", keep_alive=instances)

        dispatcher.instance_lost(first, "its process exited with code -9")
        second = dispatcher.scheduler.assignments["r"].route.decode.instance_id
        c1 = next(i for i in instances if i.address.instance_id == second)
        moved = await c1.next_task(GenerateTask)
        assert moved.output_token_ids == [7, 8]  # what the client has, no more
        # The new instance's deltas go on at index 2; a repeat of released tokens is cut.
        c1.say(RequestDelta("r", [8, 9], 1), RequestDelta("r", [10], 3))
        await until(lambda: len(events) == 3, 5, "the migrated tokens", keep_alive=instances)
        assert [e.delta.new_token_ids for e in events] == [[7, 8], [9], [10]]
        assert [e.delta.output_index for e in events] == [0, 2, 3]

        dispatcher.instance_lost(second, "its process exited with code -9")  # attempt 3
        third = next(i for i in instances if i.address.instance_id not in (first, second))
        assert (await third.next_task(GenerateTask)).output_token_ids == [7, 8, 9, 10]
        assert dispatcher.metrics.migrated._value.get() == 2
        dispatcher.instance_lost(third.address.instance_id, "killed")  # max_attempts: 3
        assert events[-1].error and "no retries left" in events[-1].error
        assert "r" not in dispatcher.scheduler.assignments
    finally:
        for instance in instances:
            instance.close()
