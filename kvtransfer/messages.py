"""Everything kvtransfer puts on a wire, as msgspec Structs (no pickle).

Three families:
- the P→D **handoff** (`KVHandoff`), which the serving path carries from the prefill
  instance to the decode instance; `KVSource` inside it says where the KV lives;
- the **control plane** between the I/O threads of two instances (ZMQ ROUTER/DEALER):
  `Hello`/`HelloReply` (handshake), `Pull`, `PullRejected`, `Done`, `Heartbeat`,
  `Abort`, one tagged union, each in a `ControlEnvelope` with its sender's epoch;
- what an instance's driver hands its TP workers each step (`KVConnectorMetadata`)
  and what each worker reports back (`TransferReport`); Structs too, because TP
  workers are separate processes.
"""

from __future__ import annotations

import msgspec

from pdserve.common.messages import KVPullTimes
from pdserve.common.sampling_params import SamplingParams

# Bytes of one element per dtype name (the name is torch's without the "torch." prefix).
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}


class KVLayout(msgspec.Struct, frozen=True):
    """The whole model's KV geometry; a rank holds num_kv_heads / tp_size heads, and with
    pipeline stages only its stage's layers (common/model_split.py:stage_layers).

    Storage per rank (engine/kv_cache.py):
    [num_blocks, stage_layers, 2, num_kv_heads / tp_size, block_size, head_dim].
    """

    block_size: int
    num_layers: int  # all stages together
    num_kv_heads: int  # all ranks together
    head_dim: int
    dtype: str  # "bfloat16", "float32", "float8_e4m3fn", ...
    # Both sides must use the same stages: stage s's layers move to stage s.
    pipeline_parallel_size: int = 1
    # An FP8 cache's k_scale and v_scale of every layer: blocks written with one side's
    # scales are read with the other's, so both must agree (empty for 16/32 bits).
    k_scales: list[float] = []
    v_scales: list[float] = []

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers and all heads (every rank together)."""
        return (
            2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim
        ) * self.itemsize


# ---- the handoff -----------------------------------------------------------------


class KVSource(msgspec.Struct, frozen=True):
    """Where a handed-off request's KV lives: the prefill instance and its blocks."""

    instance_id: str
    # Control address (tcp://host:port) of each rank's kvtransfer I/O thread, by rank:
    # the TP ranks of pipeline stage 0, then of stage 1, ...
    rank_addresses: list[str]
    block_ids: list[int]  # the same ids on every rank, covering the prompt
    layout: KVLayout
    # The prefill instance's epoch when it handed off (`InstanceSpec.epoch`): a decode
    # instance that heard from a later epoch of it drops the handoff.
    epoch: int = 0

    @property
    def tp_size(self) -> int:
        return len(self.rank_addresses) // self.layout.pipeline_parallel_size

    def address_of(self, pp_stage: int, tp_rank: int) -> str:
        return self.rank_addresses[pp_stage * self.tp_size + tp_rank]


class KVHandoff(msgspec.Struct, tag="kv_handoff", kw_only=True):
    """P → D: everything the decode side needs to continue a request."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    first_token_logprob: float | None = None
    # The top alternatives of the first token (token id → logprob), when requested.
    first_token_top_logprobs: dict[int, float] = msgspec.field(default_factory=dict)
    sampling_params: SamplingParams
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    cache_salt: str = ""
    source: KVSource
    # The decode instance's epoch the gateway routed to (the hold names it too): a
    # decode instance in another epoch drops the handoff.
    decode_epoch: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


# ---- control plane (I/O thread to I/O thread) ------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    """D → P, once per peer: who I am, how my KV is laid out, how to reach my memory."""

    instance_id: str
    tp_rank: int
    tp_size: int
    layout: KVLayout
    transport: str  # "ucx", "ucx-listener" or "zmq": both sides must agree
    transport_info: bytes  # a UCX worker address, or host:port of a listener/socket
    pp_stage: int = 0  # the pipeline stage whose layers this rank holds
    host: str = ""  # the node address the rank binds: whether P and D share a node


class HelloReply(msgspec.Struct, tag="hello_reply"):
    instance_id: str
    tp_rank: int
    tp_size: int
    layout: KVLayout
    transport: str
    error: str = ""  # non-empty: the peer refused (layout or transport mismatch)
    pp_stage: int = 0


class BlockRun(msgspec.Struct, array_like=True):
    """`count` consecutive source blocks from `src_start`, sent as one message."""

    src_start: int
    count: int
    tag: int


class Pull(msgspec.Struct, tag="pull"):
    """D → P: send me these blocks (only the ones I lack), these heads, these tags."""

    request_id: str
    transfer_id: int
    head_start: int  # global kv-head range, inside the prefill rank's own heads
    head_end: int
    runs: list[BlockRun]


class PullRejected(msgspec.Struct, tag="pull_rejected"):
    """P → D: the pull will not be (fully) served; D cancels its receives."""

    request_id: str
    transfer_id: int
    reason: str


class Done(msgspec.Struct, tag="done"):
    """D → P: every block of this pull arrived intact; P may release them."""

    request_id: str
    transfer_id: int
    head_start: int
    head_end: int


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """D → P: I still want these requests; renew their leases."""

    request_ids: list[str]


class Abort(msgspec.Struct, tag="abort"):
    """D → P: I gave up on this request (aborted or failed); release it."""

    request_id: str
    reason: str


ControlMessage = Hello | HelloReply | Pull | PullRejected | Done | Heartbeat | Abort


class ControlEnvelope(msgspec.Struct, array_like=True):
    """One control frame: a message and its sending instance's epoch, as the sending
    rank last heard it from its driver (`KVConnectorMetadata.epoch`). A receiver drops
    one from a life of its sender it no longer deals with: a prefill rank, a message
    about a held request from any decode life but the one its hold names; a decode
    rank, a reply from an epoch of the prefill instance older than its handoff's."""

    epoch: int
    message: ControlMessage


_control_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlEnvelope)


def encode_control(message: ControlMessage, epoch: int) -> bytes:
    return _control_encoder.encode(ControlEnvelope(epoch, message))


def decode_control(data: bytes) -> ControlEnvelope:
    return _control_decoder.decode(data)


# ---- driver ↔ TP workers, each step ----------------------------------------------


class HoldSpec(msgspec.Struct):
    """P: keep these blocks for the decode side under a lease: for the one decode
    instance, in the one epoch, the gateway handed the request to (its control
    messages about the request from any other life are dropped)."""

    request_id: str
    block_ids: list[int]
    decode_id: str
    decode_epoch: int


class KeepaliveSpec(msgspec.Struct):
    """D: a handed-off request is queued here; heartbeat its lease until it is pulled."""

    request_id: str
    source: KVSource


class PullSpec(msgspec.Struct):
    """D: pull `src_block_ids` (on P) into `dst_block_ids` (here), position by position."""

    request_id: str
    source: KVSource
    src_block_ids: list[int]
    dst_block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct):
    # The instance's epoch when the driver built this: the ranks' control messages
    # carry the latest one they were handed (a role switch moves it on).
    epoch: int = 0
    holds: list[HoldSpec] = msgspec.field(default_factory=list)
    keepalives: list[KeepaliveSpec] = msgspec.field(default_factory=list)
    pulls: list[PullSpec] = msgspec.field(default_factory=list)
    aborts: list[str] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.holds or self.keepalives or self.pulls or self.aborts)


class TransferReport(msgspec.Struct):
    """What one worker finished since its last report. Every id appears once, when no
    transfer can touch its blocks any more, so the instance may act on it at once."""

    finished_sending: list[str] = msgspec.field(default_factory=list)  # P: D has them
    expired: list[str] = msgspec.field(default_factory=list)  # P: lease ran out
    finished_recving: list[str] = msgspec.field(default_factory=list)  # D: KV arrived
    failed: dict[str, str] = msgspec.field(default_factory=dict)  # D: id → reason
    aborted: list[str] = msgspec.field(default_factory=list)  # either side: abort done
    # D, informational: cancelled transfers whose blocks wait for the cancel to land.
    quarantined: list[str] = msgspec.field(default_factory=list)
    # D: how each finished pull went on this rank (timing, bytes, transport).
    pulls: dict[str, KVPullTimes] = msgspec.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.expired
            or self.finished_recving
            or self.failed
            or self.aborted
        )
