"""Content hashes of full KV blocks, the keys of the prefix cache (vLLM V1's block hashing).

A block's KV depends on every token before it, not only its own, so a block's hash chains its
parent's hash with its own token ids: equal hashes mean an equal whole prefix. `extra_keys`
holds anything else that changes the KV of the same tokens (a LoRA adapter id, a cache salt);
nothing sets it yet, but the slot keeps the key format stable when something does.

SHA-256 rather than Python's `hash()`: a collision would silently serve another prompt's KV,
and a 64-bit non-cryptographic hash can be collided on purpose by a client.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# The parent of a request's first block: a fixed constant, so hashes are stable across runs
# (a restarted server, the simulator and the real engine agree).
ROOT_HASH: BlockHash = hashlib.sha256(b"chunkserve prefix cache v1").digest()


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    return _hash_block_bytes(parent, _token_bytes(token_ids), extra_keys)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # 8 bytes per id ('q'): token ids of any vocabulary fit, and the encoding is unambiguous.
    return array("q", token_ids).tobytes()


def _hash_block_bytes(
    parent: BlockHash, token_bytes: bytes, extra_keys: tuple[object, ...]
) -> BlockHash:
    extra = repr(extra_keys).encode() if extra_keys else b""
    return hashlib.sha256(parent + token_bytes + extra).digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_keys: tuple[object, ...] = (),
) -> list[BlockHash]:
    """Appends to `hashes` (a request's, kept across steps) until it covers `num_blocks` full
    blocks of `token_ids`. Tokens only ever get appended, so earlier hashes never change."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    first = len(hashes)
    if num_blocks <= first:
        return hashes
    parent = hashes[-1] if hashes else ROOT_HASH
    # One conversion for all the new blocks (converting ids is dearer than hashing them).
    data = _token_bytes(token_ids[first * block_size : num_blocks * block_size])
    width = 8 * block_size  # bytes per block
    for i in range(num_blocks - first):
        parent = _hash_block_bytes(parent, data[i * width : (i + 1) * width], extra_keys)
        hashes.append(parent)
    return hashes
