"""A child process hosting KV transfer workers, driven by a test over a Pipe.

The test process plays the instances' drivers (scheduler halves, block accounting);
each child plays one machine's TP ranks: it owns KV pools of random bytes in the
engine layout and one `KVTransferWorker` per rank, and answers commands. UCX
settings (UCX_TLS, UCX_PROTO_INFO) are applied from `env` before UCX loads, and the
child's stdout/stderr go to a log file so tests can read which UCX lanes moved data.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import signal
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

_POLL_S = 0.02


def logical_kv(layout: dict, num_blocks: int, seed: int) -> Any:
    """The whole model's KV bytes [blocks, layers, 2, all heads, row bytes] for a seed."""
    import numpy as np

    from pdserve.kvtransfer.messages import KVLayout

    lay = KVLayout(**layout)
    row = lay.block_size * lay.head_dim * lay.itemsize
    shape = (num_blocks, lay.num_layers, 2, lay.num_kv_heads, row)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


class _Instance:
    def __init__(self, spec: dict):
        import numpy as np

        from pdserve.decode.kv_puller import DecodeKVPuller
        from pdserve.kvtransfer import KVTransferConfig, KVTransferWorker
        from pdserve.kvtransfer.messages import KVLayout
        from pdserve.prefill.kv_server import PrefillKVServer

        layout = KVLayout(**spec["layout"])
        tp_size = spec["tp_size"]
        heads = layout.num_kv_heads // tp_size
        row = layout.block_size * layout.head_dim * layout.itemsize
        full = None
        if spec.get("seed") is not None:
            full = logical_kv(spec["layout"], spec["num_blocks"], spec["seed"])
        self.storages, self.workers = [], []
        for rank in range(tp_size):
            storage = self._storage(spec, layout, heads)
            raw = self._bytes(storage).reshape(spec["num_blocks"], layout.num_layers, 2, heads, row)
            raw[...] = 0 if full is None else full[:, :, :, rank * heads : (rank + 1) * heads]
            config = KVTransferConfig(**spec["config"])
            worker = KVTransferWorker(
                config, storage, layout, tp_rank=rank, tp_size=tp_size,
                serve=PrefillKVServer, pull=DecodeKVPuller,
            )  # fmt: skip
            self.storages.append(storage)
            self.workers.append(worker.start())
        self.raws = [
            self._bytes(s).reshape(spec["num_blocks"], layout.num_layers, 2, heads, row)
            for s in self.storages
        ]
        self.reports = [{} for _ in range(tp_size)]
        self._np = np

    @staticmethod
    def _storage(spec: dict, layout: Any, heads: int) -> Any:
        dims = (spec["num_blocks"], layout.num_layers, 2, heads, layout.block_size)
        if spec.get("backend") == "torch":
            import torch

            from pdserve.engine.kv_cache import KVCache, KVCacheShape

            dtype = getattr(torch, layout.dtype)
            shape = KVCacheShape(
                layout.num_layers, heads, layout.head_dim, layout.block_size, dtype
            )
            return KVCache(shape, spec["num_blocks"]).storage
        import numpy as np

        numpy_dtype = {4: np.float32, 2: np.float16, 1: np.uint8}[layout.itemsize]
        return np.zeros((*dims, layout.head_dim), dtype=numpy_dtype)

    @staticmethod
    def _bytes(storage: Any) -> Any:
        import numpy as np

        if type(storage).__module__.startswith("torch"):
            import torch

            return storage.view(torch.uint8).numpy()
        return storage.view(np.uint8)

    def collect(self) -> None:
        for rank, worker in enumerate(self.workers):
            report = worker.get_finished()
            acc = self.reports[rank]
            for kind in ("finished_sending", "expired", "finished_recving", "aborted"):
                acc.setdefault(kind, []).extend(getattr(report, kind))
            acc.setdefault("failed", {}).update(report.failed)
            acc["quarantined"] = list(report.quarantined)

    def digests(self, rank: int, block_ids: list[int]) -> list[list[str]]:
        """sha256 of each (block, local head) across all layers, K and V."""
        raw = self.raws[rank]
        return [
            [hashlib.sha256(raw[b, :, :, h].tobytes()).hexdigest() for h in range(raw.shape[3])]
            for b in block_ids
        ]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def serve(conn: Connection, env: dict[str, str], log_path: str) -> None:
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from pdserve.kvtransfer.messages import KVConnectorMetadata

    instances: dict[str, _Instance] = {}

    def start(name: str, spec: dict) -> list[str]:
        instances[name] = _Instance(spec)
        return [w.control_address for w in instances[name].workers]

    def apply(name: str, rank: int, metadata: bytes) -> None:
        decoded = msgspec.msgpack.decode(metadata, type=KVConnectorMetadata)
        instances[name].workers[rank].apply(decoded)

    def reports(name: str, rank: int) -> dict:
        instances[name].collect()
        report, instances[name].reports[rank] = instances[name].reports[rank], {}
        return report

    def stats(name: str, rank: int) -> dict:
        return asdict(instances[name].workers[rank].stats())

    def fill(name: str, rank: int, block_ids: list[int], value: int) -> None:
        for b in block_ids:
            instances[name].raws[rank][b] = value

    handlers = {
        "start": start,
        "apply": apply,
        "reports": reports,
        "stats": stats,
        "digests": lambda name, rank, ids: instances[name].digests(rank, ids),
        "fill": fill,
        "close": lambda name: instances.pop(name).close(),
    }
    while True:
        if not conn.poll(_POLL_S):
            for instance in instances.values():
                instance.collect()
            continue
        command, args = conn.recv()
        if command == "exit":
            for instance in instances.values():
                instance.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[command](*args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Peer:
    """The test side of one child process."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path):
        context = multiprocessing.get_context("spawn")
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._conn, child = context.Pipe()
        from pdserve.common.wire_auth import SECRET_ENV, ensure_secret  # stdlib only

        # Every peer of the test shares this process's deployment secret.
        env = {"UCX_WARN_UNUSED_ENV_VARS": "n", SECRET_ENV: ensure_secret(), **env}
        self.process = context.Process(
            target=serve, args=(child, env, str(self.log_path)), daemon=True
        )
        self.process.start()
        child.close()

    def call(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((command, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer to {command} within {timeout}s")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {command} failed: {result}")
        return result

    def apply(self, instance: str, rank: int, metadata: Any) -> None:
        self.call("apply", instance, rank, msgspec.msgpack.encode(metadata))

    def signal(self, signum: int) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.process.join(timeout=10)

    def shutdown(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self.call("exit", timeout=10)
            self.process.join(timeout=5)
        self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def wait_for(predicate: Any, timeout: float, interval: float = 0.01) -> Any:
    """Poll `predicate` until it returns something truthy; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)
