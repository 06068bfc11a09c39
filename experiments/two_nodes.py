"""A two-node Ray cluster on one machine: node A (the head) in this network namespace,
node B in a namespace of its own, joined by a veth pair (10.77.13.1 and 10.77.13.2).

Needs root (`ip netns`). Everything started here is stopped by its PID, and the
namespace and the veth pair are deleted, when the context ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

NAMESPACE = "pdns13"
HOST_LINK, NODE_LINK = "v13a", "v13b"
HEAD_IP, NODE_B_IP = "10.77.13.1", "10.77.13.2"
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# UCX would use shared memory between the namespaces (one host): pin TCP, as across
# machines. The nodes' environment is their actors' environment.
NODE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "UCX_TLS": "tcp,self",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")) if p
    ),
}


@dataclass
class TwoNodes:
    address: str  # the head's GCS, for --ray-address
    log_dir: Path


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def free_port(host: str = "0.0.0.0") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _cleanup_network() -> None:
    """The namespace and veth of this module (a previous run's leftovers included)."""
    for pid in run("ip", "netns", "pids", NAMESPACE).stdout.split():
        # Only processes in this test's own namespace: started by this module.
        _signal(int(pid), signal.SIGKILL)
    run("ip", "netns", "del", NAMESPACE)
    run("ip", "link", "del", HOST_LINK)


def _signal(pid: int, sig: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


def make_network() -> None:
    """Raises RuntimeError naming the command `ip` refused."""
    _cleanup_network()
    steps = [
        ("ip", "netns", "add", NAMESPACE),
        ("ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", NODE_LINK),
        ("ip", "link", "set", NODE_LINK, "netns", NAMESPACE),
        ("ip", "addr", "add", f"{HEAD_IP}/24", "dev", HOST_LINK),
        ("ip", "link", "set", HOST_LINK, "up"),
        (
            "ip",
            "netns",
            "exec",
            NAMESPACE,
            "ip",
            "addr",
            "add",
            f"{NODE_B_IP}/24",
            "dev",
            NODE_LINK,
        ),
        ("ip", "netns", "exec", NAMESPACE, "ip", "link", "set", NODE_LINK, "up"),
        ("ip", "netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up"),
    ]
    for step in steps:
        done = run(*step)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(step)}` failed: {done.stderr.strip()}")


def _start_node(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **NODE_ENV}, start_new_session=True,
        )  # fmt: skip


def _wait_for_nodes(address: str, count: int, nodes: list[subprocess.Popen], log_dir: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for node in nodes:
            if node.poll() is not None:
                raise RuntimeError(f"a ray node exited with {node.returncode}; see {log_dir}")
        status = subprocess.run(
            [RAY, "status", "--address", address], capture_output=True, text=True,
            timeout=60, env={**os.environ, **NODE_ENV},
        )  # fmt: skip
        if "node_a" in status.stdout and "node_b" in status.stdout:
            return
        time.sleep(1)
    raise RuntimeError(f"the two Ray nodes did not come up within 90 s; see {log_dir}")


def _wait_for_port(host: str, port: int, node: subprocess.Popen, log_dir: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise RuntimeError(f"the Ray head exited with {node.returncode}; see {log_dir}")
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the Ray head's GCS did not listen within 60 s; see {log_dir}")


def _stop(process: subprocess.Popen) -> None:
    """`ray start --block` stops its node's processes on SIGTERM; its session (started
    here) is killed if it does not."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal(-process.pid, signal.SIGKILL)
            process.wait()


A_RESOURCES = {"node_a": 8}
B_RESOURCES = {"node_b": 8}


def _ports() -> list[str]:
    """Free ports for the per-node servers Ray would otherwise put on fixed ones."""
    flags = (
        "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
    )  # fmt: skip
    return [x for flag in flags for x in (flag, str(free_port()))]


@contextmanager
def two_nodes(
    log_dir: Path,
    a_resources: dict[str, float] = A_RESOURCES,
    b_resources: dict[str, float] = B_RESOURCES,
) -> Iterator[TwoNodes]:
    """`a_resources`, `b_resources`: each node's custom resources (both have 2 CPUs)."""
    make_network()
    nodes: list[subprocess.Popen] = []
    # Ray's unix sockets live under its temp dir: a pytest path is too long for them.
    ray_temp = tempfile.mkdtemp(prefix="r13-", dir="/tmp")
    try:
        port = free_port(HEAD_IP)
        address = f"{HEAD_IP}:{port}"
        head = [RAY, "start", "--head", "--block", "--node-ip-address", HEAD_IP,
                "--port", str(port), "--num-cpus", "2", "--resources", json.dumps(a_resources),
                "--include-dashboard=false", "--temp-dir", ray_temp, *_ports()]  # fmt: skip
        nodes.append(_start_node(head, log_dir / "head.log"))
        node_b = ["ip", "netns", "exec", NAMESPACE, RAY, "start", "--block",
                  "--address", address, "--node-ip-address", NODE_B_IP, "--num-cpus", "2",
                  "--resources", json.dumps(b_resources)]  # fmt: skip
        _wait_for_port(HEAD_IP, port, nodes[0], log_dir)  # the head's GCS first
        nodes.append(_start_node(node_b, log_dir / "node_b.log"))
        _wait_for_nodes(address, 2, nodes, log_dir)
        yield TwoNodes(address, log_dir)
    finally:
        for node in reversed(nodes):
            _stop(node)
        _cleanup_network()
        shutil.rmtree(ray_temp, ignore_errors=True)


def start_spare_node(nodes: TwoNodes, resources: dict[str, float], name: str) -> Callable[[], None]:
    """One more Ray node on node A's address (room for instances once node B is lost);
    returns what stops it. `name` must be one of its resources."""
    temp = tempfile.mkdtemp(prefix="r13s-", dir="/tmp")
    command = [RAY, "start", "--block", "--address", nodes.address, "--node-ip-address",
               HEAD_IP, "--num-cpus", "2", "--resources", json.dumps(resources),
               "--temp-dir", temp, *_ports()]  # fmt: skip
    process = _start_node(command, nodes.log_dir / "spare.log")

    def stop() -> None:
        _stop(process)
        shutil.rmtree(temp, ignore_errors=True)

    try:
        _wait_for_resource(nodes, name, process)
    except BaseException:
        stop()
        raise
    return stop


def _wait_for_resource(nodes: TwoNodes, name: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"a ray node exited with {process.returncode}; see {nodes.log_dir}")
        status = subprocess.run(
            [RAY, "status", "--address", nodes.address], capture_output=True, text=True,
            timeout=60, env={**os.environ, **NODE_ENV},
        )  # fmt: skip
        if name in status.stdout:
            return
        time.sleep(1)
    raise RuntimeError(f"the node with {name} did not join within 90 s; see {nodes.log_dir}")


def kill_node_b() -> list[int]:
    """SIGKILL to every process in node B's namespace (its raylet, workers, actors):
    the node is lost as a machine that dies would be. Returns their pids."""
    pids = [int(pid) for pid in run("ip", "netns", "pids", NAMESPACE).stdout.split()]
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    return pids


def established(namespace: str | None = None) -> list[tuple[str, str, str]]:
    """(local address, peer address, process name) of every established TCP connection."""
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    out = run(*prefix, "ss", "-tnpH", "state", "established").stdout
    return [_row(line, 2) for line in out.splitlines() if "users:" in line]


def listening(namespace: str | None = None) -> list[tuple[str, str]]:
    """(local address, process name) of every listening TCP socket."""
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    out = run(*prefix, "ss", "-tlnpH").stdout
    return [
        (row[0], row[2]) for row in (_row(line, 3) for line in out.splitlines() if "users:" in line)
    ]


def _row(line: str, skip: int) -> tuple[str, str, str]:
    fields = line.split()
    local, peer = fields[skip], fields[skip + 1]
    process = line.split('(("', 1)[1].split('"', 1)[0]
    return local, peer, process
