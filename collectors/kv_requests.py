"""KV events -> request-shaped accesses (:class:`kvtier.policies.base.Request`) for the placement policy.

A hook beside :class:`~kvtier.collectors.kv_ingest.KvIngestor` (it does not touch the ingestor's hot path):
the caller passes each decoded batch's events to :meth:`RequestInferrer.on_events` after the ingestor.

Inference (engine-tier events only: ``medium`` None/GPU; offload tiers are storage, not requests):

* ``BlockStored(block_hashes=[h1..hk], parent_block_hash=P)``: a request used the whole chain of ``P`` and
  computed ``h1..hk`` -> one request over ``chain(P) + [h1..hk]``, root first.
* the same with hashes already seen (``kv_cache_report_mode: full`` hit reports) -> the same rule: the
  reported hits are the request's prefix.
* consecutive events of one batch that continue each other (an event's parent is the previous event's last
  block: hit report then the newly computed blocks) are one request.

``timestamp_ms`` comes from the injected clock (seconds -> ms), forced non-decreasing; ``input_length`` =
blocks x block size; ``output_length`` is unknown (0). Parent links are remembered for at most
``max_tracked`` blocks (oldest forgotten first: a chain then starts at the oldest remembered ancestor).
Pure apart from the clock; the queue is bounded in requests (``max_pending``) and in blocks
(``max_pending_blocks``: one request can carry a chain of thousands of blocks, and the policy falls behind
exactly when requests flood in); overflow is counted, oldest dropped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

import numpy as np

from kvtier.collectors.vllm_events import BlockStored, tier_of
from kvtier.policies.base import Request
from kvtier.policies.index import to_key
from kvtier.policies.tiers import Tier


class RequestInferrer:
    """Turns KV events into :class:`Request` objects, queued until :meth:`drain`."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        block_size_tokens: int = 16,
        max_tracked: int = 1_000_000,
        max_chain_blocks: int = 8192,
        max_pending: int = 65_536,
        max_pending_blocks: int = 1 << 20,
    ) -> None:
        self.clock = clock
        self.block_size_tokens = block_size_tokens
        self.max_tracked = max_tracked
        self.max_chain_blocks = max_chain_blocks
        self._parent: dict[int, int | None] = {}  # int64 block -> int64 parent (None = root/unknown)
        self._pending: deque[Request] = deque(maxlen=max_pending)
        self.max_pending_blocks = max_pending_blocks
        self._pending_blocks = 0  # blocks in the queued requests' chains (under _count_lock)
        self._count_lock = threading.Lock()  # on_events/submit (event loop) vs drain (tick thread)
        self._last_ms = float("-inf")
        self.counts: dict[str, int] = {"requests": 0, "dropped": 0, "truncated": 0, "skipped_events": 0}

    def __len__(self) -> int:
        return len(self._pending)

    def _chain(self, parent: int | None) -> list[int]:
        out: list[int] = []
        get = self._parent.get
        p = parent
        while p is not None:
            out.append(p)
            if len(out) >= self.max_chain_blocks:
                self.counts["truncated"] += 1
                break
            p = get(p)
        out.reverse()
        return out

    def _remember(self, keys: list[int], parent: int | None) -> None:
        par = self._parent
        for k in keys:
            if k not in par:
                par[k] = parent
            parent = k
        over = len(par) - self.max_tracked
        if over > 0:
            for k in list(islice(par, over)):
                del par[k]

    def on_events(self, events: Iterable[Any]) -> int:
        """Infer requests from one batch's events; returns how many were queued."""
        t = self.clock() * 1000.0
        t = self._last_ms = max(self._last_ms, t)
        reqs: list[tuple[list[int], int]] = []  # (root-first chain, block size)
        for e in events:
            if type(e) is not BlockStored or tier_of(e.medium) is not Tier.GPU or not e.block_hashes:
                continue
            try:
                keys = [to_key(h) for h in e.block_hashes]
                parent = None if e.parent_block_hash is None else to_key(e.parent_block_hash)
            except (TypeError, ValueError):
                self.counts["skipped_events"] += 1
                continue
            bs = e.block_size if e.block_size > 0 else self.block_size_tokens
            if reqs and parent is not None and reqs[-1][0] and reqs[-1][0][-1] == parent:
                reqs[-1][0].extend(keys)  # continues the previous event's request
            else:
                reqs.append((self._chain(parent) + keys, bs))
            self._remember(keys, parent)
        for chain, bs in reqs:
            self._enqueue(Request(t, len(chain) * bs, 0, np.asarray(chain, dtype=np.int64), block_tokens=bs))
        self.counts["requests"] += len(reqs)
        return len(reqs)

    def _enqueue(self, req: Request) -> None:
        """Append, dropping the oldest requests (counted) past either bound."""
        n = int(req.hash_ids.shape[0])
        with self._count_lock:
            pend = self._pending
            while pend and (len(pend) == pend.maxlen or self._pending_blocks + n > self.max_pending_blocks):
                self._pending_blocks -= int(pend.popleft().hash_ids.shape[0])
                self.counts["dropped"] += 1
            pend.append(req)
            self._pending_blocks += n

    @property
    def pending_blocks(self) -> int:
        """Blocks in the queued requests."""
        return self._pending_blocks

    def submit(self, req: Request) -> None:
        """Queue an already request-shaped access (trace replay feeds this)."""
        self._last_ms = max(self._last_ms, float(req.timestamp_ms))
        self._enqueue(req)
        self.counts["requests"] += 1

    def drain(self, max_requests: int | None = None) -> list[Request]:
        """Queued requests, oldest first, at most ``max_requests`` (None = all; thread-safe against
        concurrent :meth:`on_events`)."""
        out: list[Request] = []
        pop = self._pending.popleft
        with self._count_lock:
            while self._pending and (max_requests is None or len(out) < max_requests):
                req = pop()
                self._pending_blocks -= int(req.hash_ids.shape[0])
                out.append(req)
        return out
