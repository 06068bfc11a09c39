"""Role switches under the chaos harness's steady load, beside a restart's time.

    python -m experiments.role_switch

On one `pdserve serve` (local launcher, 1 prefill + 2 decode, test hooks on, pools of
at most 2, every KV pull delayed 1 s by `PDSERVE_TEST_KV_DELAY_S`) a steady load of
streaming completions (greedy streams and one seeded stream per round,
`experiments/chaos_harness.py`) runs while one instance switches role through
`POST /admin/instances/{id}/role` (a decoding instance's streams migrate to the
others; a prefill instance waits until its blocks are pulled): decode-1 to prefill,
prefill-0 to decode, then prefill-0 (a decode instance now) to colocated and back to
decode. Each row counts what became of every request (completed, failed, lost, wrong
against the fault-free text, KV blocks held once idle) and the seconds from the
request to serving in the new role (`pdserve:role_switch_seconds`). Then decode-0 is
killed and the seconds until its restart serves again are the restart's time on the
same machine. `tests/cluster/test_role_switch.py` asserts on the same rows.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from experiments.chaos import shapes
from experiments.chaos_harness import Chaos, Load, Row, health, wait_for
from experiments.serving import ADMIN_KEY, LOCAL, ServeProcess, served

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "2", "--dtype", "bfloat16",
    "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--routing-policy", "round_robin",
    "--max-pool-size", "2", "--request-timeout", "180",
)  # fmt: skip
# Every pull waits this long: a prefill instance holds its handed-off blocks a while.
ENV = {"PDSERVE_TEST_KV_DELAY_S": "1.0"}
FLOOR = {"decode": 1}  # what every moment of the run has (the switch's floor keeps it)
SWITCHES = [
    ("decode-1", "prefill"),
    ("prefill-0", "decode"),
    ("prefill-0", "colocated"),
    ("prefill-0", "decode"),
]


@dataclass
class Switch:
    instance_id: str
    role: str
    seconds: float = 0.0  # the gateway's: from the request to serving in the new role
    pid_kept: bool = False


def role_of(server: ServeProcess, instance_id: str) -> str | None:
    for entry in health(server):
        if entry["id"] == instance_id and entry["alive"]:
            return str(entry["role"])
    return None


def switch_seconds(server: ServeProcess) -> float:
    """The sum of `pdserve:role_switch_seconds` so far."""
    text = server.get("/metrics").text
    found = re.search(r"^pdserve:role_switch_seconds_sum (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def ask_switch(server: ServeProcess, instance_id: str, role: str, reason: str = "experiment"):
    return server.post(
        f"/admin/instances/{instance_id}/role", json={"role": role, "reason": reason}, headers=ADMIN
    )


def switching(switch: Switch, during: Callable[[ServeProcess], None] | None = None):
    """The load's fault: the switch, asked once the instance has streams to finish
    (`during` runs while it switches), awaited until it serves in its new role."""

    def inject(chaos: Chaos, load: Load) -> None:
        server = chaos.server
        wait_for(lambda: chaos.in_flight(switch.instance_id), 60, "streams on the instance")
        pid = chaos.instances()[switch.instance_id]["pid"]
        before = switch_seconds(server)
        response = ask_switch(server, switch.instance_id, switch.role)
        if response.status_code != 202:
            raise AssertionError(f"switch refused: {response.status_code} {response.text}")
        if during is not None:
            during(server)
        wait_for(lambda: role_of(server, switch.instance_id) == switch.role, 120,
                 f"{switch.instance_id} to serve as {switch.role}")  # fmt: skip
        wait_for(lambda: switch_seconds(server) > before, 10, "the switch's metric")
        switch.seconds = switch_seconds(server) - before
        switch.pid_kept = chaos.instances()[switch.instance_id]["pid"] == pid

    return inject


def run_switch(chaos: Chaos, switch: Switch, during=None) -> Row:
    name = f"{switch.instance_id} to {switch.role}"
    return chaos.run(name, switching(switch, during), shapes(), short_within_s=0.0)


def restart_seconds(chaos: Chaos, instance_id: str) -> float:
    """From a SIGKILL of the instance to its restart serving again (idle server)."""
    wait_for(lambda: role_of(chaos.server, instance_id) is not None, 60, f"{instance_id} up")
    began = time.monotonic()
    chaos.kill(instance_id)
    wait_for(lambda: role_of(chaos.server, instance_id) is None, 30, f"{instance_id}'s death")
    wait_for(lambda: role_of(chaos.server, instance_id) is not None, 120, f"{instance_id} back")
    return time.monotonic() - began


@contextmanager
def switch_chaos(*extra: str) -> Iterator[Chaos]:
    with served(*ARGS, *extra, env=ENV) as server:
        yield Chaos(server, FLOOR)


def main() -> None:
    with switch_chaos() as chaos:
        rows = []
        for instance_id, role in SWITCHES:
            switch = Switch(instance_id, role)
            rows.append((run_switch(chaos, switch), switch))
        restart = restart_seconds(chaos, "decode-0")
    print("| switch | sent | completed | failed | lost | wrong | blocks held | switch s | "
          "restart s | ratio | pid kept |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row, switch in rows:
        print(
            f"| {row.scenario} | {row.sent} | {row.completed} | {row.failed} | {row.lost} "
            f"| {row.wrong} | {row.leaked_blocks} | {switch.seconds:.2f} | {restart:.1f} "
            f"| {switch.seconds / restart:.3f} | {switch.pid_kept} |"
        )
        for note in row.notes:
            print(f"  - {note}")


if __name__ == "__main__":
    main()
