"""Shadow experts of the learned policy, addressed by its dense block slots.

An expert serves every request next to the real cache and reports its hits and the slots it evicted.
``arc`` runs natively on slots (:class:`~kvtier.policies.arc.SlotARC`, int32 lists, ~9 B per slot);
any other registry policy is wrapped (:class:`IdExpert`: block ids in, evicted ids mapped back to slots).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvtier.policies.arc import SlotARC
from kvtier.policies.base import HitMask, Policy, Request
from kvtier.policies.slotmap import SlotMap

Evicted = list[int] | npt.NDArray[np.int64]


class SlotExpert(Protocol):
    """One full-size shadow cache over the learned policy's slots."""

    def serve(self, req: Request, slots: npt.NDArray[np.int64]) -> tuple[HitMask, Evicted]:
        """Serve ``req`` (its blocks' slots ``slots``): hit mask, slots evicted while serving it."""
        ...

    def grow(self, new: int) -> None:
        """Room for slots ``0..new-1``."""
        ...


class IdExpert:
    """A registry policy keyed by block ids; evicted ids are mapped to slots through ``slot_of``."""

    def __init__(self, policy: Policy, slot_of: SlotMap) -> None:
        self.policy = policy
        self._slot = slot_of

    def serve(self, req: Request, slots: npt.NDArray[np.int64]) -> tuple[HitMask, Evicted]:
        h = self.policy.access(req)
        gone = self.policy.drain_evicted()
        if not gone:
            return h, []
        es = self._slot.get_many(np.asarray(gone, dtype=np.int64))  # -1: never seen
        return h, es[es >= 0]

    def grow(self, new: int) -> None:
        pass


class ArcExpert(SlotARC):
    """ARC natively over slots (same decisions as the registry's ``arc`` on the block ids)."""

    def serve(self, req: Request, slots: npt.NDArray[np.int64]) -> tuple[HitMask, Evicted]:
        ev: list[int] = []
        h = self.access(slots.tolist(), ev)
        return np.array(h, dtype=np.bool_), ev


def make_expert(name: str, capacity_blocks: int, seed: int, size: int, slot_of: SlotMap) -> SlotExpert:
    """The expert called ``name`` (a registry policy name) over ``size`` initial slots."""
    if name == "arc":
        return ArcExpert(capacity_blocks, size)
    from kvtier.policies.registry import get_policy  # lazy: the registry imports the learned policy

    return IdExpert(get_policy(name, capacity_blocks, seed), slot_of)
