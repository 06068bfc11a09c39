"""The shape of a tensor-parallel instance's Ray resources, on GPUs too (no GPU here: the
placement group is not reserved, its bundle and the actors' options are inspected): one
whole GPU per rank bundle, as many in all as the plan counted for the instance."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from pdserve.cli import build_parser  # noqa: E402
from pdserve.cluster import ray_launcher  # noqa: E402
from pdserve.cluster.deployment import Deployment  # noqa: E402
from pdserve.cluster.launcher import LaunchError  # noqa: E402
from pdserve.cluster.ray_ranks import RayRanks, rank_options  # noqa: E402
from pdserve.cluster.serve import instance_specs, make_launcher  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.instance.spec import InstanceSpec  # noqa: E402
from tests.cluster.gpu_plans import PLANS, plan_id  # noqa: E402


def placement_of(monkeypatch, gpus: float, tp: int) -> tuple[dict, dict]:
    """(the bundle each rank gets, the instance actor's options)."""
    launcher = ray_launcher.RayLauncher(
        num_cpus={"decode-0": 2.0}, num_gpus={"decode-0": gpus},
        resources={"decode": {"gpu_node": 1.0}},
    )  # fmt: skip
    asked: dict = {}

    def reserve(instance_id, ranks, stages, bundle, timeout_s):  # stands in for the GPUs
        asked.update(instance_id=instance_id, ranks=ranks, stages=stages, bundle=bundle)
        return ["the stage-0 group"]

    monkeypatch.setattr(ray_launcher, "reserve_rank_groups", reserve)
    spec = InstanceSpec(
        instance_id="decode-0", role="decode", gateway_address="tcp://g:1",
        engine=EngineConfig(tensor_parallel_size=tp),
    )  # fmt: skip
    options = launcher._placement(spec)
    assert (asked["instance_id"], asked["ranks"], asked["stages"]) == ("decode-0", tp, 1)
    return asked["bundle"], options


def test_each_rank_bundle_asks_one_gpu_its_cpus_and_the_pools_resources(monkeypatch):
    bundle, driver = placement_of(monkeypatch, gpus=2.0, tp=2)  # the plan: 2 GPUs for 2 ranks
    assert bundle == {"CPU": 1.0, "GPU": 1.0, "gpu_node": 1.0}
    assert rank_options(bundle) == {"num_cpus": 1.0, "num_gpus": 1.0,
                                    "resources": {"gpu_node": 1.0}}  # fmt: skip
    # The instance actor sits beside rank 0 asking for nothing: the ranks hold it all.
    assert (driver["num_cpus"], driver["num_gpus"]) == (0, 0)
    strategy = driver["scheduling_strategy"]
    assert (strategy.placement_group, strategy.placement_group_bundle_index) == (
        "the stage-0 group", 0,
    )  # fmt: skip


def test_ranks_sharing_cores_get_fractional_cpus_and_no_gpu_on_cpu(monkeypatch):
    bundle, _ = placement_of(monkeypatch, gpus=0.0, tp=3)
    assert bundle == {"CPU": pytest.approx(2 / 3), "gpu_node": 1.0}
    assert rank_options(bundle)["num_gpus"] == 0


@pytest.mark.parametrize("gpus", [1.0, 0.5])
def test_a_gpu_share_below_one_per_rank_is_refused(monkeypatch, gpus: float) -> None:
    """Ray hands fractional GPUs out packed: two ranks of one group could get one GPU,
    which NCCL refuses."""
    with pytest.raises(LaunchError, match="two ranks of decode-0 on one GPU") as refused:
        placement_of(monkeypatch, gpus=gpus, tp=2)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "plan", [p for p in PLANS if not isinstance(p[3], str)], ids=plan_id
)  # the plans that fit (tests/cluster/test_placement.py checks the refusals)
def test_ray_is_asked_for_the_gpus_the_plan_counted(plan, split_model, monkeypatch) -> None:
    num_gpus, tp, pp, _ = plan
    argv = build_parser().parse_args(
        ["serve", "--model", split_model, "-tp", str(tp), "-pp", str(pp)]
    )
    deployment = Deployment.from_args(argv, list(range(16)), [str(i) for i in range(num_gpus)])
    launcher = make_launcher(deployment, 8000)
    asked: list[tuple[int, int, dict]] = []
    monkeypatch.setattr(
        ray_launcher, "reserve_rank_groups",
        lambda instance_id, ranks, stages, bundle, timeout_s: asked.append(
            (ranks, stages, bundle)) or ["group"] * stages,
    )  # fmt: skip
    specs = [s for wave in instance_specs(deployment, split_model, "tcp://g:1", ray=True)
             for s in wave]  # fmt: skip
    for spec, planned in zip(specs, deployment.instances, strict=True):
        options = launcher._placement(spec)
        if tp * pp == 1:
            assert options["num_gpus"] == planned.num_gpus  # the instance actor holds it
            continue
        ranks, stages, bundle = asked.pop(0)
        assert (ranks, stages, bundle["GPU"]) == (tp * pp, pp, 1.0)
        assert ranks * bundle["GPU"] == planned.num_gpus == tp * pp
        assert rank_options(bundle)["num_gpus"] == 1.0


def test_a_rank_actor_uses_the_one_gpu_ray_shows_it() -> None:
    ranks = RayRanks("127.0.0.1", "decode-0")
    assert ranks.devices(4, "cuda") == ["cuda:0"] * 4
    assert ranks.devices(2, "cpu") == ["cpu"] * 2


def _job(host: str):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.ranks import RankJob
    from pdserve.kvtransfer.config import KVTransferConfig
    from pdserve.kvtransfer.connector import TransferConnectorFactory

    factory = TransferConnectorFactory(KVTransferConfig(instance_id="p", host=host))
    return RankJob(EngineConfig(), 2, 4, "10.77.0.1:29500", factory)


def test_a_rank_on_another_node_binds_its_kv_connector_on_its_own_node(monkeypatch) -> None:
    from pdserve.cluster import ray_ranks

    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.77.0.2")  # this rank's node
    moved = ray_ranks.on_this_node(_job("10.77.0.1"))  # the driver's node
    assert moved.connector.config.host == "10.77.0.2"
    assert moved.master == "10.77.0.1:29500"  # the rendezvous stays on the driver's node
    same = _job("10.77.0.2")
    assert ray_ranks.on_this_node(same) is same
    local = _job("127.0.0.1")  # one machine: nothing moves
    assert ray_ranks.on_this_node(local) is local
