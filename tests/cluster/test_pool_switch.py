"""The pools' side of a role switch without processes: an instance fits another pool
only with that pool's TP and PP sizes, dtype, quantization, device and Ray resources,
below its `--max-pool-size`, and with KV transfer for a role that moves KV; a moved
instance belongs to (and restarts in) its new pool."""

from __future__ import annotations

import time

import msgspec

from pdserve.cluster.pools import Pools
from pdserve.cluster.supervisor import Supervisor
from pdserve.engine.config import EngineConfig
from pdserve.instance.spec import InstanceSpec
from pdserve.kvtransfer.config import KVTransferConfig
from tests.cluster.processless import ProcesslessLauncher


class ResourceLauncher(ProcesslessLauncher):
    can_start = True

    def __init__(self, resources: dict[str, dict[str, float]] | None = None) -> None:
        super().__init__()
        self.resources = resources or {}
        self.started: list[InstanceSpec] = []

    def resources_of(self, role: str) -> dict[str, float]:
        return self.resources.get(role, {})

    def start_instance(self, spec, on_ready) -> bool:
        self.started.append(spec)
        return True


def spec(instance_id: str, **engine: object) -> InstanceSpec:
    role = instance_id.split("-")[0]
    return InstanceSpec(instance_id=instance_id, role=role, gateway_address="tcp://g:1",
                        engine=EngineConfig(**engine))  # fmt: skip


def pools_of(*specs: InstanceSpec, launcher=None, max_sizes=None) -> Pools:
    launcher = launcher or ResourceLauncher()
    supervisor = Supervisor(launcher, list(specs), lambda info: None)
    return Pools(launcher, supervisor, lambda info: None, max_sizes or {})


def test_an_instance_fits_a_pool_of_its_configuration() -> None:
    pools = pools_of(spec("prefill-0"), spec("decode-0"), spec("decode-1"))
    assert pools.fit("decode-1", "prefill") is None
    assert pools.fit("decode-1", "colocated") is None  # no such pool yet: its own config


def test_an_unlike_configuration_is_named() -> None:
    pools = pools_of(spec("prefill-0", tensor_parallel_size=2), spec("decode-0"), spec("decode-1"))
    why = pools.fit("decode-1", "prefill")
    assert why == "decode-1's tensor_parallel_size is 1, the prefill pool's 2"
    pools = pools_of(spec("prefill-0", dtype="float32"), spec("decode-0"), spec("decode-1"))
    assert "dtype is auto, the prefill pool's float32" in (pools.fit("decode-1", "prefill") or "")


def test_unlike_ray_resources_and_a_full_pool_are_named() -> None:
    launcher = ResourceLauncher({"prefill": {"prefill_slot": 1.0}})
    pools = pools_of(spec("prefill-0"), spec("decode-0"), spec("decode-1"), launcher=launcher)
    assert "the prefill pool for {'prefill_slot': 1.0}" in (pools.fit("decode-1", "prefill") or "")
    pools = pools_of(spec("prefill-0"), spec("decode-0"), max_sizes={"decode": 1})
    full = "the decode pool may hold at most 1 (--max-pool-size)"
    assert pools.fit("prefill-0", "decode") == full


def test_a_colocated_instance_without_kv_transfer_cannot_move_kv() -> None:
    pools = pools_of(spec("colocated-0"), spec("colocated-1"))
    assert "has no KV transfer" in (pools.fit("colocated-1", "decode") or "")
    with_kv = msgspec.structs.replace(
        spec("colocated-2"), kv_transfer=KVTransferConfig(instance_id="colocated-2")
    )
    assert pools_of(with_kv, spec("colocated-0")).fit("colocated-2", "decode") is None


def test_a_move_changes_the_pool() -> None:
    launcher = ResourceLauncher()
    pools = pools_of(spec("prefill-0"), spec("decode-0"), spec("decode-1"), launcher=launcher)
    pools.move("decode-1", "prefill")
    assert pools.members("prefill") == ["prefill-0", "decode-1"]
    assert pools.members("decode") == ["decode-0"]
    pools.supervisor.instance_exited("decode-1", epoch=2)  # it restarts as prefill
    deadline = time.monotonic() + 5
    while not launcher.started and time.monotonic() < deadline:
        time.sleep(0.01)
    restarted = [(s.instance_id, s.role, s.epoch) for s in launcher.started]
    assert restarted == [("decode-1", "prefill", 2)]
    pools.supervisor.close()
