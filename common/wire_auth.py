"""The deployment secret: where it comes from, and the keys derived from it.

Once instances sit on several nodes their ZMQ sockets face a network, so every frame
between processes is sealed (`frame_seal.py`) under a key derived from one
per-deployment secret, and so is every tenant's cache salt, under another: one key
never serves two purposes (`derive_key`, HKDF-SHA256 as RFC 5869 has it), so a frame
tag never reveals a salt's key nor the other way round.

The secret comes from the environment (`PDSERVE_DEPLOYMENT_SECRET`, or a file named by
`PDSERVE_DEPLOYMENT_SECRET_FILE` that only its owner may read), never a command line,
which `ps` shows to every local user. `pdserve serve` makes one when none is given and
hands it to its instances: the local launcher's children inherit the environment, Ray
actors read a 0600 file on their node named by `PDSERVE_DEPLOYMENT_SECRET_FILE` (a
path, which Ray's state API may show; never the secret). A process that opens sockets with
no secret at all makes one for itself and puts it in its own environment, so the
children it starts (and peers in the same process) agree with it.

What this does not give: confidentiality (frames travel in clear; run across a trusted
network or a VPN).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

SECRET_ENV = "PDSERVE_DEPLOYMENT_SECRET"
SECRET_FILE_ENV = "PDSERVE_DEPLOYMENT_SECRET_FILE"
FRAME_KEY = "pdserve frame key v1"  # what each derived key is for (HKDF's `info`)
SALT_KEY = "pdserve cache salt key v1"
RENDEZVOUS_KEY = "pdserve rendezvous key v1"
RENDEZVOUS_VALUE_KEY = "pdserve rendezvous value key v1"


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


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose: HKDF-SHA256 (extract, then one block of expand)."""
    prk = hmac.new(b"pdserve deployment", secret, hashlib.sha256).digest()
    return hmac.new(prk, purpose.encode() + b"\x01", hashlib.sha256).digest()


def frame_key(secret: bytes) -> bytes:
    """The key every frame's seal is computed under."""
    return derive_key(secret, FRAME_KEY)


def salt_key(secret: bytes) -> bytes:
    """The key every tenant's cache salt is computed under (`gateway/tenants.py`)."""
    return derive_key(secret, SALT_KEY)


def rendezvous_prefix(secret: bytes, address: str) -> str:
    """The prefix of every key of the worker group whose store is at `address`: only a
    holder of the secret can make one up (`engine/rendezvous.py`)."""
    key = derive_key(secret, RENDEZVOUS_KEY)
    return hmac.new(key, address.encode(), hashlib.sha256).hexdigest() + "/"


def rendezvous_value_key(secret: bytes) -> bytes:
    """The key every value in a worker group's store is sealed under (`engine/rendezvous.py`)."""
    return derive_key(secret, RENDEZVOUS_VALUE_KEY)
