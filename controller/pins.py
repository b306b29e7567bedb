"""Operator pins: a prefix (its chain of blocks) that must stay in (or be brought to) a tier."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.policies.tiers import TIER_ORDER, Tier


@dataclass(slots=True)
class Pin:
    id: str
    tier: Tier
    blocks: list[int]  # int64 block keys, root first
    created_at_s: float
    ttl_s: float | None = None
    source: str = "block_hash"  # prompt | token_ids | block_hash
    token_ids: list[int] | None = None  # the pinned prefix, when known (warm-ups need it)
    block_size: int = 0
    model: str = ""

    @property
    def expires_at_s(self) -> float | None:
        return None if self.ttl_s is None else self.created_at_s + self.ttl_s

    def expired(self, now_s: float) -> bool:
        e = self.expires_at_s
        return e is not None and now_s >= e

    def tokens_for(self, i: int) -> tuple[int, ...] | None:
        """Prefix tokens up to and including block ``i`` of the chain."""
        if self.token_ids is None or self.block_size <= 0:
            return None
        return tuple(self.token_ids[: (i + 1) * self.block_size])

    def to_dict(self) -> dict[str, Any]:
        """The API view: no token ids (a pin may hold 100k+; never deep-copied on reads)."""
        return {
            "id": self.id,
            "tier": self.tier.value,
            "blocks": list(self.blocks),
            "created_at_s": self.created_at_s,
            "ttl_s": self.ttl_s,
            "source": self.source,
            "block_size": self.block_size,
            "model": self.model,
            "expires_at_s": self.expires_at_s,
            "block_hashes": [f"{b & ((1 << 64) - 1):016x}" for b in self.blocks],
            "num_tokens": len(self.token_ids) if self.token_ids is not None else None,
        }

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def to_record(self) -> dict[str, Any]:
        d = asdict(self)
        d["tier"] = self.tier.value
        return d

    @staticmethod
    def from_record(d: dict[str, Any]) -> Pin:
        """A stored record -> Pin; ValueError/TypeError/KeyError when a field is missing or mistyped."""
        if not isinstance(d, dict):
            raise TypeError(f"pin record is {type(d).__name__}, not an object")
        d = dict(d)
        d["tier"] = Tier(d["tier"])
        p = Pin(**d)
        if not isinstance(p.id, str) or not p.id:
            raise ValueError("pin id missing")
        if not isinstance(p.blocks, list) or not p.blocks or not all(type(b) is int for b in p.blocks):
            raise ValueError("pin blocks must be a non-empty list of integers")
        if not isinstance(p.created_at_s, int | float):
            raise TypeError("created_at_s must be a number")
        if p.token_ids is not None and not all(type(t) is int for t in p.token_ids):
            raise ValueError("token_ids must be integers")
        return p


class PinSet:
    """Thread-safe set of pins; ``block_map`` gives the planner block -> tier (fastest pin wins)."""

    def __init__(self) -> None:
        self._pins: dict[str, Pin] = {}
        self._lock = threading.Lock()

    def add(self, p: Pin) -> None:
        with self._lock:
            self._pins[p.id] = p

    def remove(self, pin_id: str) -> Pin | None:
        with self._lock:
            return self._pins.pop(pin_id, None)

    def get(self, pin_id: str) -> Pin | None:
        return self._pins.get(pin_id)

    def all(self) -> list[Pin]:
        with self._lock:
            return sorted(self._pins.values(), key=lambda p: p.created_at_s)

    def expire(self, now_s: float) -> list[Pin]:
        with self._lock:
            gone = [p for p in self._pins.values() if p.expired(now_s)]
            for p in gone:
                del self._pins[p.id]
        return gone

    def block_map(self, now_s: float) -> dict[int, Tier]:
        out: dict[int, Tier] = {}
        for p in self.all():
            if p.expired(now_s):
                continue
            for b in p.blocks:
                cur = out.get(b)
                if cur is None or TIER_ORDER.index(p.tier) < TIER_ORDER.index(cur):
                    out[b] = p.tier
        return out

    def tokens(self, now_s: float) -> dict[int, tuple[Pin, int]]:
        """block -> (pin, index in its chain) for pins whose tokens are known."""
        out: dict[int, tuple[Pin, int]] = {}
        for p in self.all():
            if p.expired(now_s) or p.token_ids is None:
                continue
            for i, b in enumerate(p.blocks):
                out.setdefault(b, (p, i))
        return out

    def __len__(self) -> int:
        return len(self._pins)

    def total_tokens(self) -> int:
        """Token ids held by all pins (the cap ``max_pinned_tokens`` bounds this)."""
        with self._lock:
            return sum(p.num_tokens for p in self._pins.values())
