"""A tensor-parallel instance under the Ray launcher reserves a placement group of one
bundle per rank (its own module: the Ray modules' servers hold the session cluster's CPUs
while their module runs)."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import RAY_ENV, ray_list
from tests.cluster.serving import MODEL, served

pytestmark = pytest.mark.slow


def placement_groups(address: str) -> list[dict]:
    return ray_list("placement-groups", address)


def test_a_tensor_parallel_instance_reserves_one_bundle_per_rank(ray_cluster) -> None:
    with served(
        "--mode", "colocated", "--launcher", "ray", "--ray-address", ray_cluster,
        "--num-colocated", "1", "-tp", "3", "--kv-cache-memory", "64MiB",
        "--max-model-len", "512", "--enable-test-hooks", env=RAY_ENV,
    ) as server:  # fmt: skip
        result = server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert result.choices[0].text is not None
        groups = [g for g in placement_groups(ray_cluster) if g["state"] == "CREATED"]
        [group] = [g for g in groups if g["name"] == "colocated-0-ranks"]
        assert len(group["bundles"]) == 3, group
    left = [g for g in placement_groups(ray_cluster) if g["name"] == "colocated-0-ranks"]
    assert all(g["state"] == "REMOVED" for g in left)
