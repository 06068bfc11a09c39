"""The `runtime_env` of every engine actor (instances and their rank processes).

Two things go there: where the deployment secret's file is (`cluster/secret_file.py`),
and Ray's worker niceness at 0. Ray starts worker processes at niceness 15 so that its
own daemons and drivers win the CPU; an engine step then yields to the gateway, the
load balancer and any client on the node, and with threads that meet at barriers one
preempted thread stalls the whole step. An engine is the work the node is for.
"""

from __future__ import annotations

from pdserve.cluster.secret_file import secret_runtime_env

# Read by Ray when it starts the actor's worker process (Ray's own job supervisor sets it
# the same way for the drivers it runs).
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def engine_runtime_env() -> dict[str, dict[str, str]]:
    """An engine actor's `runtime_env`: the secret's file, normal CPU priority."""
    env = secret_runtime_env()
    return {"env_vars": {**env["env_vars"], WORKER_NICENESS_ENV: "0"}}
