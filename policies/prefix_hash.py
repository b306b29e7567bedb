"""vLLM prefix block hashes recomputed from token ids (pure), so pins and warm-ups can name blocks.

vLLM chains ``h((parent or NONE_HASH, tuple(block_tokens), extra_keys))`` over full blocks, with
``NONE_HASH = h(seed)`` (seed ``PYTHONHASHSEED`` or ``"vllm-none-hash"``). Only ``sha256_cbor`` (canonical
CBOR, then SHA-256) is reproducible outside vLLM's Python process, so the engine must run with
``--prefix-caching-hash-algo sha256_cbor``. KV events carry the digest's low 64 bits (big-endian) as an int.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2

DEFAULT_SEED = "vllm-none-hash"


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj``."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    return sha256_cbor(seed)


def digest_to_int(d: bytes) -> int:
    """The uint64 vLLM publishes in KV events for a digest (its low 64 bits, big-endian)."""
    return int.from_bytes(d, "big") & ((1 << 64) - 1)


def block_hashes(token_ids: Sequence[int], block_size: int, *, seed: str = DEFAULT_SEED) -> list[int]:
    """uint64 event hashes of every full block of ``token_ids`` (root first); a partial tail is not hashed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    parent = none_hash(seed)
    out: list[int] = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = sha256_cbor((parent, tuple(int(t) for t in token_ids[i : i + block_size]), None))
        out.append(digest_to_int(parent))
    return out
