"""kvtier's own tier names and how every engine / cache layer spells them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Tier(StrEnum):
    """Storage tiers, fastest first. Values are the lowercase names used in the API and metrics."""

    GPU = "gpu"  # accelerator HBM (vLLM's GPU block pool)
    CPU = "cpu"  # host DRAM (vLLM CPU offload, LMCache L1, SGLang host pool)
    DISK = "disk"  # local NVMe / filesystem (LMCache L2 fs, vLLM STORAGE)
    REMOTE = "remote"  # remote store / NVMe-oF (Mooncake, LMCache remote)

    @property
    def rank(self) -> int:
        """0 for the fastest tier."""
        return TIER_ORDER.index(self)


TIER_ORDER: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)

_ALIASES: dict[str, Tier] = {
    # vLLM KV events `medium`
    "gpu": Tier.GPU,
    "cuda": Tier.GPU,
    "hbm": Tier.GPU,
    "device": Tier.GPU,
    "cpu": Tier.CPU,
    "dram": Tier.CPU,
    "storage": Tier.DISK,
    # SGLang HiCache
    "cpu_pinned": Tier.CPU,
    "host": Tier.CPU,
    "disk": Tier.DISK,
    "external": Tier.REMOTE,
    # LMCache (MP tiers, legacy backends)
    "l1": Tier.CPU,
    "l2": Tier.DISK,
    "localcpubackend": Tier.CPU,
    "localdiskbackend": Tier.DISK,
    "remotebackend": Tier.REMOTE,
    "gdsbackend": Tier.DISK,
    "nixlbackend": Tier.REMOTE,
    # Mooncake
    "memory": Tier.CPU,
    "ssd": Tier.DISK,
    "nvme": Tier.DISK,
    "local_nvme": Tier.DISK,
    "nof": Tier.REMOTE,
    "nvmeof": Tier.REMOTE,
    "remote": Tier.REMOTE,
}


def normalize_tier(name: str | None, default: Tier | None = None) -> Tier:
    """Map any engine / cache-layer spelling (any case) to a :class:`Tier`.

    Raises ``ValueError`` for an unknown name unless ``default`` is given.
    """
    if name is not None:
        key = str(name).strip().lower()
        tier = _ALIASES.get(key)
        if tier is not None:
            return tier
    if default is not None:
        return default
    raise ValueError(f"unknown tier/medium name {name!r}; known: {sorted(_ALIASES)}")


# Bounds and descriptions ride in each field's ``metadata`` (plain dicts, so this module stays pure): the
# policy document validates this dataclass directly with pydantic, which reads them as ``Field`` arguments.
HBM_BYTES_S = 1e15  # stands in for "no link" (tier 0 reads at HBM speed); also the document's upper bound


def _meta(description: str, **bounds: float) -> dict[str, Any]:
    return {"description": description, **bounds}


# fields the operator's policy document does not carry (hardware and replay-only); hidden there
NOT_IN_POLICY_DOC = ("write_bandwidth_bytes_s", "latency_s", "policy")


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: what it holds and how fast it moves blocks. The one tier model the planner, the policy
    document, the replay tier stack and the simulator share.

    ``capacity_blocks``: blocks of KV the tier holds (the planner may fill). ``high_watermark`` /
    ``low_watermark``: fractions of capacity where the planner starts / stops shedding.
    ``load_bandwidth_bytes_s``: bandwidth of a load from this tier into the engine (bytes/s; the
    simulator's read link, the planner's load price). ``write_bandwidth_bytes_s``: bandwidth of writes into
    the tier (bytes/s; None = the load bandwidth). ``latency_s``: per-transfer setup latency (s).
    ``policy``: the eviction policy a replayed tier stack runs in this tier (None = tier 0's if it can
    remove blocks, else lru). Tier 0 (HBM) has no link: :data:`HBM_BYTES_S` stands in.
    """

    tier: Tier = field(metadata=_meta("kvtier tier name: gpu, cpu, disk or remote"))
    capacity_blocks: int = field(metadata=_meta("blocks the planner may place in this tier", ge=0, le=10**10))
    high_watermark: float = field(
        default=0.95, metadata=_meta("fraction of capacity that triggers shedding", ge=0.0, le=1.0)
    )
    low_watermark: float = field(default=0.85, metadata=_meta("fraction shedding stops at", ge=0.0, le=1.0))
    load_bandwidth_bytes_s: float = field(
        default=1e10,
        metadata=_meta("measured load bandwidth into the engine, bytes/s", gt=0, le=HBM_BYTES_S),
    )
    write_bandwidth_bytes_s: float | None = field(default=None, metadata={"exclude": True})
    latency_s: float = field(default=0.0, metadata={"exclude": True})
    policy: str | None = field(default=None, metadata={"exclude": True})

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"tier {self.tier}: capacity_blocks must be >= 0, got {self.capacity_blocks}")
        if not (0.0 <= self.low_watermark <= 1.0 and 0.0 <= self.high_watermark <= 1.0):
            raise ValueError(f"tier {self.tier}: watermarks must be within [0, 1]")
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"tier {self.tier}: low_watermark ({self.low_watermark}) must be <= "
                f"high_watermark ({self.high_watermark})"
            )
        if not self.load_bandwidth_bytes_s > 0 or not self.write_bytes_s > 0 or self.latency_s < 0:
            raise ValueError(f"tier {self.tier}: bandwidths must be > 0 and latency_s >= 0")

    @property
    def write_bytes_s(self) -> float:
        """Bandwidth of writes into this tier, bytes/s (the load bandwidth unless set)."""
        w = self.write_bandwidth_bytes_s
        return self.load_bandwidth_bytes_s if w is None else w

    def load_s(self, nbytes: float) -> float:
        """Seconds to load ``nbytes`` from this tier on an idle link."""
        return self.latency_s + nbytes / self.load_bandwidth_bytes_s
