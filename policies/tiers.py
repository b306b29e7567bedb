"""kvtier's own tier names and how every engine / cache layer spells them."""

from __future__ import annotations

from enum import StrEnum


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
