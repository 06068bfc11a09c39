"""Role switches on one server (local launcher, 1 prefill + 2 decode, pools of at most
2, every pull delayed a second) under the chaos harness's steady load of streams:
decode-1 becomes prefill, prefill-0 decode, then colocated and decode again; every
request completes with the fault-free text (a decoding instance's streams migrate to
the others with their output so far), none fails or is lost, no KV block is held once
idle, the process is the same, `/health` and `/metrics` show the new role at once, and
a restart beside the switched instances leaves every block free. Refused
with a 409 naming why: a pool at its `--max-pool-size`, the last decoding instance, a
second change of an instance while one runs, the role it has; a tenant's key gets a
403.

The tests run in file order on one server (`experiments/role_switch.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from experiments.chaos_harness import Chaos, Row
from experiments.role_switch import (
    ADMIN,
    Switch,
    ask_switch,
    restart_seconds,
    role_of,
    run_switch,
    switch_chaos,
)
from experiments.serving import ServeProcess

pytestmark = pytest.mark.slow

SWITCHED: list[Switch] = []


@pytest.fixture(scope="module")
def chaos() -> Iterator[Chaos]:
    with switch_chaos() as found:
        yield found


def assert_clean(row: Row) -> None:
    print(row)
    assert row.sent > 0 and row.completed == row.sent, row
    assert (row.failed, row.lost, row.wrong, row.leaked_blocks) == (0, 0, 0, 0), row


def metric(server: ServeProcess, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", server.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_refusals_before_any_switch(chaos) -> None:
    server = chaos.server
    tenant = server.post("/admin/instances/decode-1/role", json={"role": "prefill"})
    assert tenant.status_code == 403  # the tenant's key, not the admin key
    full = ask_switch(server, "prefill-0", "decode")  # decode-0 and decode-1 are there
    assert full.status_code == 409 and "--max-pool-size" in full.json()["error"]["message"]
    same = ask_switch(server, "decode-0", "decode")
    assert same.status_code == 409 and "already" in same.json()["error"]["message"]
    unknown = ask_switch(server, "decode-0", "verifier")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "role"
    assert ask_switch(server, "decode-9", "prefill").status_code == 404


def test_a_decode_instance_becomes_prefill_under_load(chaos) -> None:
    server = chaos.server
    switch = Switch("decode-1", "prefill")
    assert_clean(run_switch(chaos, switch))
    SWITCHED.append(switch)
    assert switch.pid_kept
    assert metric(server, 'pdserve:instance_role{instance="decode-1",role="prefill"}') == 1.0
    assert metric(server, 'pdserve:instance_role{instance="decode-1",role="decode"}') == 0.0
    assert metric(server, 'pdserve:instance_up{instance="decode-1",role="prefill"}') == 1.0
    assert metric(server, 'pdserve:role_switches_total{from="decode",to="prefill"}') == 1.0
    assert metric(server, "pdserve:requests_migrated_total") >= 1.0  # its streams went on


def test_the_last_decoding_instance_may_not_switch(chaos) -> None:
    floor = ask_switch(chaos.server, "decode-0", "prefill")
    assert floor.status_code == 409 and "last decode" in floor.json()["error"]["message"]
    assert role_of(chaos.server, "decode-0") == "decode"


def test_a_prefill_instance_becomes_decode_once_its_blocks_are_pulled(chaos) -> None:
    refused = {}

    def while_switching(server: ServeProcess) -> None:
        # Its handed-off blocks wait for pulls delayed a second: the switch is under way.
        refused["again"] = ask_switch(server, "prefill-0", "colocated")
        refused["drain"] = server.post("/admin/instances/prefill-0/drain", headers=ADMIN)

    switch = Switch("prefill-0", "decode")
    assert_clean(run_switch(chaos, switch, while_switching))
    assert switch.pid_kept
    SWITCHED.append(switch)
    for answer in refused.values():
        assert answer.status_code == 409, answer.text
        assert "another change of prefill-0" in answer.json()["error"]["message"]


@pytest.mark.parametrize("role", ["colocated", "decode"])
def test_prefill_0_switches_under_load(chaos, role: str) -> None:
    switch = Switch("prefill-0", role)
    assert_clean(run_switch(chaos, switch))
    assert switch.pid_kept
    SWITCHED.append(switch)


def test_switched_instances_survive_a_restart_beside_them(chaos) -> None:
    # How a switch's time compares with a restart's is a benchmark's figure
    # (`experiments.role_switch`, BENCHMARKS.md): a busy machine stretches either.
    restart = restart_seconds(chaos, "decode-0")
    print([(s.instance_id, s.role, round(s.seconds, 3)) for s in SWITCHED], restart)
    assert len(SWITCHED) == 4
    chaos.server.assert_blocks_free_or_cached()
