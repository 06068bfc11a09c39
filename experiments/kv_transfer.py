"""KV handoff bandwidth and latency between two processes, per transport.

    python -m experiments.kv_transfer [--repeats 5] [--transports ucx-sm,ucx-tcp,zmq,socket]

A prefill process holds requests of 1, 16 and 256 blocks of two layouts (the
embedded SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, block 16, bf16, 360 KiB
per block, so 256 blocks are a 4k-token prompt; and an 8B model: 32 layers, 8 kv
heads, head_dim 128, bf16, 2 MiB per block). A decode process pulls each one through
`KVTransferWorker` exactly as an instance would and times it from `apply(pull)` to
`get_finished()` reporting it: the per-request handoff latency (handshake excluded,
done once in a warm-up). Bandwidth = bytes / median latency. Yardsticks for the same
bytes: "socket", a plain TCP socket on 127.0.0.1 (ask for n bytes, receive them into
a buffer), and "memcpy", one in-process copy (what a single core can move; shared
memory transfers cannot beat it). Block ids are consecutive: one message per pull.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection

LAYOUTS = {
    "smollm2-135m": dict(block_size=16, num_layers=30, num_kv_heads=3, head_dim=64),
    "llama-8b": dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128),
}
BLOCK_COUNTS = (1, 16, 256)
# name → (KVTransferConfig.transport, UCX_TLS)
TRANSPORTS = {
    "ucx-sm": ("ucx", "sm,self"),
    "ucx-tcp": ("ucx", "tcp,self"),
    "ucx-listener-tcp": ("ucx-listener", "tcp,self"),
    "zmq": ("zmq", None),
}
_CONFIG = dict(lease_s=900.0, transfer_timeout_s=120.0, handshake_timeout_s=30.0)


def _layout(name: str):
    from pdserve.kvtransfer import KVLayout

    return KVLayout(dtype="bfloat16", **LAYOUTS[name])


def _storage(name: str, num_blocks: int):
    import numpy as np

    lay = _layout(name)
    shape = (num_blocks, lay.num_layers, 2, lay.num_kv_heads, lay.block_size, lay.head_dim)
    storage = np.empty(shape, dtype=np.uint16)  # bf16 bytes; numpy has no bfloat16
    storage.view(np.uint8)[...] = 0x3C  # touch every page: no zero-page shortcuts
    return storage


def _workers(kind: str, tls: str | None, instance: str, num_blocks: int):
    if tls:
        os.environ["UCX_TLS"] = tls
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from pdserve.decode.kv_puller import DecodeKVPuller
    from pdserve.kvtransfer import KVTransferConfig, KVTransferWorker
    from pdserve.prefill.kv_server import PrefillKVServer

    workers = {}
    for name in LAYOUTS:
        config = KVTransferConfig(f"{instance}-{name}", transport=kind, **_CONFIG)
        storage = _storage(name, num_blocks)
        worker = KVTransferWorker(
            config, storage, _layout(name), serve=PrefillKVServer, pull=DecodeKVPuller
        )
        workers[name] = worker.start()
    return workers


def _request_ids(name: str, count: int, repeats: int) -> list[str]:
    return [f"{name}-{count}-{i}" for i in range(repeats + 1)]


def _prefill(conn: Connection, kind: str, tls: str | None, repeats: int) -> None:
    from pdserve.kvtransfer import KVConnectorMetadata
    from pdserve.kvtransfer.messages import HoldSpec

    workers = _workers(kind, tls, "p", max(BLOCK_COUNTS))
    for name, worker in workers.items():
        holds = [
            HoldSpec(rid, list(range(count)), f"d-{name}", 0)  # the decode side's worker
            for count in BLOCK_COUNTS
            for rid in _request_ids(name, count, repeats)
        ]
        worker.apply(KVConnectorMetadata(holds=holds))
    conn.send({name: w.control_address for name, w in workers.items()})
    conn.recv()  # until the decode side is done
    for worker in workers.values():
        worker.close()


def _decode(conn: Connection, kind: str, tls: str | None, repeats: int) -> None:
    from pdserve.kvtransfer import KVConnectorMetadata, KVSource
    from pdserve.kvtransfer.messages import PullSpec

    addresses = conn.recv()
    workers = _workers(kind, tls, "d", max(BLOCK_COUNTS))
    results = {}
    for name, worker in workers.items():
        for count in BLOCK_COUNTS:
            blocks = list(range(count))
            source = KVSource(f"p-{name}", [addresses[name]], blocks, _layout(name))
            times = []
            for rid in _request_ids(name, count, repeats):
                start = time.perf_counter()
                worker.apply(KVConnectorMetadata(pulls=[PullSpec(rid, source, blocks, blocks)]))
                while True:
                    report = worker.get_finished()
                    if rid in report.finished_recving:
                        break
                    if report.failed:
                        raise RuntimeError(f"{rid} failed: {report.failed}")
                    worker.wait(1.0)
                times.append(time.perf_counter() - start)
            results[(name, count)] = times[1:]  # the first one paid the handshake
    conn.send(results)
    for worker in workers.values():
        worker.close()


def _socket_server(port_conn: Connection) -> None:
    import numpy as np

    server = socket.create_server(("127.0.0.1", 0))
    port_conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    source = np.full(max(BLOCK_COUNTS) * _layout("llama-8b").bytes_per_block, 0x3C, np.uint8)
    view = memoryview(source)
    while header := peer.recv(8, socket.MSG_WAITALL):
        peer.sendall(view[: int.from_bytes(header, "little")])


def _socket_client(port: int, sizes: list[int], repeats: int) -> dict[int, list[float]]:
    import numpy as np

    sink = np.empty(max(sizes), np.uint8)
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = {}
    for size in sizes:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            client.sendall(size.to_bytes(8, "little"))
            view, got = memoryview(sink), 0
            while got < size:
                got += client.recv_into(view[got:size])
            times.append(time.perf_counter() - start)
        results[size] = times[1:]
    client.close()
    return results


def run_transport(kind: str, tls: str | None, repeats: int) -> dict:
    from pdserve.common.wire_auth import ensure_secret  # stdlib only

    ensure_secret()  # the two children inherit it: their control planes must agree
    context = multiprocessing.get_context("spawn")
    p_conn, p_child = context.Pipe()
    d_conn, d_child = context.Pipe()
    prefill = context.Process(target=_prefill, args=(p_child, kind, tls, repeats), daemon=True)
    decode = context.Process(target=_decode, args=(d_child, kind, tls, repeats), daemon=True)
    prefill.start()
    decode.start()
    try:
        if not p_conn.poll(120):
            raise TimeoutError("prefill process did not start")
        d_conn.send(p_conn.recv())
        if not d_conn.poll(1800):
            raise TimeoutError("decode process did not finish")
        return d_conn.recv()
    finally:
        p_conn.send("done")
        for process in (decode, prefill):
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def run_socket(repeats: int) -> dict:
    context = multiprocessing.get_context("spawn")
    port_conn, child = context.Pipe()
    server = context.Process(target=_socket_server, args=(child,), daemon=True)
    server.start()
    try:
        if not port_conn.poll(60):
            raise TimeoutError("socket server did not start")
        sizes = {
            (name, count): count * _layout(name).bytes_per_block
            for name in LAYOUTS
            for count in BLOCK_COUNTS
        }
        by_size = _socket_client(port_conn.recv(), sorted(set(sizes.values())), repeats)
        return {key: by_size[size] for key, size in sizes.items()}
    finally:
        server.kill()
        server.join(timeout=10)


def run_memcpy(repeats: int) -> dict:
    import numpy as np

    results = {}
    for name in LAYOUTS:
        for count in BLOCK_COUNTS:
            source = np.full(count * _layout(name).bytes_per_block, 0x3C, np.uint8)
            target = np.zeros_like(source)
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                np.copyto(target, source)
                times.append(time.perf_counter() - start)
            results[(name, count)] = times[1:]
    return results


YARDSTICKS = {"socket": run_socket, "memcpy": run_memcpy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per size")
    choices = [*TRANSPORTS, *YARDSTICKS]
    parser.add_argument(
        "--transports",
        default=",".join(choices),
        help=f"comma-separated, from {', '.join(choices)}",
    )
    args = parser.parse_args(argv)
    names = [t for t in args.transports.split(",") if t]
    unknown = [t for t in names if t not in choices]
    if unknown or args.repeats < 1:
        parser.error(f"unknown transport {unknown[0]}" if unknown else "--repeats must be >= 1")
    print(f"{'transport':<18}{'layout':<14}{'blocks':>7}{'MiB':>9}"
          f"{'median ms':>11}{'p90 ms':>9}{'GB/s':>8}")  # fmt: skip
    for transport in names:
        if transport in YARDSTICKS:
            results = YARDSTICKS[transport](args.repeats)
        else:
            results = run_transport(*TRANSPORTS[transport], args.repeats)
        for (name, count), times in results.items():
            nbytes = count * _layout(name).bytes_per_block
            median = statistics.median(times)
            p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))]
            rate = nbytes / median / 1e9
            print(f"{transport:<18}{name:<14}{count:>7}{nbytes / 2**20:>9.1f}"
                  f"{median * 1e3:>11.3f}{p90 * 1e3:>9.3f}{rate:>8.2f}")  # fmt: skip
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
