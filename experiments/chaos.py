"""The chaos suite: faults injected under a steady load of streaming requests.

    python -m experiments.chaos [--scenarios NAME,...] [--skip-node-loss]

Per scenario a steady load of streaming completions runs on the embedded model (greedy
streams, plus one seeded stream at temperature 0.8 in every round of the load) while
the fault is injected; then the load stops, every stream is awaited and the server
must go idle. The table says, per scenario: requests sent, completed, migrated
(`pdserve:requests_migrated_total`) and retried before their first token, failed with
an error event (or an HTTP error), lost (neither complete nor failed: must be 0), wrong
(a completed text unlike the fault-free run's: must be 0), KV blocks still held on
some instance once idle (must be 0), and the seconds from the fault until every pool
is back to its size (`/health`; 0 when no instance left its pool).

The single-node scenarios share one `pdserve serve` (local launcher, 2 prefill + 2
decode, test hooks on, pulls delayed by `PDSERVE_TEST_KV_DELAY_S` so that requests
visibly wait for remote KV). Node loss runs on the two-node Ray setup of
`experiments/two_nodes.py` (needs root for `ip netns`). `tests/cluster/test_chaos.py`
asserts on the same rows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from experiments.chaos_harness import GREEDY, SEEDED, Chaos, Load, Row, Shape, health, wait_for
from experiments.serving import LOCAL, served
from experiments.two_nodes import (
    A_RESOURCES,
    B_RESOURCES,
    NAMESPACE,
    NODE_ENV,
    kill_node_b,
    run,
    start_spare_node,
    two_nodes,
)

KV_DELAY_S = 1.0  # every pull waits this long: requests sit in WAITING_FOR_REMOTE_KVS
INSTANCE_TIMEOUT_S = 6.0
KV_TRANSFER_TIMEOUT_S = 2.0
SHORT_PROMPTS = ("The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,")
# Token ids: a prompt of exactly this length, whatever the tokenizer.
LONG_PROMPT = [1000 + (37 * i) % 20000 for i in range(320)]

LOCAL_SIZES = {"prefill": 2, "decode": 2}
LOCAL_ARGS = (
    *LOCAL, "--num-prefill", "2", "--num-decode", "2", "--dtype", "bfloat16",
    "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--routing-policy", "round_robin",
    "--instance-timeout", str(INSTANCE_TIMEOUT_S),
    "--kv-transfer-timeout", str(KV_TRANSFER_TIMEOUT_S), "--request-timeout", "180",
)  # fmt: skip
LOCAL_ENV = {"PDSERVE_TEST_KV_DELAY_S": str(KV_DELAY_S)}


def shapes(long: bool = False) -> list[Shape]:
    """A round of the load: greedy streams and one seeded stream; with `long`, a long
    greedy prompt in front of the short ones (its prefill takes a while)."""
    greedy = [Shape(f"greedy-{i}", p, GREEDY) for i, p in enumerate(SHORT_PROMPTS)]
    seeded = Shape("seeded", SHORT_PROMPTS[0], SEEDED)
    if long:
        return [Shape("long greedy", LONG_PROMPT, GREEDY), greedy[0], seeded, greedy[1]]
    return [*greedy, seeded]


# ---- the scenarios ------------------------------------------------------------------


def kill_mid_prefill(chaos: Chaos, load: Load) -> None:
    # Two long prompts sent back to back (round robin: one on each prefill instance),
    # and prefill-0 killed while its one computes (asking an instance would wait for
    # its step, which is that prefill).
    wait_for(lambda: len(decoding(load, 2)) >= 1, 60, "streams decoding")
    pid = chaos.instances()["prefill-0"]["pid"]
    load.hold()
    try:
        long = next(shape for shape in load.kinds if isinstance(shape.prompt, list))
        load.send(long)
        load.send(long)
        time.sleep(0.2)
        chaos.kill("prefill-0", pid)
    finally:
        load.resume()


def kill_prefill_after_handoff(chaos: Chaos, load: Load) -> None:
    # No new request while the victim is chosen: every one it served has reached its
    # decode instance (D's first output), and streams decode there.
    wait_for(lambda: len(decoding(load, 2)) >= 2, 60, "streams decoding")
    load.hold()
    try:
        wait_for(lambda: not chaos.in_flight("prefill-1"), 60, "prefill-1 to have handed off all")
        chaos.kill("prefill-1")
    finally:
        load.resume()


def decoding(load: Load, at_least: int) -> set[str]:
    return {f"{p.request_id}-0" for p in load.probes
            if p.request_id and not p.done and len(p.chunks) >= at_least}  # fmt: skip


def kill_mid_decode(chaos: Chaos, load: Load) -> None:
    wait_for(lambda: bool(chaos.in_flight("decode-0") & decoding(load, 3)), 60,
             "a stream decoding on decode-0")  # fmt: skip
    chaos.kill("decode-0")


def waiting_for_kv(chaos: Chaos, load: Load, instance_id: str) -> bool:
    one_token = {f"{p.request_id}-0" for p in load.probes
                 if p.request_id and not p.done and len(p.chunks) == 1}  # fmt: skip
    return bool(chaos.in_flight(instance_id) & one_token)


def kill_waiting_for_kv(chaos: Chaos, load: Load) -> None:
    # One token (P's) streamed; D's pull is held back by the test hook.
    wait_for(lambda: waiting_for_kv(chaos, load, "decode-1"), 60,
             "a request on decode-1 waiting for its KV")  # fmt: skip
    chaos.kill("decode-1")


def sever_transfer(chaos: Chaos, load: Load) -> None:
    # prefill-0 stops answering while a decode instance is to pull from it: the pull
    # times out (--kv-transfer-timeout) and the decode instance applies
    # --kv-failure-policy (recompute); prefill-0 resumes before --instance-timeout.
    wait_for(lambda: waiting_for_kv(chaos, load, "prefill-0"), 60,
             "a request handed off by prefill-0 waiting for its pull")  # fmt: skip
    chaos.pause("prefill-0", KV_DELAY_S + KV_TRANSFER_TIMEOUT_S + 1.5)


def pause_decode(chaos: Chaos, load: Load) -> None:
    wait_for(lambda: bool(chaos.in_flight("decode-0") & decoding(load, 2)), 60,
             "a stream decoding on decode-0")  # fmt: skip
    chaos.pause("decode-0", INSTANCE_TIMEOUT_S + 5)


def fail_every_step(chaos: Chaos, load: Load) -> None:
    # A sticky fault on prefill-0 (the test hook fails each of its steps): its circuit
    # breaker trips, it is fenced and replaced, and its requests go on elsewhere.
    # The pools are timed from its fence: "pools full" is how long its replacement took.
    wait_for(lambda: len(decoding(load, 2)) >= 1, 60, "streams decoding")
    chaos.fail_steps("prefill-0", every_step=True)
    wait_for(lambda: not chaos.alive("prefill-0"), 60, "prefill-0's breaker to trip")
    chaos._watch()


# Token ids only the poison request's prompt has.
POISON_PROMPT = [31000 + i for i in range(24)]


def poison_one_request(chaos: Chaos, load: Load) -> None:
    # Every step fails while one request is on an instance: it fails with the step's
    # reason on its second instance; the requests that shared its steps go on.
    wait_for(lambda: len(decoding(load, 2)) >= 1, 60, "streams decoding")
    instances = [e["id"] for e in health(chaos.server) if e["alive"]]
    for instance_id in instances:
        chaos.fail_steps(instance_id, prompt_prefix=POISON_PROMPT[:8])
    try:
        poison = load.send(Shape("poison", POISON_PROMPT, GREEDY))
        wait_for(lambda: poison.done, 60, "the poison request's end")
    finally:
        for instance_id in instances:
            chaos.fail_steps(instance_id)


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Chaos, Load], None]
    long: bool = False  # long prompts: prefill takes a while
    short_within_s: float = 5.0  # how soon a pool may be seen short


LOCAL_SCENARIOS = [
    Scenario("kill prefill mid-prefill", kill_mid_prefill, long=True),
    Scenario("kill prefill after handoff", kill_prefill_after_handoff),
    Scenario("kill decode mid-decode", kill_mid_decode),
    Scenario("kill decode waiting for KV", kill_waiting_for_kv),
    Scenario(
        "sever a transfer", sever_transfer, short_within_s=KV_DELAY_S + KV_TRANSFER_TIMEOUT_S + 4
    ),
    Scenario("pause decode past timeout", pause_decode, short_within_s=INSTANCE_TIMEOUT_S + 4),
    Scenario("an instance fails every step", fail_every_step),
    Scenario("one request fails every step", poison_one_request),
]


def run_scenario(chaos: Chaos, scenario: Scenario) -> Row:
    return chaos.run(scenario.name, scenario.inject, shapes(scenario.long),
                     short_within_s=scenario.short_within_s)  # fmt: skip


@contextmanager
def local_chaos(*extra: str) -> Iterator[Chaos]:
    """The single-node server of the suite (2 prefill + 2 decode, local launcher)."""
    with served(*LOCAL_ARGS, *extra, env=LOCAL_ENV) as server:
        yield Chaos(server, LOCAL_SIZES)


SLOTS = {"prefill_slot": 1, "decode_slot": 1}  # one instance of each pool per node
NODE_LOSS_ARGS = (
    "--num-prefill", "2", "--num-decode", "2", "--dtype", "bfloat16",
    "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--routing-policy", "round_robin",
    "--threads-per-instance", "1", "--enable-test-hooks",
    "--prefill-resources", '{"prefill_slot": 1}', "--decode-resources", '{"decode_slot": 1}',
    "--instance-timeout", str(INSTANCE_TIMEOUT_S), "--request-timeout", "180",
)  # fmt: skip


def lose_node_b(chaos: Chaos, load: Load) -> None:
    """Every process of node B killed (raylet, workers, its prefill and decode actors)
    while streams decode on both decode instances."""
    wait_for(lambda: len(decoding(load, 2)) >= 2, 60, "streams decoding")
    on_b = set(run("ip", "netns", "pids", NAMESPACE).stdout.split())
    lost = sorted(i for i, found in chaos.instances().items() if str(found["pid"]) in on_b)
    chaos.notes.append(f"node B held {', '.join(lost)}")
    chaos._watch()
    kill_node_b()


NODE_LOSS = Scenario("lose node B (Ray)", lose_node_b, short_within_s=INSTANCE_TIMEOUT_S + 10)


@contextmanager
def node_loss_chaos(log_dir: Path) -> Iterator[Chaos]:
    """2 prefill + 2 decode Ray actors, one of each on node A and on node B (a network
    namespace); once they serve, a spare node on A's address offers room for one more of
    each, where the supervisor's replacements land after node B is lost. Needs root."""

    with ExitStack() as stack:
        nodes = stack.enter_context(
            two_nodes(log_dir, {**A_RESOURCES, **SLOTS}, {**B_RESOURCES, **SLOTS})
        )
        spare: list[Callable[[], None]] = []
        stack.callback(lambda: [stop() for stop in spare])  # after the server stopped
        server = stack.enter_context(
            served(
                *NODE_LOSS_ARGS, "--ray-address", nodes.address, env=NODE_ENV, stop_timeout_s=60
            )  # fmt: skip
        )
        spare.append(start_spare_node(nodes, {"spare": 1, **SLOTS}, "spare"))
        yield Chaos(server, LOCAL_SIZES)


# ---- the table ----------------------------------------------------------------------

COLUMNS = ("scenario", "sent", "completed", "migrated", "retried", "failed", "lost", "wrong",
           "leaked blocks", "pools full (s)")  # fmt: skip


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        full = "not within limit" if r.pools_full_s is None else f"{r.pools_full_s:.1f}"
        cells = (r.scenario, r.sent, r.completed, r.migrated, r.retried, r.failed, r.lost,
                 r.wrong, r.leaked_blocks, full)  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def details(rows: list[Row]) -> str:
    out = []
    for r in rows:
        phases = ", ".join(f"{k} at {v:.0f} s" for k, v in r.phases.items())
        out.append(f"{r.scenario}: counters {r.counters}; {phases}, {r.elapsed_s:.0f} s in all")
        out.extend(f"  {note}" for note in r.notes[:10])
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    parser.add_argument("--log-level", default="warning", help="the server's")
    parser.add_argument("--no-node-loss", dest="node_loss", action="store_false",
                        help="skip node loss (it needs root for ip netns)")  # fmt: skip
    args = parser.parse_args()
    wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    local = [s for s in LOCAL_SCENARIOS if not wanted or s.name in wanted]
    rows = []
    if local:
        with local_chaos("--log-level", args.log_level) as chaos:
            for scenario in local:
                rows.append(run_scenario(chaos, scenario))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
            print(f"server log: {chaos.server.log_path}")
    if args.node_loss and (not wanted or NODE_LOSS.name in wanted):
        with tempfile.TemporaryDirectory() as logs, node_loss_chaos(Path(logs)) as chaos:
            rows.append(run_scenario(chaos, NODE_LOSS))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            print(f"server log: {chaos.server.log_path}")
    print(table(rows))
    print(details(rows))


if __name__ == "__main__":
    main()
