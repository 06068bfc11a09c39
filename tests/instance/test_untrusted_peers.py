"""A process without the deployment secret that reaches an instance's task socket gets
nothing run: its frames are refused before they are decoded, with a log line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import msgspec

from pdserve.common.wire_auth import SECRET_ENV, SECRET_FILE_ENV
from tests.instance.test_step_loop import Harness, generate

# Sends one task without a MAC and one sealed with a secret of its own making.
STRANGER = """
import sys, time, msgspec, zmq
from pdserve.common.messages import GenerateTask
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.frame_seal import TASKS, Sealer
task = msgspec.msgpack.encode(GenerateTask(
    "intruder", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, seed=1),
    arrival_time=0.0))
push = zmq.Context().socket(zmq.PUSH)
push.connect(sys.argv[1])
push.send(task)
push.send(Sealer(TASKS, 'gateway', secret=b'its own').seal(task))  # not the deployment's
time.sleep(0.5)
push.close(linger=1000)
"""


def test_tasks_from_a_process_without_the_secret_never_run(caplog) -> None:
    harness = Harness("colocated")
    try:
        env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
        with caplog.at_level(logging.WARNING, logger="pdserve.common.frame_seal"):
            subprocess.run(
                [sys.executable, "-c", STRANGER, harness.loop.address.task_address],
                env=env, check=True, timeout=60,
            )  # fmt: skip
            harness.turn(20)
        assert harness.tokens("intruder") == []
        assert harness.inspect().block_owners == {}  # nothing was admitted either
        assert harness.loop.io._task_opener.refused == 2
        assert "colocated-0: dropped a tasks frame from a task socket peer" in caplog.text
        # The deployment's own gateway is still heard.
        harness.send(generate("ok", [1, 2, 3], max_tokens=2))
        harness.until(lambda: harness.finished("ok"), "the trusted request")
        assert msgspec.json.encode(harness.tokens("ok")) == b"[4,5]"
    finally:
        harness.close()
