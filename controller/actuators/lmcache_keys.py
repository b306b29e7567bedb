"""LMCache MP object keys computed client-side (the ``fs`` L2 adapter cannot list its keys).

Re-implements LMCache 0.5.6's ``TokenHasher`` (blake3 rolling prefix hash over full chunks),
``ObjectKey.ComputeKVRank`` and the ``fs`` adapter's file naming, so kvtier needs no LMCache import.
``tests/cachelayers`` checks these against LMCache's own functions and a live server's L2 files.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3


def _hash_chunk(prefix: bytes | int, tokens: Sequence[int]) -> bytes:
    h = blake3.blake3()
    if isinstance(prefix, int):
        h.update(prefix.to_bytes(8, byteorder="big", signed=True))
    else:
        h.update(prefix)
    h.update(struct.pack(f">{len(tokens)}I", *tokens))
    return h.digest()


NONE_HASH: bytes = _hash_chunk(0, (0,))


def chunk_hashes(token_ids: Sequence[int], chunk_size: int) -> list[bytes]:
    """Rolling blake3 hashes, one per *full* chunk of ``token_ids`` (a trailing partial chunk is dropped)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    out: list[bytes] = []
    prefix: bytes = NONE_HASH
    full = len(token_ids) - len(token_ids) % chunk_size
    for i in range(0, full, chunk_size):
        prefix = _hash_chunk(prefix, token_ids[i : i + chunk_size])
        out.append(prefix)
    return out


def kv_rank(world_size: int = 1, rank: int = 0) -> int:
    """LMCache's packed kv_rank for a single-node setup (world 1, rank 0 -> 0x01000100)."""
    if not (0 < world_size <= 255 and 0 <= rank < world_size):
        raise ValueError(f"bad world_size/rank {world_size}/{rank}")
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """LMCache MP ``EncodedObjectKey`` (the JSON body element of ``DELETE /cache/objects``)."""

    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def encoded(self) -> dict[str, object]:
        return {
            "chunk_hash_hex": self.chunk_hash_hex,
            "model_name": self.model_name,
            "kv_rank": self.kv_rank,
            "object_group_id": self.object_group_id,
            "cache_salt": self.cache_salt,
        }

    def fs_filename(self) -> str:
        """File name the ``fs`` L2 adapter stores this key under."""
        safe_model = self.model_name.replace("/", "-SEP-")
        base = f"{safe_model}@{self.kv_rank:#010x}@{self.object_group_id:x}@{self.chunk_hash_hex}"
        return f"{base}@{self.cache_salt}.data" if self.cache_salt else f"{base}.data"


def object_keys(
    model_name: str,
    token_ids: Sequence[int],
    chunk_size: int,
    *,
    cache_salt: str = "",
    world_size: int = 1,
    ranks: Sequence[int] | None = None,
    object_group_id: int = 0,
) -> list[ObjectKey]:
    """Keys for every full chunk of ``token_ids``, chunk-major, one per rank (default: all ranks).

    ``model_name`` is what the engine registered: for vLLM, the ``--model`` path, not the served name.
    """
    rs = list(range(world_size)) if ranks is None else list(ranks)
    return [
        ObjectKey(h.hex(), model_name, kv_rank(world_size, r), object_group_id, cache_salt)
        for h in chunk_hashes(token_ids, chunk_size)
        for r in rs
    ]
