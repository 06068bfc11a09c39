"""Content hashes of full KV blocks, the keys of the prefix cache.

A block's hash is sha256 over the msgpack encoding of (parent hash, token ids, extra
keys). Chaining the parent makes a hash name the whole prefix up to the block's end,
so one lookup per block finds the longest cached prefix. The extra keys (the tenant's
cache salt) keep tenants apart. msgpack is a stable byte encoding, so every process —
prefill, decode, the global scheduler — computes the same hash for the same tokens,
which Python's `hash()` would not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BlockHash = bytes  # a 32-byte sha256 digest

_encoder = msgspec.msgpack.Encoder()


def extra_keys_for(cache_salt: str) -> tuple[str, ...]:
    """The extra keys every block of a request with this salt is hashed with."""
    return (cache_salt,) if cache_salt else ()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    payload = _encoder.encode((parent, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...] = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
