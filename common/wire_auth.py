"""Who may talk to a deployment's sockets: one shared secret, an HMAC on every frame.

Once instances sit on several nodes their ZMQ sockets face a network, so every frame
between the gateway and the instances (tasks, handoffs, outputs, heartbeats, block
events) and on the KV control plane carries `HMAC-SHA256(secret, payload)` in front
of the payload. A receiver checks the tag *before* it decodes anything and drops a
frame without a valid one, with a log line naming the refusal, so a process without
the secret can neither submit tasks, forge tokens, pull KV nor touch leases.

The secret comes from the environment (`PDSERVE_DEPLOYMENT_SECRET`, or a file named by
`PDSERVE_DEPLOYMENT_SECRET_FILE` that only its owner may read), never a command line,
which `ps` shows to every local user. `pdserve serve` makes one when none is given and
hands it to its instances through their environment. A process that opens sockets with
no secret at all makes one for itself and puts it in its own environment, so the
children it starts (and peers in the same process) agree with it.

What this does not give: confidentiality (frames travel in clear; run across a trusted
network or a VPN) or protection against replaying a captured frame.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time

SECRET_ENV = "PDSERVE_DEPLOYMENT_SECRET"
SECRET_FILE_ENV = "PDSERVE_DEPLOYMENT_SECRET_FILE"
TAG_BYTES = 32  # sha256
# The largest frame a receiving ZMQ socket takes (zmq.MAXMSGSIZE: a peer that sends a
# larger one is disconnected before it is buffered). Tasks and handoffs carry at most a
# prompt of max_model_len tokens and a body-limited constraint, far below this.
MAX_FRAME_BYTES = 64 << 20
_REFUSAL_LOG_INTERVAL_S = 5.0  # a flood of forged frames logs a line every few seconds

logger = logging.getLogger(__name__)


class SecretError(RuntimeError):
    """The configured secret cannot be used (unreadable or too open file, empty)."""


def read_secret_file(path: str) -> bytes:
    """The secret in `path`; refused when group or others may read the file."""
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise SecretError(f"{SECRET_FILE_ENV}={path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"{SECRET_FILE_ENV}={path}: readable by others; chmod 600 it")
    if not secret:
        raise SecretError(f"{SECRET_FILE_ENV}={path}: empty")
    return secret


def deployment_secret() -> bytes:
    """This process's deployment secret (see the module's doc for where it comes from)."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value.encode()
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path)
    return ensure_secret().encode()


def ensure_secret() -> str:
    """The secret in the environment, made (and put there) when none is set."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path).decode()
    value = os.environ[SECRET_ENV] = secrets.token_hex(32)
    return value


class Sealer:
    """Puts an HMAC tag in front of outgoing frames and checks it on incoming ones."""

    def __init__(self, secret: bytes | None = None, name: str = "") -> None:
        self._secret = deployment_secret() if secret is None else secret
        if not self._secret:
            raise SecretError("the deployment secret is empty")
        self.name = name  # who refuses, in log lines
        self.refused = 0  # frames dropped for a missing or bad tag
        self._last_log = 0.0

    def _tag(self, parts: tuple[bytes | memoryview, ...]) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            # Each part's length goes in first: ("ab", "c") and ("a", "bc") differ.
            mac.update(memoryview(part).nbytes.to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()

    def seal(self, payload: bytes) -> bytes:
        """The frame to send: tag + payload."""
        return self._tag((payload,)) + payload

    def open(self, frame: bytes, origin: str = "a peer") -> bytes | None:
        """The payload of a frame with a valid tag; None (and a log line) otherwise."""
        if len(frame) >= TAG_BYTES:
            payload = frame[TAG_BYTES:]
            if hmac.compare_digest(frame[:TAG_BYTES], self._tag((payload,))):
                return payload
        self.refuse(origin)
        return None

    def tag_parts(self, *parts: bytes | memoryview) -> bytes:
        """A tag over several frames (sent as a frame of its own, in front of them)."""
        return self._tag(parts)

    def check_parts(self, tag: bytes, *parts: bytes | memoryview, origin: str = "a peer") -> bool:
        if len(tag) == TAG_BYTES and hmac.compare_digest(tag, self._tag(parts)):
            return True
        self.refuse(origin)
        return False

    def refuse(self, origin: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log >= _REFUSAL_LOG_INTERVAL_S or self.refused == 1:
            self._last_log = now
            logger.warning(
                "%s: refused a message from %s without a valid deployment MAC "
                "(%d refused so far; is %s the same on every node?)",
                self.name or "pdserve",
                origin,
                self.refused,
                SECRET_ENV,
            )
