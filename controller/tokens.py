"""Bounded store of block token ids from ``BlockStored`` events, to rebuild a chain's prompt for warm-ups.

Only the most recently stored ``max_blocks`` blocks are kept (LRU), as packed int32 bytes, so memory stays
bounded (~200 bytes per kept 32-token block) however many blocks the index tracks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.policies.index import to_key


class TokenStore:
    """hash -> (parent hash, this block's tokens). Keys are int64-folded like the block index."""

    def __init__(self, max_blocks: int = 65536) -> None:
        self.max_blocks = max_blocks
        self._d: OrderedDict[int, tuple[int | None, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: int) -> bool:
        return to_key(h) in self._d

    def on_block_stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int
    ) -> int:
        """Record a ``BlockStored`` event (tokens cover ``len(hashes)`` full blocks). Returns blocks kept."""
        if block_size <= 0 or not token_ids or len(token_ids) < len(hashes) * block_size:
            return 0
        toks = np.asarray(token_ids, dtype=np.int32)
        p = None if parent is None else to_key(parent)
        with self._lock:
            for i, h in enumerate(hashes):
                k = to_key(h)
                self._d[k] = (p, toks[i * block_size : (i + 1) * block_size].tobytes())
                self._d.move_to_end(k)
                p = k
            while len(self._d) > self.max_blocks:
                self._d.popitem(last=False)
                self.dropped += 1
        return len(hashes)

    def add_chain(self, hashes: Sequence[int], token_ids: Sequence[int], block_size: int) -> int:
        """Record a root-first chain known from elsewhere (a pin's tokenized prompt)."""
        return self.on_block_stored(hashes, None, token_ids, block_size)

    def chain_tokens(self, h: int, max_depth: int = 4096) -> tuple[int, ...] | None:
        """Tokens of the whole prefix ending with block ``h`` (root first), or None if any link is unknown."""
        parts: list[bytes] = []
        k: int | None = to_key(h)
        with self._lock:
            while k is not None and len(parts) < max_depth:
                e = self._d.get(k)
                if e is None:
                    return None
                parts.append(e[1])
                k = e[0]
        if k is not None:
            return None
        return tuple(np.frombuffer(b"".join(reversed(parts)), dtype=np.int32).tolist())
