"""An engine actor's runtime_env: the secret's file and Ray's worker niceness at 0 (the
process-level check is in `test_ray_serve.py`)."""

from __future__ import annotations

from pathlib import Path

from pdserve.cluster.actor_env import WORKER_NICENESS_ENV, engine_runtime_env
from pdserve.common.wire_auth import SECRET_FILE_ENV


def test_engine_actors_get_the_secrets_file_and_normal_priority() -> None:
    env = engine_runtime_env()["env_vars"]
    assert env[WORKER_NICENESS_ENV] == "0"
    assert Path(env[SECRET_FILE_ENV]).read_text()
