"""The step loop against a fake executor (ranks without a model; torch unimportable):
what crosses the executor seam, the roles it calls, and its test hooks."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from pdserve.common.frame_drops import DROPS
from pdserve.common.frame_seal import OUTPUTS, TASKS, Sealer
from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InspectTask,
    InstanceAddress,
    InstanceOutput,
    LeakBlocksTask,
    RequestDelta,
    SwitchRoleTask,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.step_plan import KVGeometry, SampledToken, StepPlan, StepResult, WorkerInfo
from pdserve.instance.loop import StepLoop
from pdserve.instance.spec import InstanceSpec
from pdserve.kvtransfer import KVHandoff, KVLayout, KVSource, KVTransferStats, TransferReport
from pdserve.kvtransfer.connector import RankReport

VOCAB = 1000
ENCODER = msgspec.msgpack.Encoder()
PLANS = msgspec.msgpack.Decoder(StepPlan)
# The gateway's ends and a decode peer's, under this process's secret (the instances').
TASK_SEAL = Sealer(TASKS, "gateway")
OUTPUT_OPEN = Sealer(OUTPUTS, "gateway", responder=True)
PEER_OPEN = Sealer(TASKS, "peer", responder=True)


class FakeExecutor:
    """Ranks without a model: each sampled token is the previous token + 1. It keeps
    the requests' tokens only from what the plans carry, as real ranks do."""

    def __init__(self, step_s: float = 0.0) -> None:
        """`step_s`: each step with chunks takes this long, half of it its forward."""
        self.step_s = step_s
        self.plans: list[tuple[float, StepPlan]] = []
        self.tokens: dict[str, list[int]] = {}
        self.next_report = TransferReport()
        self.shut_down = False

    def load(self) -> WorkerInfo:
        return WorkerInfo(
            model_path="fake",
            vocab_size=VOCAB,
            max_model_len=256,
            eos_token_ids=[0],
            generation_defaults={},
            kernels="none",
            kv=KVGeometry(
                num_layers=2,
                num_kv_heads=2,
                head_dim=4,
                block_size=4,
                dtype="float32",
                num_blocks=64,
            ),  # fmt: skip
            connector_addresses=["tcp://127.0.0.1:9"],
        )

    def execute(self, plan: StepPlan) -> StepResult:
        # What crosses the seam survives the wire: no tensors, no live objects.
        wire = ENCODER.encode(plan)
        assert ENCODER.encode(PLANS.decode(wire)) == wire
        self.plans.append((time.monotonic(), plan))
        for request_id in plan.finished_ids:
            self.tokens.pop(request_id, None)
        for new in plan.new_requests:
            self.tokens[new.request_id] = new.prompt_token_ids + new.output_token_ids
        sampled = []
        for chunk in plan.chunks:
            tokens = self.tokens[chunk.request_id]
            if chunk.start + chunk.num_new_tokens == len(tokens):
                tokens.append((tokens[-1] + 1) % VOCAB)
                sampled.append(SampledToken(chunk.request_id, tokens[-1]))
        reports = []
        if plan.kv_connector is not None:
            reports = [RankReport(self.next_report, KVTransferStats())]
            self.next_report = TransferReport()
        forward = None
        if self.step_s and plan.chunks:
            time.sleep(self.step_s)
            forward = self.step_s / 2
        return StepResult(sampled=sampled, kv_reports=reports, forward_seconds=forward)

    def shutdown(self) -> None:
        self.shut_down = True


class Harness:
    """A loaded loop stepped by the test, its gateway socket and a peer socket."""

    def __init__(
        self,
        role: str,
        test_hooks: bool = False,
        engine: EngineConfig | None = None,
        epoch: int = 0,
    ) -> None:
        self.context = zmq.Context()
        self.outputs = self.context.socket(zmq.PULL)
        port = self.outputs.bind_to_random_port("tcp://127.0.0.1")
        self.peer = self.context.socket(zmq.PULL)
        peer_port = self.peer.bind_to_random_port("tcp://127.0.0.1")
        self.peer_address = InstanceAddress("d-peer", "decode", f"tcp://127.0.0.1:{peer_port}")
        gateway = f"tcp://127.0.0.1:{port}"
        spec = InstanceSpec(instance_id=f"{role}-0", role=role, idle_wait_s=0.01,
                            gateway_address=gateway, test_hooks=test_hooks, epoch=epoch,
                            engine=engine or EngineConfig(block_size=4))  # fmt: skip
        self.executor = FakeExecutor()
        self.loop = StepLoop(spec, self.executor)
        self.loop.load()
        self.tasks = self.context.socket(zmq.PUSH)
        self.tasks.connect(self.loop.address.task_address)
        self.deltas: list[RequestDelta] = []
        self.inspections: dict[str, Any] = {}
        self.histograms: dict[str, list[float]] = {}  # every observation shipped
        self.epoch = 0  # of the latest output
        self.unhealthy = ""  # of the latest output
        self.loop_turns = 0
        self.switched: list[tuple[int, Any]] = []  # (epoch, InstanceInfo) of each switch
        self.roles: list[str] = []  # each output's role

    def send(self, task: Any) -> None:
        self.tasks.send(TASK_SEAL.seal(ENCODER.encode(task)))

    def turn(self, count: int = 1) -> None:
        for _ in range(count):
            self.loop.run_once()
        self.collect()

    def collect(self) -> None:
        decoder = msgspec.msgpack.Decoder(InstanceOutput)
        while self.outputs.poll(50):
            output = decoder.decode(OUTPUT_OPEN.open(self.outputs.recv()).payload)
            self.epoch, self.loop_turns = output.epoch, output.loop_turns
            self.unhealthy = output.unhealthy
            self.roles.append(output.instance.role)
            if output.switched is not None:
                self.switched.append((output.epoch, output.switched))
            self.deltas.extend(output.deltas)
            for name, values in (output.metrics.histograms if output.metrics else {}).items():
                self.histograms.setdefault(name, []).extend(values)
            if output.inspection is not None:
                self.inspections[output.inspection.query_id] = output.inspection

    def until(self, condition, what: str, turns: int = 200) -> None:
        for _ in range(turns):
            if condition():
                return
            self.turn()
        raise AssertionError(f"no {what} after {turns} loop turns")

    def tokens(self, request_id: str) -> list[int]:
        return [t for d in self.deltas if d.request_id == request_id for t in d.new_token_ids]

    def finished(self, request_id: str) -> bool:
        return any(d.request_id == request_id and d.finished for d in self.deltas)

    def inspect(self):
        query = f"q{time.monotonic_ns()}"
        self.send(InspectTask(query))
        self.until(lambda: query in self.inspections, "inspection")
        return self.inspections.pop(query)

    def close(self) -> None:
        self.loop.close()
        for sock in (self.outputs, self.peer, self.tasks):
            sock.close(linger=0)
        self.context.term()


def generate(request_id: str, prompt: list[int], max_tokens: int = 4, target=None) -> GenerateTask:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=1, ignore_eos=True)
    return GenerateTask(request_id, prompt, params, arrival_time=0.0, decode_target=target)


@pytest.fixture
def colocated() -> Iterator[Harness]:
    harness = Harness("colocated")
    yield harness
    harness.close()


def test_the_loop_and_its_roles_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pdserve.instance.loop, pdserve.instance.main, pdserve.engine.core\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_a_request_crosses_the_seam_once_in_full_then_by_id(colocated) -> None:
    colocated.send(generate("a", [5, 6, 7, 8, 9, 10, 11], max_tokens=4))
    colocated.until(lambda: colocated.finished("a"), "finished request")
    assert colocated.tokens("a") == [12, 13, 14, 15]
    plans = [plan for _, plan in colocated.executor.plans]
    assert [n.request_id for p in plans for n in p.new_requests] == ["a"]
    first, *rest = plans
    assert first.chunks[0].new_block_ids == [0, 1]  # 7 tokens in blocks of 4
    assert [len(p.chunks) for p in rest] == [1, 1, 1]
    # Block 2 joins when the 9th token needs it; blocks are sent once.
    assert [c.new_block_ids for p in rest for c in p.chunks] == [[], [2], []]
    # The next plan drops the finished request's state on the ranks.
    colocated.send(generate("b", [1, 2], max_tokens=1))
    colocated.until(lambda: colocated.finished("b"), "second request")
    assert "a" in colocated.executor.plans[-1][1].finished_ids
    assert "a" not in colocated.executor.tokens


def test_a_finished_request_ships_its_phase_times(colocated) -> None:
    colocated.send(generate("a", [5, 6, 7], max_tokens=3))
    colocated.until(lambda: colocated.finished("a"), "finished request")
    colocated.turn()  # its output may trail the delta by a turn
    phases = ["request_decode_time_seconds", "request_prefill_time_seconds",
              "request_queue_time_seconds"]  # fmt: skip
    assert sorted(colocated.histograms) == phases
    assert all(len(v) == 1 and v[0] >= 0 for v in colocated.histograms.values())


def test_an_aborted_request_is_dropped_on_the_ranks(colocated) -> None:
    colocated.send(generate("long", [3, 4], max_tokens=50))
    colocated.until(lambda: len(colocated.tokens("long")) >= 2, "first tokens")
    colocated.send(AbortTask(["long"]))
    colocated.send(generate("next", [7], max_tokens=1))
    colocated.until(lambda: colocated.finished("next"), "next request")
    assert any("long" in p.finished_ids for _, p in colocated.executor.plans)
    assert not colocated.finished("long")  # the gateway ended it; no more deltas
    assert colocated.inspect().block_owners == {}


def test_outputs_carry_the_loop_turns_and_the_epoch(colocated) -> None:
    colocated.send(generate("r", [3, 4], max_tokens=20))
    colocated.until(lambda: len(colocated.tokens("r")) >= 2, "first tokens")
    turns = colocated.loop_turns
    assert colocated.epoch == 0 and turns > 0  # the spec's epoch
    colocated.until(lambda: colocated.finished("r"), "the request to finish")
    assert colocated.loop_turns > turns  # the loop turns and says so


def test_a_prefill_role_announces_the_hold_before_the_handoff_leaves() -> None:
    harness = Harness("prefill")
    try:
        prompt = list(range(20, 29))  # 9 tokens: 3 blocks
        harness.send(generate("p", prompt, max_tokens=8, target=harness.peer_address))
        harness.until(lambda: harness.peer.poll(0), "handoff")
        arrived = time.monotonic()
        handoff = msgspec.msgpack.decode(
            PEER_OPEN.open(harness.peer.recv()).payload, type=KVHandoff
        )
        assert handoff.first_token_id == 29 and handoff.sampling_params.seed == 1
        assert harness.tokens("p") == [29]  # the first token went to the gateway too
        holds = [
            at
            for at, plan in harness.executor.plans
            if plan.kv_connector is not None
            and any(h.request_id == "p" for h in plan.kv_connector.holds)
        ]
        assert holds and holds[0] < arrived
        # vLLM's phases: the prefill side ships queue and prefill; decode is D's to report.
        assert sorted(harness.histograms) == [
            "request_prefill_time_seconds", "request_queue_time_seconds",
        ]  # fmt: skip
        assert all(len(v) == 1 and v[0] >= 0 for v in harness.histograms.values())
        assert sorted(harness.inspect().block_owners) == handoff.source.block_ids
        harness.executor.next_report = TransferReport(finished_sending=["p"])
        harness.turn(3)
        assert harness.inspect().block_owners == {}  # released into the prefix cache
    finally:
        harness.close()
    assert harness.executor.shut_down


@pytest.mark.parametrize("hooks", [False, True])
def test_the_leak_hook_acts_only_with_test_hooks(hooks: bool) -> None:
    harness = Harness("colocated", test_hooks=hooks)
    try:
        harness.send(LeakBlocksTask(num_blocks=2))
        harness.turn()
        owners = harness.inspect().block_owners
        assert (owners != {}) == hooks
    finally:
        harness.close()


def test_a_prefill_instance_becomes_decode_once_its_handoffs_are_released() -> None:
    harness = Harness("prefill")
    try:
        harness.send(generate("p", list(range(20, 29)), max_tokens=8, target=harness.peer_address))
        harness.until(lambda: harness.peer.poll(0), "handoff")
        link = harness.loop.link
        harness.send(SwitchRoleTask("decode"))  # names epoch 0: it switches into 1
        harness.turn(5)
        assert harness.switched == [] and harness.epoch == 0  # its blocks are out on loan
        harness.executor.next_report = TransferReport(finished_sending=["p"])
        harness.until(lambda: harness.switched, "the switch")
        ((epoch, info),) = harness.switched
        assert (epoch, info.epoch, info.address.role) == (1, 1, "decode")
        assert info.address.task_address == harness.loop.address.task_address  # same sockets
        assert harness.loop.link is link and harness.loop.spec.role == "decode"
        assert type(harness.loop.role).__name__ == "DecodeRole"
        harness.turn(3)
        assert harness.roles[-1] == "decode" and harness.epoch == 1  # heartbeats alike
        assert harness.inspect().block_owners == {}  # the prompt's blocks stay cached
    finally:
        harness.close()


def test_a_decode_instance_becomes_colocated_and_serves_whole_requests() -> None:
    harness = Harness("decode")
    try:
        harness.send(SwitchRoleTask("colocated"))
        harness.until(lambda: harness.switched, "the switch")
        task = msgspec.structs.replace(generate("c", [5, 6, 7], max_tokens=3), epoch=1)
        harness.send(task)
        harness.until(lambda: harness.finished("c"), "a whole request")
        assert harness.tokens("c") == [8, 9, 10] and harness.epoch == 1
    finally:
        harness.close()


def test_a_colocated_instance_without_kv_transfer_keeps_its_role(colocated) -> None:
    colocated.send(SwitchRoleTask("decode"))
    colocated.turn(3)
    assert colocated.switched == [] and colocated.roles[-1] == "colocated"
    assert type(colocated.loop.role).__name__ == "ColocatedRole"


def test_tasks_sent_across_a_role_switch_are_taken_until_the_new_epoch_is_named() -> None:
    harness = Harness("decode")
    try:
        harness.send(SwitchRoleTask("colocated"))
        harness.until(lambda: harness.switched, "the switch")
        assert harness.epoch == 1
        # Sent before the gateway heard of the switch: it names epoch 0 and is not lost.
        harness.send(InspectTask("in-between", epoch=0))
        harness.until(lambda: "in-between" in harness.inspections, "the in-between task")
        harness.send(InspectTask("named-new", epoch=1))
        harness.until(lambda: "named-new" in harness.inspections, "the new epoch's task")
        # The gateway's socket keeps order: a task for epoch 0 after one for 1 is stale.
        stale = DROPS.totals().get(("tasks", "stale_epoch"), 0)
        harness.send(InspectTask("late", epoch=0))
        harness.send(InspectTask("after-it", epoch=1))
        harness.until(lambda: "after-it" in harness.inspections, "the task after it")
        assert "late" not in harness.inspections
        assert DROPS.totals()[("tasks", "stale_epoch")] == stale + 1
    finally:
        harness.close()


def test_a_restarted_instance_drops_what_was_sent_to_its_retired_epoch() -> None:
    harness = Harness("colocated", epoch=2)
    try:
        harness.send(msgspec.structs.replace(generate("old", [3, 4]), epoch=1))
        harness.send(msgspec.structs.replace(generate("new", [5, 6], max_tokens=2), epoch=2))
        harness.until(lambda: harness.finished("new"), "the request of its own epoch")
        assert harness.tokens("old") == [] and harness.epoch == 2
        assert all(n.request_id == "new" for _, p in harness.executor.plans for n in p.new_requests)
    finally:
        harness.close()


def handoff_to(request_id: str, decode_epoch: int) -> KVHandoff:
    layout = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
    source = KVSource("p-0", ["tcp://127.0.0.1:9"], [0, 1], layout)
    params = SamplingParams(max_tokens=4, temperature=0.0, seed=1, ignore_eos=True)
    return KVHandoff(request_id=request_id, prompt_token_ids=list(range(1, 8)),
                     first_token_id=8, sampling_params=params, source=source,
                     decode_epoch=decode_epoch)  # fmt: skip


def test_a_decode_instance_drops_a_handoff_routed_to_another_of_its_epochs() -> None:
    harness = Harness("decode", epoch=2)
    try:
        stale = DROPS.totals().get(("tasks", "stale_epoch"), 0)
        harness.send(handoff_to("to-epoch-1", 1))  # routed before it was fenced
        harness.send(handoff_to("to-epoch-2", 2))
        harness.turn(3)
        query = "books"
        harness.send(InspectTask(query, epoch=2))
        harness.until(lambda: query in harness.inspections, "the inspection")
        assert harness.inspections[query].unfinished_request_ids == ["to-epoch-2"]
        assert DROPS.totals()[("tasks", "stale_epoch")] == stale + 1
    finally:
        harness.close()
