"""Multi-tier emulation: HBM -> DRAM -> local NVMe -> remote NVMe-oF, exclusive tiers.

Tier 0 runs the chosen policy; each lower tier is a policy of its own (same class by default) holding the
blocks the tier above evicted (demotion). A request's blocks missing from tier 0 are looked up in the
lower tiers, fastest first; a hit there is promoted to tier 0 (removed below: tiers stay exclusive). A
block evicted from the last tier is gone. Cost model per request:

    TTFT = prefill of the tokens after the reusable prefix / prefill_tokens_per_s
         + for each lower tier k used by the prefix: latency_k + bytes_k / read_bandwidth_k

With ``prefetch: true`` lower-tier loads overlap prefill (layer-wise pipelining): TTFT = max of the two.
Bytes moved are counted per link (``cpu->gpu`` on promotion, ``gpu->cpu`` on demotion, ...); each tier
reports the share of the trace's span its write (demotions) and read (promotions) bandwidth is busy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.policies.base import HitMask, Policy, Request
from kvtier.policies.registry import get_policy
from kvtier.policies.tiers import HBM_BYTES_S, TierSpec, normalize_tier

GIB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """KV geometry and prefill speed of a model."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float  # bytes per element (2 = bf16/fp16, 1 = fp8)
    prefill_tokens_per_s: float  # prompt tokens/s of one serving instance

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: layers x kv_heads x head_dim x 2 x dtype_bytes."""
        return int(self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes)


@dataclass(frozen=True)
class StackConfig:
    """A replayed tier stack: the model's KV geometry, its tiers fastest first (the one tier model,
    :class:`~kvtier.policies.tiers.TierSpec`), the block size and whether loads overlap prefill.

    ``capacity_fractions[i]``, when not None, sizes tier ``i`` as that fraction of the trace's distinct
    blocks (known only when the trace is; it then overrides ``tiers[i].capacity_blocks``).
    """

    model: ModelSpec
    tiers: tuple[TierSpec, ...]
    block_tokens: int = 512
    prefetch: bool = False
    capacity_fractions: tuple[float | None, ...] = ()
    top_sized: bool = True  # False: tier 0 gave no capacity (``--capacity`` / ``--capacity-blocks`` must)

    @property
    def block_bytes(self) -> int:
        return self.model.kv_bytes_per_token * self.block_tokens

    def capacities(self, distinct_blocks: int) -> list[int]:
        """Blocks per tier for a trace of ``distinct_blocks`` distinct blocks."""
        fr = self.capacity_fractions or (None,) * len(self.tiers)
        return [
            t.capacity_blocks if f is None else int(round(f * distinct_blocks))
            for t, f in zip(self.tiers, fr, strict=True)
        ]


def _num(d: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        raise ValueError(f"{where}: missing {key!r}")
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative number, got {v!r}")
    return float(v)


def parse_tier(t: Mapping[str, Any], i: int, block_bytes: int, where: str) -> tuple[TierSpec, float | None]:
    """One YAML tier (``name``, ``read_gbps``/``write_gbps`` in GB/s, ``latency_us``, capacity as
    ``capacity_blocks`` > ``capacity`` (fraction of the trace's distinct blocks) > ``capacity_gib``,
    ``policy``) as the one tier model plus its capacity fraction (None when sized in blocks or GiB).
    Tier 0 (HBM) may omit its bandwidths (no link) and its capacity (``--capacity`` sizes it)."""
    if not isinstance(t, Mapping) or "name" not in t:
        raise ValueError(f"{where}: must be a mapping with a 'name'")
    try:
        tier = normalize_tier(str(t["name"]))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    cb, cf, cg = t.get("capacity_blocks"), t.get("capacity"), t.get("capacity_gib")
    if cb is None and cf is None and cg is None and i > 0:
        raise ValueError(f"{where}: give capacity_blocks, capacity (fraction) or capacity_gib")
    read = _num(t, "read_gbps", where, 0 if i == 0 else None)
    write = _num(t, "write_gbps", where, 0 if i == 0 else None)
    latency_us = _num(t, "latency_us", where, 0)
    fraction = None
    if cb is not None:
        blocks = int(_num(t, "capacity_blocks", where))
    elif cf is not None:
        fraction, blocks = _num(t, "capacity", where), 0
    elif cg is not None:
        blocks = int(_num(t, "capacity_gib", where) * GIB // block_bytes)
    else:
        blocks = 0  # tier 0 sized by --capacity / --capacity-blocks
    if i > 0 and (read <= 0 or write <= 0):
        raise ValueError(f"{where}: read_gbps and write_gbps must be > 0")
    spec = TierSpec(
        tier,
        blocks,
        load_bandwidth_bytes_s=read * 1e9 if read > 0 else HBM_BYTES_S,
        write_bandwidth_bytes_s=write * 1e9 if write > 0 else HBM_BYTES_S,
        latency_s=latency_us * 1e-6,
        policy=None if t.get("policy") is None else str(t["policy"]),
    )
    return spec, fraction


def parse_tier_config(data: Mapping[str, Any], *, source: str = "<config>") -> StackConfig:
    """Validate a tier config mapping (as loaded from YAML/JSON)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: top level must be a mapping")
    m = data.get("model")
    if not isinstance(m, Mapping):
        raise ValueError(f"{source}: missing 'model' mapping")
    w = f"{source}: model"
    model = ModelSpec(
        name=str(m.get("name", "model")),
        layers=int(_num(m, "layers", w)),
        kv_heads=int(_num(m, "kv_heads", w)),
        head_dim=int(_num(m, "head_dim", w)),
        dtype_bytes=_num(m, "dtype_bytes", w, 2),
        prefill_tokens_per_s=_num(m, "prefill_tokens_per_s", w),
    )
    if model.prefill_tokens_per_s <= 0 or model.kv_bytes_per_token <= 0:
        raise ValueError(f"{w}: prefill_tokens_per_s and KV bytes per token must be > 0")
    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ValueError(f"{source}: 'tiers' must be a non-empty list")
    bt = int(data.get("block_tokens", 512))
    if bt <= 0:
        raise ValueError(f"{source}: block_tokens must be > 0")
    parsed = [
        parse_tier(t, i, model.kv_bytes_per_token * bt, f"{source}: tiers[{i}]")
        for i, t in enumerate(raw_tiers)
    ]
    return StackConfig(
        model=model,
        tiers=tuple(p[0] for p in parsed),
        block_tokens=bt,
        prefetch=bool(data.get("prefetch", False)),
        capacity_fractions=tuple(p[1] for p in parsed),
        top_sized=any(k in raw_tiers[0] for k in ("capacity_blocks", "capacity", "capacity_gib")),
    )


def load_tier_config(path: str | Path) -> StackConfig:
    """Read a tier config from YAML (``.yaml``/``.yml``) or JSON."""
    p = Path(path)
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        import json

        data = json.loads(text)
    return parse_tier_config(data, source=str(p))


def bundled_config_names() -> list[str]:
    """Names of the configs shipped in ``kvtier/replay/configs`` (``llama3-8b``, ...), sorted."""
    from importlib import resources

    root = resources.files("kvtier.replay").joinpath("configs")
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def bundled_config(name: str) -> Path:
    """Path of a config shipped in ``kvtier/replay/configs`` (e.g. ``llama3-8b``)."""
    from importlib import resources

    return Path(str(resources.files("kvtier.replay").joinpath(f"configs/{name}.yaml")))


def _supports_remove(p: Policy) -> bool:
    return type(p).remove is not Policy.remove


@dataclass
class _TierState:
    spec: TierSpec
    policy: Policy
    evictions: int = 0


class TierStack:
    """Exclusive tier hierarchy driven request by request (see module doc)."""

    def __init__(self, config: StackConfig, top: Policy, capacities: list[int], *, seed: int = 0) -> None:
        if len(capacities) != len(config.tiers):
            raise ValueError("one capacity per tier")
        self.config = config
        self.block_bytes = config.block_bytes
        self.tier_names = [t.tier.value for t in config.tiers]
        states = [_TierState(config.tiers[0], top)]
        for spec, cap in zip(config.tiers[1:], capacities[1:], strict=True):
            pname = spec.policy or (top.name if _supports_remove(top) and not top.offline else "lru")
            pol = get_policy(pname, cap, seed)
            if not _supports_remove(pol):
                raise ValueError(f"tier {spec.tier}: policy {pname} cannot be a lower tier (no remove())")
            states.append(_TierState(spec, pol))
        self._t = states
        k = len(states)
        self._up = np.zeros(k, dtype=np.int64)  # blocks promoted from tier k to tier 0
        self._down = np.zeros(k, dtype=np.int64)  # blocks demoted from tier k-1 into tier k
        self._hits = np.zeros(k, dtype=np.int64)
        self._pref_blocks = np.zeros(k, dtype=np.int64)
        self._pref_tokens = np.zeros(k, dtype=np.int64)
        self._load_ms = np.zeros(k, dtype=np.float64)
        self._where: dict[int, int] = {}  # block -> index of the lower tier holding it
        self._first_ms: float | None = None
        self._last_ms = 0.0
        self.dropped = 0
        self._ttft: list[float] = []
        self._ttft_nocache: list[float] = []

    @classmethod
    def build(
        cls,
        config: StackConfig,
        top_policy: str,
        distinct_blocks: int,
        *,
        top_capacity_blocks: int | None = None,
        seed: int = 0,
    ) -> TierStack:
        caps = config.capacities(distinct_blocks)
        if top_capacity_blocks is not None:
            caps[0] = top_capacity_blocks
        elif not config.top_sized:
            raise ValueError(
                f"tier {config.tiers[0].tier}: give capacity_blocks, capacity (fraction) or capacity_gib"
            )
        return cls(config, get_policy(top_policy, caps[0], seed), caps, seed=seed)

    @property
    def top(self) -> Policy:
        return self._t[0].policy

    @property
    def tier_policies(self) -> tuple[Policy, ...]:
        """Each tier's placement policy, fastest first (as :attr:`tier_names`; the first is :attr:`top`)."""
        return tuple(s.policy for s in self._t)

    @property
    def links(self) -> dict[str, int]:
        """Bytes moved per link: promotions ``tier->top`` and demotions ``upper->lower``."""
        st, bb = self._t, self.block_bytes
        out: dict[str, int] = {}
        for k in range(1, len(st)):
            if self._up[k]:
                out[f"{st[k].spec.tier}->{st[0].spec.tier}"] = int(self._up[k]) * bb
            if self._down[k]:
                out[f"{st[k - 1].spec.tier}->{st[k].spec.tier}"] = int(self._down[k]) * bb
        return out

    def access(self, req: Request) -> tuple[HitMask, npt.NDArray[np.int8], float]:
        """Serve ``req``: returns (hit anywhere per block, tier index per block or -1, TTFT ms)."""
        st = self._t
        n = len(req.hash_ids)
        top = st[0].policy
        hit0 = top.access(req)
        tier_of = np.full(n, -1, dtype=np.int8)
        tier_of[hit0] = 0
        ev = top.drain_evicted()
        nt = len(st)
        if nt > 1:
            up = self._up
            where = self._where
            missed = np.flatnonzero(~hit0)
            if missed.size:
                ids = req.hash_ids[missed].tolist()
                lower = [s.policy for s in st]
                ev_set = set(ev)
                top_has = top.contains
                found_i: list[int] = []
                found_k: list[int] = []
                for i, b in zip(missed.tolist(), ids, strict=True):
                    if b in ev_set and top_has(b):
                        # evicted by this very request before its turn came, then re-admitted: block by
                        # block it would have been demoted to tier 1 and promoted straight back
                        ev_set.discard(b)
                        found_i.append(i)
                        found_k.append(1)
                        continue
                    k = where.get(b)
                    if k is None:
                        continue
                    pk = lower[k]
                    if not pk.contains(b):  # the lower policy declined it
                        del where[b]
                        continue
                    found_i.append(i)
                    found_k.append(k)
                    if top_has(b):  # promoted (exclusive); else read through
                        pk.remove(b)
                        del where[b]
                if found_i:
                    tier_of[found_i] = found_k
                    up += np.bincount(found_k, minlength=nt)
                if len(ev_set) != len(ev):
                    ev = [b for b in ev if b in ev_set]
            # demotion cascade
            for k in range(1, nt):
                st[k - 1].evictions += len(ev)
                if not ev:
                    break
                self._down[k] += len(ev)
                for b in ev:
                    where[b] = k
                dem = Request(req.timestamp_ms, 0, 0, np.asarray(ev, dtype=np.int64), req.block_tokens)
                st[k].policy.access(dem)
                ev = st[k].policy.drain_evicted()
            else:
                st[-1].evictions += len(ev)
                self.dropped += len(ev)
                for b in ev:
                    where.pop(b, None)
        else:
            st[0].evictions += len(ev)
            self.dropped += len(ev)
        hit = tier_of >= 0
        counts = np.bincount(tier_of[hit], minlength=nt)
        self._hits += counts
        # cost model over the reusable prefix (leading run of hits)
        lead = n if counts.sum() == n else int(np.argmin(hit))
        bt = req.block_tokens
        pref = np.bincount(tier_of[:lead], minlength=nt) if lead else np.zeros(nt, dtype=np.int64)
        self._pref_blocks += pref
        tok = pref * bt
        if lead == n and n:  # the last block holds the remainder of input_length
            tok[tier_of[n - 1]] += req.input_length - n * bt
            pref_tok = req.input_length
        else:
            pref_tok = min(lead * bt, req.input_length)
        self._pref_tokens += tok
        tps = self.config.model.prefill_tokens_per_s
        compute_ms = (req.input_length - pref_tok) / tps * 1e3
        load_ms = 0.0
        if lead and pref[1:].any():
            bb = self.block_bytes
            for k in np.flatnonzero(pref[1:]).tolist():
                spec = st[k + 1].spec
                t_ms = spec.latency_s * 1e3 + int(pref[k + 1]) * bb / spec.load_bandwidth_bytes_s * 1e3
                self._load_ms[k + 1] += t_ms
                load_ms += t_ms
        ttft = max(compute_ms, load_ms) if self.config.prefetch else compute_ms + load_ms
        self._ttft.append(ttft)
        if self._first_ms is None:
            self._first_ms = req.timestamp_ms
        self._last_ms = req.timestamp_ms
        self._ttft_nocache.append(req.input_length / tps * 1e3)
        return hit, tier_of, ttft

    def summary(self) -> list[dict[str, Any]]:
        """Per-tier figures (blocks, tokens, bytes)."""
        out = []
        bb = self.block_bytes
        for k, s in enumerate(self._t):
            # blocks written into this tier by other tiers (tier 0: promotions; fresh prefill not counted)
            written = int(self._up[1:].sum()) if k == 0 else int(self._down[k])
            out.append(
                {
                    "tier": s.spec.tier.value,
                    "policy": s.policy.name,
                    "capacity_blocks": s.policy.capacity_blocks,
                    "capacity_bytes": s.policy.capacity_blocks * bb,
                    "resident_blocks": len(s.policy),
                    "hit_blocks": int(self._hits[k]),
                    "prefix_hit_blocks": int(self._pref_blocks[k]),
                    "prefix_hit_tokens": int(self._pref_tokens[k]),
                    "bytes_written": written * bb,
                    "bytes_read_to_top": int(self._up[k]) * bb if k else 0,
                    "evictions": s.evictions,
                    "load_time_ms": round(float(self._load_ms[k]), 3),
                    # share of the trace's span this tier's link spends writing demotions / reading
                    # promotions at its configured bandwidth (> 1: the tier cannot keep up)
                    "write_utilization": self._util(written * bb, s.spec.write_bytes_s),
                    "read_utilization": self._util(
                        int(self._up[k]) * bb if k else 0, s.spec.load_bandwidth_bytes_s
                    ),
                }
            )
        return out

    def _util(self, nbytes: int, bytes_s: float) -> float | None:
        """Share of the trace's span a link of ``bytes_s`` (bytes/s) is busy moving ``nbytes``; None for
        tier 0's missing link (:data:`~kvtier.policies.tiers.HBM_BYTES_S`) or an empty span."""
        span_s = (self._last_ms - (self._first_ms or 0.0)) / 1e3
        if bytes_s >= HBM_BYTES_S or span_s <= 0:
            return None
        return round(nbytes / bytes_s / span_s, 6)

    def ttft_summary(self) -> dict[str, Any]:
        """TTFT estimate statistics (ms) and bytes moved per link."""
        a = np.asarray(self._ttft) if self._ttft else np.zeros(1)
        b = np.asarray(self._ttft_nocache) if self._ttft_nocache else np.zeros(1)
        return {
            "model": self.config.model.name,
            "kv_bytes_per_token": self.config.model.kv_bytes_per_token,
            "block_bytes": self.block_bytes,
            "prefetch": self.config.prefetch,
            "mean_ms": float(a.mean()),
            "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)),
            "no_cache_mean_ms": float(b.mean()),
            "speedup_vs_no_cache": float(b.mean() / a.mean()) if a.mean() > 0 else None,
            "bytes_per_link": dict(sorted(self.links.items())),
            "blocks_dropped": self.dropped,
        }
