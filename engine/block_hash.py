"""Chained prefix-cache block hashes: what makes two KV blocks interchangeable.

Used by the block manager (engine/block_manager.py), which keeps each request's hashes (one
per full block of `request.all_token_ids`) in its own table and calls `update_block_hashes`
before it looks up or registers the request's blocks. They are extended incrementally as
tokens are appended and never change once computed, because tokens are only ever appended.

A block's hash covers everything that decides its KV values:
  hash(parent block's hash (or ROOT_HASH), the block's token ids, extra keys)
where the extra keys are the request's `cache_salt` (first block only: the chain carries it
on) and the identifiers of the multimodal items whose placeholder tokens overlap the block
(the placeholder token ids alone do not say which image they stand for).

NOTE: hashes are blake2b digests of an explicit little-endian byte encoding, not Python's
`hash()`: str hashing is randomised per process (PYTHONHASHSEED), and stable hashes keep
the door open for sharing a cache index across processes. 128 bits makes a collision
(two different prefixes sharing KV) negligible. Cost: about 1 us per 16-token block.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from .request import Request

_DIGEST_BYTES = 16


def _digest_to_int(digest: bytes) -> int:
    return int.from_bytes(digest, "little")


ROOT_HASH: int = _digest_to_int(hashlib.blake2b(b"vbatch-prefix-cache-root", digest_size=_DIGEST_BYTES).digest())


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> int:
    """The chained hash of one full block (parent None: the first block of a sequence)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update((ROOT_HASH if parent_hash is None else parent_hash).to_bytes(_DIGEST_BYTES, "little"))
    # The token count prefix keeps (tokens, keys) unambiguous whatever the block size.
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        raw = key.encode("utf-8")
        h.update(struct.pack("<I", len(raw)))
        h.update(raw)
    return _digest_to_int(h.digest())


def block_extra_keys(request: Request, block_index: int, block_size: int) -> tuple[str, ...]:
    """The salt (first block) and the identifiers of multimodal items overlapping the block."""
    keys: list[str] = []
    if block_index == 0 and request.cache_salt is not None:
        keys.append("salt:" + request.cache_salt)
    start, end = block_index * block_size, (block_index + 1) * block_size
    for feature in request.mm_features:
        if feature.offset < end and feature.offset + feature.length > start:
            keys.append("mm:" + feature.identifier)
    return tuple(keys)


def update_block_hashes(hashes: list[int], request: Request, block_size: int) -> list[int]:
    """Extend `hashes` (the request's, so far) to cover every full block of its tokens; return it."""
    tokens = request.all_token_ids
    num_full_blocks = len(tokens) // block_size
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i > 0 else None
        block_tokens = tokens[i * block_size:(i + 1) * block_size]
        hashes.append(hash_block(parent, block_tokens, block_extra_keys(request, i, block_size)))
    return hashes
