"""The one Ray cluster of a test session, shared by the modules that serve through Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TypeVar

import pytest

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
T = TypeVar("T")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """One local Ray cluster for the session (started by, and stopped with, this process)."""
    os.environ.update(RAY_ENV)
    ray = pytest.importorskip("ray")
    context = ray.init(num_cpus=2, namespace="pdserve-tests", logging_level="ERROR")
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


def ray_list(kind: str, address: str) -> list[dict]:
    """`ray list KIND` (actors, placement-groups, ...) of the cluster at `address`."""
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "list", kind,
         "--address", address, "--format", "json", "--detail"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **RAY_ENV},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="session")
def split_model(tmp_path_factory) -> str:
    """A model folder whose config splits over TP 1, 2, 4 and PP 1, 2 (no weights)."""
    from tests.cluster.gpu_plans import write_split_model

    return write_split_model(tmp_path_factory.mktemp("split-model"))


def in_network_namespace(start: Callable[[], AbstractContextManager[T]]) -> Iterator[T]:
    """What `start` brings up with node B in a network namespace, for a fixture to yield
    from: skipped (saying so) without root; as root, a refused `ip netns` fails the test
    rather than hiding the check."""
    if os.geteuid() != 0:
        pytest.skip("needs root: node B runs in a network namespace (ip netns)")
    try:
        with start() as found:
            yield found
    except RuntimeError as exc:
        pytest.fail(f"two-node cluster: {exc}")
