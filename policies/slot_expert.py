"""Shadow experts of the learned policy, addressed by its dense block slots.

An expert serves every request next to the real cache and reports its hits and the slots it evicted.
``arc`` runs natively on slots (:class:`~kvtier.policies.arc.SlotARC`, int32 lists, ~9 B per slot);
any other registry policy is wrapped (:class:`IdExpert`: fed the slots as block ids).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvtier.policies.arc import SlotARC
from kvtier.policies.base import HitMask, Policy, Request

Evicted = list[int] | npt.NDArray[np.int64]


class SlotExpert(Protocol):
    """One full-size shadow cache over the learned policy's slots."""

    def serve(self, req: Request, slots: npt.NDArray[np.int64]) -> tuple[HitMask, Evicted]:
        """Serve ``req`` (its blocks' slots ``slots``): hit mask, slots evicted while serving it."""
        ...

    @property
    def n_lead(self) -> int:
        """Leading hits (prefix-hit blocks) of the last request served."""
        ...

    def grow(self, new: int) -> None:
        """Room for slots ``0..new-1``."""
        ...


class IdExpert:
    """A registry policy, fed each request with its blocks' slots as ids (a bijection of the block ids, so
    the same decisions): what it evicts is a slot already."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.n_lead = 0

    def serve(self, req: Request, slots: npt.NDArray[np.int64]) -> tuple[HitMask, Evicted]:
        h = self.policy.access(replace(req, hash_ids=slots))
        self.n_lead = int(h.argmin()) if h.shape[0] and not h.all() else h.shape[0]
        gone = self.policy.drain_evicted()
        return h, np.asarray(gone, dtype=np.int64) if gone else []

    def grow(self, new: int) -> None:
        pass


class ArcExpert(SlotARC):
    """ARC natively over slots (same decisions as the registry's ``arc`` on the block ids)."""

    n_lead = 0

    def serve(self, req: Request, slots: npt.NDArray[np.int64]) -> tuple[HitMask, Evicted]:
        ev: list[int] = []
        h = self.access(slots.tolist(), ev)
        self.n_lead = h.index(False) if False in h else len(h)
        return np.array(h, dtype=np.bool_), ev


def make_expert(name: str, capacity_blocks: int, seed: int, size: int) -> SlotExpert:
    """The expert called ``name`` (a registry policy name) over ``size`` initial slots."""
    if name == "arc":
        return ArcExpert(capacity_blocks, size)
    from kvtier.policies.registry import get_policy  # lazy: the registry imports the learned policy

    return IdExpert(get_policy(name, capacity_blocks, seed))
