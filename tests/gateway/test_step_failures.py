"""The gateway's side of failed steps, against scripted instances (no model): a request
an instance dropped after a failed step goes to another instance, carrying its strike,
and a second strike ends it with the step's reason; a bystander moves without one; an
instance that says it is unhealthy (its circuit breaker tripped) is fenced and its
requests move on."""

from __future__ import annotations

import msgspec
import zmq

from pdserve.common.messages import (
    STEP_BYSTANDER,
    STEP_SUSPECT,
    GenerateTask,
    InstanceOutput,
    RequestDelta,
)
from pdserve.gateway.dispatcher import Dispatcher
from pdserve.gateway.global_scheduler import GlobalScheduler
from pdserve.gateway.request_stream import StreamEvent
from pdserve.gateway.routing import RouteRequest
from pdserve.gateway.step_failures import next_move
from tests.gateway.instances import instance_info
from tests.gateway.test_dispatcher_liveness import ScriptedInstance, run, task, until


def failed(request_id: str, kind: str = STEP_SUSPECT) -> RequestDelta:
    error = "engine step failed: RuntimeError: boom"
    return RequestDelta(request_id, [], 0, finish_reason="error", error=error, step_failed=kind)


def test_next_move_counts_strikes_and_retries() -> None:
    first = next_move(task("r"), failed("r"), "c0", attempts=1, max_attempts=3)
    assert first.task is not None and first.task.step_failures == 1 and "c0" in first.why
    second = next_move(first.task, failed("r"), "c1", attempts=2, max_attempts=3)
    assert second.task is None and "failed on 2 instances" in second.fail
    assert "boom" in second.fail
    bystander = next_move(first.task, failed("r", STEP_BYSTANDER), "c1", 2, 3)
    assert bystander.task is not None and bystander.task.step_failures == 1
    spent = next_move(task("r"), failed("r"), "c0", attempts=3, max_attempts=3)
    assert spent.task is None and "--max-request-retries" in spent.fail


def test_routing_avoids_the_instances_a_step_failed_on() -> None:
    scheduler = GlobalScheduler()
    for instance_id, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        scheduler.add_instance(instance_info(instance_id, role), 0.0)
    request = RouteRequest("r", [1, 2, 3])
    for _ in range(4):
        route = scheduler.route(request, avoid=frozenset({"d0"}))
        assert route.decode.instance_id == "d1" and route.prefill is not None
    # The only prefill instance avoided: the decode instance runs it whole.
    assert scheduler.route(request, avoid=frozenset({"p0"})).prefill is None
    # Every decode instance avoided: one of them still (better than none).
    assert scheduler.route(request, avoid=frozenset({"d0", "d1"})).decode.role == "decode"


def test_a_request_moves_on_after_a_failed_step_and_ends_after_a_second() -> None:
    run(moved_then_ended)


def test_an_unhealthy_instance_is_fenced_and_its_requests_move_on() -> None:
    run(unhealthy_fenced)


async def moved_then_ended(dispatcher: Dispatcher, context: zmq.Context) -> None:
    instances = [ScriptedInstance(context, f"c{i}", "colocated", dispatcher.output_address)
                 for i in range(3)]  # fmt: skip
    try:
        for instance in instances:
            dispatcher.register(instance.info)
        by_id = {i.address.instance_id: i for i in instances}
        events: list[StreamEvent] = []
        dispatcher.submit(task("r"), events.append)
        first = by_id[dispatcher.scheduler.assignments["r"].route.decode.instance_id]
        await first.next_task(GenerateTask)
        first.say(failed("r"))
        second_id = await next_owner(dispatcher, "r", first, instances)
        second = by_id[second_id]
        moved = await second.next_task(GenerateTask)
        assert moved.step_failures == 1 and second is not first
        assert events == []  # the client saw nothing of it
        second.say(failed("r"))
        await until(lambda: bool(events), 5, "the end", keep_alive=instances)
        assert events[-1].error and "failed on 2 instances" in events[-1].error
        assert "boom" in events[-1].error and "r" not in dispatcher.scheduler.assignments
    finally:
        for instance in instances:
            instance.close()


async def next_owner(dispatcher, request_id, previous, instances) -> str:
    def moved() -> bool:
        assignment = dispatcher.scheduler.assignments.get(request_id)
        return assignment is not None and assignment.route.decode.instance_id != (
            previous.address.instance_id
        )

    await until(moved, 5, "the request to move", keep_alive=instances)
    return dispatcher.scheduler.assignments[request_id].route.decode.instance_id


async def unhealthy_fenced(dispatcher: Dispatcher, context: zmq.Context) -> None:
    fenced: list[str] = []
    dispatcher.on_fenced = fenced.append
    c0 = ScriptedInstance(context, "c0", "colocated", dispatcher.output_address)
    c1 = ScriptedInstance(context, "c1", "colocated", dispatcher.output_address)
    try:
        dispatcher.register(c0.info)
        events: list[StreamEvent] = []
        dispatcher.submit(task("r"), events.append)
        await c0.next_task(GenerateTask)
        dispatcher.register(c1.info)
        output = InstanceOutput(c0.address, epoch=0, unhealthy="its last 3 steps failed")
        c0.outputs.send(c0.seal.seal(msgspec.msgpack.encode(output)))
        await until(lambda: fenced == ["c0"], 5, "c0 to be fenced", keep_alive=[c1])
        assert not dispatcher.scheduler.views["c0"].alive
        moved = await c1.next_task(GenerateTask)
        assert moved.request_id == "r" and events == []
    finally:
        c0.close()
        c1.close()
