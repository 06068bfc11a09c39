"""UCX through ucxx's synchronous core API, driven by one I/O thread.

- "ucx": endpoints from worker addresses. On one node UCX moves host memory over
  shared memory (CMA/SysV/POSIX); the TLS setting (`UCX_TLS` or `tls`) decides what
  is allowed, e.g. "sm,self" or "tcp,self". Error handling is off towards a receiver
  that may be reached over shared memory (same node, shared memory allowed), since
  those transports refuse an endpoint with it; a sender that dies mid-message shows
  there as an I/O error on the receive anyway. Towards any other receiver it is on:
  without it a TCP receive whose sender died mid-message never ends, and its blocks
  could never be freed.
- "ucx-listener": endpoints through a UCX listener (sockaddr) with error handling on,
  the across-nodes setup (TCP, RDMA where present).

ucxx offers no per-request cancel from Python, but closing an endpoint cancels the
requests posted through it and tag matching is worker-wide. So receives are posted
through a *group* endpoint that points at this worker itself: cancelling some
receives closes the group (cancelling every unmatched receive in it), opens a new
group, and posts the innocent ones again. Their senders never notice: a message
that arrives in between waits in UCX's unexpected queue for the new receive.
Sends cannot be cancelled: with error handling off a closing endpoint flushes, and a
flush towards a peer that stopped progressing never ends.

Addresses: UCX's TCP transport listens on every network device unless told otherwise.
When the instance has a node address (not loopback) and only TCP / shared-memory
transports are allowed, the devices are narrowed to the one that holds the address
(`UCX_NET_DEVICES` set by the operator wins; RDMA devices are never narrowed away).
ucxx's sockaddr listener ("ucx-listener") binds every interface (0.0.0.0) whatever
the host: its Python API (`UCXListener.create(worker, port, callback)`) takes no
address, though the C++ `ListenerBuilder::host` does; the transport says so once when
it starts, `docs/security.md` names the network-policy step, and a test reads the
bound address from /proc/net/tcp. What keeps strangers out of KV memory there is the
random tags (an unmatched message never lands) and the MAC'd control plane that names
them.

The worker runs in blocking-progress mode: `ready_to_block` arms it and the I/O
thread waits on its epoll descriptor next to the ZMQ sockets.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Any

from pdserve.kvtransfer.transport import TransferOp, Transport

logger = logging.getLogger(__name__)

_OK = 0
_CANCELED = -16  # UCS_ERR_CANCELED
_CLOSE_PERIOD_NS = 200_000_000  # bound on how long closing an endpoint may block
_SIOCGIFADDR = 0x8915
# Transports that use no RDMA device: narrowing the network devices cannot lose one.
_NARROWABLE_TLS = {"tcp", "self", "sm", "shm", "posix", "sysv", "cma", "knem", "xpmem"}
_SHARED_MEMORY_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem"}


def device_of(host: str) -> str | None:
    """The network interface that holds IPv4 `host` (Linux), or None."""
    try:
        wanted = socket.inet_aton(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            if reply[20:24] == wanted:
                return name
    return None


def narrowed_devices(host: str, tls: str | None) -> str | None:
    """The UCX_NET_DEVICES value that keeps UCX's TCP sockets on `host`'s interface, or
    None where it should be left alone."""
    tls = tls or os.environ.get("UCX_TLS")
    if "UCX_NET_DEVICES" in os.environ or not tls:
        return None
    if not {t.strip() for t in tls.split(",")} <= _NARROWABLE_TLS:
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None  # one machine: shared memory and loopback as before
    except ValueError:
        return None
    return device_of(host)


def allows_shared_memory(tls: str | None) -> bool:
    """Whether the TLS setting (`tls`, else UCX_TLS; unset: UCX's choice) lets UCX
    use a shared-memory transport."""
    tls = tls or os.environ.get("UCX_TLS")
    if not tls:
        return True
    names = {t.strip() for t in tls.lstrip("^").split(",")}
    if tls.startswith("^"):  # everything but these
        return not {"sm", "shm"} & names
    return bool(names & (_SHARED_MEMORY_TLS | {"all"}))


def same_node(host: str, other: str) -> bool:
    """Whether two ranks' bind addresses are one node's (unknown counts as the same)."""
    if not host or not other or host == other:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback and ipaddress.ip_address(other).is_loopback
    except ValueError:
        return False


def _ucx() -> Any:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as ucx

    return ucx


def _error_of(request: Any) -> str:
    try:
        request.check_error()
    except Exception as exc:  # ucxx raises one class per UCS status
        return f"{type(exc).__name__}: {exc}"
    return f"UCX status {request.status}"


class _SendOp(TransferOp):
    def __init__(self, request: Any, buffer: Any, nbytes: int):
        super().__init__(nbytes)
        self._request = request
        self._buffer = buffer  # keeps a staging buffer alive until the send is done

    def poll(self) -> bool:
        if not self.done and self._request.completed:
            self.done = True
            if self._request.status != _OK:
                self.error = _error_of(self._request)
        return self.done


class _RecvOp(TransferOp):
    def __init__(self, transport: UcxTransport, array: Any, tag: int, nbytes: int):
        super().__init__(nbytes)
        self._transport = transport
        self._array = array
        self.tag = tag
        self.cancel_requested = False
        self._request: Any = None
        self.post()

    def post(self) -> None:
        self._request = self._transport.post_recv(self)

    def poll(self) -> bool:
        if self.done or not self._request.completed:
            return self.done
        status = self._request.status
        if status == _CANCELED and not self.cancel_requested:
            self.post()  # cancelled only because its group was closed for another op
            return False
        self.done = True
        if status != _OK:
            self.error = "cancelled" if status == _CANCELED else _error_of(self._request)
        return True


class UcxTransport(Transport):
    moves_device_memory = True  # CUDA IPC / NVLink; a UCX built without CUDA fails the send

    def __init__(self, listener: bool, host: str, tls: str | None):
        ucx = _ucx()
        from ucxx._lib.arr import Array

        self._ucx = ucx
        self._array = Array
        self.name = "ucx-listener" if listener else "ucx"
        config = {"TLS": tls} if tls else {}
        device = narrowed_devices(host, tls)
        if device is not None:
            config["NET_DEVICES"] = device
        for key in ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"):
            if f"UCX_{key}" not in os.environ:
                config[key] = "1M"  # the 64 KiB default caps TCP at a fraction of the link
        self._context = ucx.UCXContext(
            config_dict=config, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
        )
        self._worker = ucx.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._error_handling = listener
        self._host = host
        self._shared_memory = allows_shared_memory(tls)
        self._checked: dict[str, bool] = {}  # peer -> error handling on its endpoint
        self._accepted: list[Any] = []  # endpoints senders opened to our listener
        self._listener = None
        if listener:
            self._listener = ucx.UCXListener.create(self._worker, 0, self._accept)
            self._info = f"{host}:{self._listener.port}".encode()
            logger.warning(
                "ucx-listener: the UCX listener on port %d binds every interface, not only "
                "%s (ucxx's listener takes no address): admit only the cluster's nodes to it",
                self._listener.port,
                host,
            )
        else:
            self._info = self._worker.address.tobytes()
        self._peer_info: dict[str, bytes] = {}
        self._endpoints: dict[str, Any] = {}
        self._group = self._open_group()
        self._group_ops: list[_RecvOp] = []

    @property
    def info(self) -> bytes:
        return self._info

    def poll_handles(self) -> list[Any]:
        return [self._worker.epoll_file_descriptor]

    def _accept(self, conn_request: Any) -> None:
        assert self._listener is not None
        endpoint = self._listener.create_endpoint_from_conn_request(conn_request, True)
        self._accepted = [ep for ep in self._accepted if ep.alive] + [endpoint]

    def _open_group(self) -> Any:
        return self._worker.create_endpoint_from_worker_address(self._worker.address, False)

    def add_peer(self, peer: str, info: bytes, host: str = "") -> None:
        self._peer_info[peer] = info
        shared = self._shared_memory and same_node(self._host, host)
        self._checked[peer] = self._error_handling or not shared

    def _endpoint(self, peer: str) -> Any:
        endpoint = self._endpoints.get(peer)
        if endpoint is None:
            info = self._peer_info[peer]
            if self._error_handling:
                host, port = info.decode().rsplit(":", 1)
                endpoint = self._worker.create_endpoint_from_hostname(host, int(port), True)
            else:
                address = self._ucx.UCXAddress.create_from_buffer(info)
                checked = self._checked[peer]
                endpoint = self._worker.create_endpoint_from_worker_address(address, checked)
            self._endpoints[peer] = endpoint
        return endpoint

    def send(self, peer: str, buffer: Any, tag: int) -> TransferOp:
        array = self._array(buffer)
        request = self._endpoint(peer).tag_send(array, self._ucx.UCXXTag(tag))
        return _SendOp(request, buffer, array.nbytes)

    def recv(self, buffer: Any, tag: int) -> TransferOp:
        array = self._array(buffer)
        return _RecvOp(self, array, tag, array.nbytes)

    def post_recv(self, op: _RecvOp) -> Any:
        self._group_ops.append(op)
        return self._group.tag_recv(op._array, self._ucx.UCXXTag(op.tag))

    def cancel_recvs(self, ops: list[TransferOp]) -> None:
        for op in ops:
            if isinstance(op, _RecvOp):
                op.cancel_requested = True
        old_ops = [op for op in self._group_ops if not op.done]
        self._group.close_blocking(_CLOSE_PERIOD_NS, 1)
        self._group = self._open_group()
        self._group_ops = []
        for op in old_ops:
            op.poll()  # innocent cancelled receives go into the new group

    def progress(self) -> None:
        self._worker.progress()
        if len(self._group_ops) > 64:
            self._group_ops = [op for op in self._group_ops if not op.done]

    def ready_to_block(self) -> bool:
        return bool(self._worker.arm())

    def close(self) -> None:
        for endpoint in self._endpoints.values():
            endpoint.close()  # non-blocking: a silent peer must not hang shutdown
        self._endpoints.clear()
        self._group.close_blocking(_CLOSE_PERIOD_NS, 1)
        self._accepted.clear()
        self._listener = None
