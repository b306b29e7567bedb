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


class TierHardware:
    """One tier's hardware, the single tier model the simulator runs and the planner's tiers derive from.

    ``capacity_blocks``: blocks of KV the tier holds. ``read_bytes_s``: bandwidth of the link that loads
    this tier's blocks towards the engine (bytes/s); ``write_bytes_s``: bandwidth of the link that writes
    into it; ``latency_s``: per-transfer setup latency (s). Tier 0 (HBM) has no link (read at HBM speed).
    Pure data, so every layer may import it (planner, policy document, replay, simulator).
    """

    __slots__ = ("tier", "capacity_blocks", "read_bytes_s", "write_bytes_s", "latency_s")

    def __init__(
        self,
        tier: Tier,
        capacity_blocks: int,
        read_bytes_s: float,
        write_bytes_s: float,
        latency_s: float = 0.0,
    ) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"{tier}: capacity_blocks must be >= 0, got {capacity_blocks}")
        if read_bytes_s <= 0 or write_bytes_s <= 0 or latency_s < 0:
            raise ValueError(f"{tier}: bandwidths must be > 0 and latency >= 0")
        self.tier = tier
        self.capacity_blocks = int(capacity_blocks)
        self.read_bytes_s = float(read_bytes_s)
        self.write_bytes_s = float(write_bytes_s)
        self.latency_s = float(latency_s)

    def load_s(self, nbytes: float) -> float:
        """Seconds to load ``nbytes`` from this tier on an idle link."""
        return self.latency_s + nbytes / self.read_bytes_s

    def __repr__(self) -> str:
        return (
            f"TierHardware({self.tier.value}, {self.capacity_blocks} blocks, "
            f"read {self.read_bytes_s:.3g} B/s, write {self.write_bytes_s:.3g} B/s, "
            f"{self.latency_s * 1e6:.0f} us)"
        )
