"""The one interface every placement policy implements (baselines, Belady, learned).

The replay harness and the live controller drive the *same* policy objects through it:
replay feeds trace requests, the live loop feeds requests inferred from KV events.
Policies are pure: no I/O, no wall clock (time comes in on each request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

BlockIds = npt.NDArray[np.int64]
HitMask = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Request:
    """One prefix-cache lookup.

    ``hash_ids`` are prefix block ids, root first: an id stands for the whole prefix up to and including
    its block (Mooncake trace ids, or vLLM chained block hashes mapped to int64).
    """

    timestamp_ms: float  # arrival time, milliseconds
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: BlockIds  # int64 prefix block ids, root first
    block_tokens: int = 512  # tokens per block


def prefix_tokens(req: Request, n_lead: int) -> int:
    """Reusable tokens of ``req`` given its first ``n_lead`` blocks hit (0 for a request without blocks)."""
    n = len(req.hash_ids)
    if n == 0:
        return 0
    if n_lead >= n:
        return req.input_length
    return min(n_lead * req.block_tokens, req.input_length)


class Policy(ABC):
    """A fixed-capacity block cache that decides admission and eviction.

    ``access`` serves one request: it reports, per block, whether it was resident when requested,
    admits what the policy wants admitted and evicts to stay within ``capacity_blocks``. Evicted ids
    are queued for :meth:`drain_evicted` so a tier emulator (or the live planner) can demote them.
    """

    name: ClassVar[str]
    offline: ClassVar[bool] = False  # True: needs the future (Belady); replay only

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.seed = seed
        self._evicted: list[int] = []

    def prepare(self, requests: Sequence[Request]) -> None:  # noqa: B027 - optional hook
        """Offline policies see the whole trace here before replay; online ones ignore it."""

    @abstractmethod
    def access(self, req: Request) -> HitMask:
        """Serve one request; return a bool per block of ``req.hash_ids`` (True = hit)."""

    @abstractmethod
    def contains(self, block: int) -> bool:
        """Is ``block`` resident now?"""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks."""

    def drain_evicted(self) -> list[int]:
        """Block ids evicted since the last call, oldest first."""
        out, self._evicted = self._evicted, []
        return out

    def remove(self, block: int) -> bool:
        """Drop ``block`` without counting it as an eviction (e.g. promoted to a faster tier, or the engine
        freed it). Returns whether it was resident. Optional: lower tiers of the emulator need it."""
        raise NotImplementedError(f"{type(self).__name__} does not support remove()")

    def explain(self, block: int) -> dict[str, Any]:
        """Why the policy holds (or would drop) ``block``: features, scores. Empty by default."""
        return {}
