"""The seal on every frame between processes: who, on which channel, which way, in what order.

A sealed frame is a header and its payload. The header names the sender, a random
session of the sending end, the sending end's sequence number and a direction, and
carries HMAC-SHA256 under the deployment's frame key (`wire_auth.frame_key`) over the
channel's name, the direction, the sender, the session, the sequence number and every
part with its length. So a frame opens only

- on the channel and in the direction it was sealed for (a task frame is no output
  frame; a driver's frame to a rank is no rank's reply),
- under the name it was sealed with (a receiver that knows its peer's name, such as a
  ROUTER's routing identity, asks for it: a captured frame replays under no other name),
- once: a receiver keeps the last sequence number of each sender's session and drops
  any frame at or below it (every sending end numbers its frames from one counter and
  every channel keeps one peer's frames in order, so a legitimate frame never is).

A receiver checks a frame's size against its channel's limit *before* hashing, and drops
(and counts, `frame_drops.py`) whatever fails; nothing raises to the caller. Multipart
messages (block events, KV chunks) carry the header as a frame of its own in front.
Frames travel in clear: this is authentication, not confidentiality.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import logging
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.common import frame_drops
from pdserve.common.frame_drops import DROPS, FrameDrops
from pdserve.common.wire_auth import SECRET_ENV, SecretError, deployment_secret, frame_key

logger = logging.getLogger(__name__)

VERSION = 1
TAG_BYTES = 32  # sha256
_FIXED = struct.Struct("<BBB")  # version, direction, the sender's length
_ORDER = struct.Struct("<8sQ")  # session, sequence number
MAX_SENDER_BYTES = 255
MAX_HEADER_BYTES = _FIXED.size + MAX_SENDER_BYTES + _ORDER.size + TAG_BYTES
_ZMQ_SLACK_BYTES = 64 << 10
_SESSIONS_KEPT = 4096  # senders' sessions a receiver remembers (only sealed ones enter)
_REFUSAL_LOG_INTERVAL_S = 5.0  # a flood of forged frames logs a line every few seconds
FORWARD, BACKWARD = 0, 1  # initiator → responder, responder → initiator


@dataclass(frozen=True)
class Channel:
    """A kind of socket pair: its name (bound into every seal, and the metric's label)
    and the largest payload (all parts together, the seal's header aside) a receiver
    hashes."""

    name: str
    max_frame_bytes: int

    @property
    def max_message_bytes(self) -> int:
        """The largest ZMQ frame a receiver takes (`zmq.MAXMSGSIZE`): a payload and its
        seal, and some slack so that a frame just over the limit reaches the seal and is
        counted; ZMQ disconnects a peer that sends more before the frame is kept."""
        return self.max_frame_bytes + MAX_HEADER_BYTES + _ZMQ_SLACK_BYTES


TASKS = Channel("tasks", 64 << 20)  # gateway → instance, instance → peer (handoffs)
OUTPUTS = Channel("outputs", 64 << 20)  # instance → gateway (prompt logprobs can be large)
EVENTS = Channel("events", 16 << 20)  # instance → gateway block events
RANKS = Channel("ranks", 64 << 20)  # a worker group's driver ↔ its Ray rank actors
KV_CONTROL = Channel("kv_control", 4 << 20)  # decode rank ↔ prefill rank: pulls, leases


class Opened(NamedTuple):
    sender: str
    payload: bytes


class Sealer:
    """One end of one channel: seals what it sends, opens what it receives.

    `responder`: the end that answers (binds the ROUTER, or receives a one-way
    channel); its frames go BACKWARD and it accepts only FORWARD ones."""

    def __init__(
        self,
        channel: Channel,
        sender: str,
        *,
        responder: bool = False,
        secret: bytes | None = None,
        name: str = "",
        drops: FrameDrops = DROPS,
    ) -> None:
        raw = deployment_secret() if secret is None else secret
        if not raw:
            raise SecretError("the deployment secret is empty")
        self.channel = channel
        self.sender = sender.encode()
        if len(self.sender) > MAX_SENDER_BYTES:
            raise ValueError(f"a sender's name is at most {MAX_SENDER_BYTES} bytes")
        self._key = frame_key(raw)
        self._sends = BACKWARD if responder else FORWARD
        self._accepts = FORWARD if responder else BACKWARD
        self._session = secrets.token_bytes(8)
        self._numbers = itertools.count(1)  # next() is atomic: threads may share an end
        self._seen: collections.OrderedDict[tuple[bytes, bytes], int] = collections.OrderedDict()
        self._seen_lock = threading.Lock()
        self.name = name or sender  # who refuses, in log lines
        self._drops = drops  # the book this end counts in (the process's by default)
        self.refused = 0  # frames this end dropped
        self._last_log = 0.0

    # ---- sending ------------------------------------------------------------------------

    def seal(self, payload: bytes | memoryview) -> bytes:
        """The frame to send: header + payload."""
        return self.seal_parts(payload) + bytes(payload)

    def seal_parts(self, *parts: bytes | memoryview) -> bytes:
        """The header of a multipart message, sent as a frame in front of its parts."""
        head = _FIXED.pack(VERSION, self._sends, len(self.sender)) + self.sender
        head += _ORDER.pack(self._session, next(self._numbers))
        return head + self._tag(self._sends, self.sender, head[-_ORDER.size :], parts)

    # ---- receiving ----------------------------------------------------------------------

    def open(
        self, frame: bytes, origin: str = "a peer", sender: str | None = None
    ) -> Opened | None:
        """The sender and payload of a frame that passes every check; None otherwise
        (counted, and logged now and then). `sender`: the name the frame must carry."""
        if self.too_large(len(frame)):
            self._drop(frame_drops.OVERSIZED, origin)
            return None
        header = _parse(frame)
        if header is None:
            self._drop(frame_drops.MALFORMED, origin)
            return None
        payload = frame[header.size :]
        name = self.open_parts(frame[: header.size], payload, origin=origin, sender=sender)
        return None if name is None else Opened(name, payload)

    def too_large(self, frame_bytes: int) -> bool:
        """Whether a one-frame message of `frame_bytes` (seal included) is past the
        channel's limit: a receiver that refuses a frame before it opens it (an unknown
        peer) asks this first, so such a frame counts as `oversized` whoever sent it."""
        return frame_bytes > self.channel.max_frame_bytes + MAX_HEADER_BYTES

    def open_parts(
        self,
        head: bytes,
        *parts: bytes | memoryview,
        origin: str = "a peer",
        sender: str | None = None,
    ) -> str | None:
        """The sender's name when the header frame `head` seals `parts`; None otherwise."""
        size = sum(memoryview(p).nbytes for p in parts)
        if len(head) > MAX_HEADER_BYTES or size > self.channel.max_frame_bytes:
            self._drop(frame_drops.OVERSIZED, origin)
            return None
        header = _parse(head)
        if header is None or header.size != len(head) or header.direction != self._accepts:
            # A frame going the other way is malformed here, and never hashed.
            self._drop(frame_drops.MALFORMED, origin)
            return None
        if sender is not None and header.sender != sender.encode():
            self._drop(frame_drops.IDENTITY, origin)
            return None
        expected = self._tag(header.direction, header.sender, header.order, parts)
        if not hmac.compare_digest(expected, header.tag):
            self._drop(frame_drops.BAD_MAC, origin)
            return None
        if not self._admit(header.sender, header.order):
            self._drop(frame_drops.REPLAY, origin)
            return None
        return header.sender.decode(errors="replace")

    def refuse(self, reason: str, origin: str) -> None:
        """Counts (and now and then logs) a frame dropped before or after its seal."""
        self._drop(reason, origin)

    # ---- the parts ----------------------------------------------------------------------

    def _tag(self, direction: int, sender: bytes, order: bytes, parts: tuple) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        channel = self.channel.name.encode()
        mac.update(b"pdserve-frame-v1" + len(channel).to_bytes(2, "little") + channel)
        mac.update(bytes((direction, len(sender))) + sender + order)
        for part in parts:
            # Each part's length goes in first: ("ab", "c") and ("a", "bc") differ.
            mac.update(memoryview(part).nbytes.to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()

    def _admit(self, sender: bytes, order: bytes) -> bool:
        session, number = _ORDER.unpack(order)
        key = (sender, session)
        with self._seen_lock:
            if number <= self._seen.get(key, 0):
                return False
            self._seen[key] = number
            self._seen.move_to_end(key)
            if len(self._seen) > _SESSIONS_KEPT:
                self._seen.popitem(last=False)  # the longest silent session
        return True

    def _drop(self, reason: str, origin: str) -> None:
        self._drops.count(self.channel.name, reason)
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log >= _REFUSAL_LOG_INTERVAL_S or self.refused == 1:
            self._last_log = now
            hint = (
                f"; is {SECRET_ENV} the same on every node?"
                if reason == frame_drops.BAD_MAC
                else ""
            )
            logger.warning(
                "%s: dropped a %s frame from %s (%s; %d dropped so far%s)",
                self.name,
                self.channel.name,
                origin,
                reason,
                self.refused,
                hint,
            )


class _Header(NamedTuple):
    size: int
    direction: int
    sender: bytes
    order: bytes
    tag: bytes


def _parse(frame: bytes) -> _Header | None:
    if len(frame) < _FIXED.size:
        return None
    version, direction, sender_len = _FIXED.unpack_from(frame)
    size = _FIXED.size + sender_len + _ORDER.size + TAG_BYTES
    if version != VERSION or direction not in (FORWARD, BACKWARD) or len(frame) < size:
        return None
    at = _FIXED.size
    sender = bytes(frame[at : at + sender_len])
    order = bytes(frame[at + sender_len : at + sender_len + _ORDER.size])
    return _Header(size, direction, sender, order, bytes(frame[size - TAG_BYTES : size]))
