"""Scenario files: model geometry, the compute roofline that prices prefill and decode, the tier hardware
(the one tier model, :class:`~kvtier.policies.tiers.TierSpec`), the serving limits and the trace slice.

Costs (seconds), from the roofline of the accelerator the YAML names (sources cited in each file):

- prefill of the token at position ``p``: ``a + b * p`` with ``a = 2 * active_params / flops`` and
  ``b = 4 * layers * attn_dim / flops`` (QK^T and AV over the ``p`` earlier tokens), ``flops`` = peak x MFU;
- one engine step: ``max(compute, memory) + step_overhead_s``: compute = prefill chunk cost + decode tokens x
  ``a``; memory = (weight bytes + KV bytes of every running sequence's context) / (HBM bandwidth x MBU).

A machine whose costs were measured rather than derived (``cpu-tiny``) gives
``accelerator.prefill_s_per_token`` (``a``) and ``prefill_s_per_token_per_position`` (``b``) instead of
``peak_flops`` / ``mfu``. The optional
``layer`` mapping sets :class:`~kvtier.replay.sim.layer.LayerBehaviour` (the real layer's own details).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.policies.tiers import Tier, TierSpec, normalize_tier
from kvtier.replay.sim.layer import LayerBehaviour

GIB = 1 << 30


@dataclass(frozen=True)
class ComputeModel:
    """Per-token prefill cost ``a + b * position`` and the decode memory roofline, all in seconds."""

    name: str
    kv_bytes_per_token: int
    prefill_a_s: float  # seconds per prompt token at position 0
    prefill_b_s: float  # extra seconds per prompt token per earlier token (attention)
    weight_bytes: float  # bytes read per engine step (weights; per GPU for tensor parallelism, summed)
    mem_bytes_s: float  # effective HBM bandwidth (bytes/s) for decode
    step_overhead_s: float = 0.002

    def prefill_s(self, start: int, n: int) -> float:
        """Seconds to prefill ``n`` tokens at positions ``start .. start + n - 1``."""
        if n <= 0:
            return 0.0
        return self.prefill_a_s * n + self.prefill_b_s * (n * start + n * (n - 1) / 2)

    def mean_s_per_token(self, mean_position: float) -> float:
        """Average recompute cost per token around ``mean_position`` (the planner's linear price)."""
        return self.prefill_a_s + self.prefill_b_s * mean_position


@dataclass(frozen=True)
class Serving:
    concurrency: int = 16  # running sequences (vLLM max_num_seqs)
    token_budget: int = 8192  # tokens per engine step (chunked prefill: max_num_batched_tokens)
    time_scale: float = 1.0  # trace seconds per simulated second (>1 compresses arrivals)
    closed_loop: bool = False  # TTFT from when a slot frees (a client holding `concurrency` requests)


@dataclass(frozen=True)
class Scenario:
    name: str
    compute: ComputeModel
    block_tokens: int
    tiers: tuple[TierSpec, ...]  # fastest first; tiers[0] is HBM (the engine's prefix cache)
    serving: Serving = field(default_factory=Serving)
    max_requests: int | None = None
    min_input_tokens: int = 0  # keep only prompts at least this long (the seed's long prompts)
    disk_admission: str = "all"  # "all" (LMCache write-through) or "frequency2" (Dynamo KVBM's filter)
    tick_interval_s: float = 2.0  # the sidecar's tick, simulated seconds
    description: str = ""
    layer: LayerBehaviour = field(default_factory=LayerBehaviour)

    @property
    def block_bytes(self) -> int:
        return self.compute.kv_bytes_per_token * self.block_tokens

    def tier(self, t: Tier) -> TierSpec | None:
        return next((h for h in self.tiers if h.tier is t), None)

    def with_serving(self, **kw: Any) -> Scenario:
        return replace(self, serving=replace(self.serving, **kw))


def _num(d: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        raise ValueError(f"{where}: missing {key!r}")
    if isinstance(v, str):  # YAML 1.1 reads 989e12 (no dot) as a string
        try:
            v = float(v)
        except ValueError:
            raise ValueError(f"{where}: {key!r} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative number, got {v!r}")
    return float(v)


_KNOWN = {
    "top": {"name", "description", "model", "accelerator", "block_tokens", "tiers", "serving", "trace",
            "disk_admission", "tick_interval_s", "layer"},
    "model": {"name", "layers", "kv_heads", "head_dim", "kv_dtype_bytes", "active_params", "attn_dim",
              "weight_bytes"},
    "accelerator": {"name", "count", "peak_flops", "mfu", "hbm_bytes_s", "mbu", "step_overhead_s",
                    "prefill_s_per_token", "prefill_s_per_token_per_position"},
    "tier": {"name", "capacity_gib", "capacity_blocks", "read_gbps", "write_gbps", "latency_us"},
    "serving": {"concurrency", "token_budget", "time_scale", "closed_loop"},
    "trace": {"max_requests", "min_input_tokens"},
    "layer": {"touch_whole_prompt", "tail_first", "retain_l2_hits", "l1_watermark", "l1_eviction_ratio",
              "l1_eviction_interval_s", "l2_loads_stage_in_l1", "l1_hits_prefix_only"},
}  # fmt: skip


def _check_keys(d: Mapping[str, Any], kind: str, where: str) -> None:
    extra = set(d) - _KNOWN[kind]
    if extra:
        raise ValueError(f"{where}: unknown key(s) {sorted(extra)}; known: {sorted(_KNOWN[kind])}")


def parse_scenario(data: Mapping[str, Any], *, source: str = "<scenario>") -> Scenario:
    """Validate a scenario mapping (as loaded from YAML); typos are errors."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: top level must be a mapping")
    _check_keys(data, "top", source)
    m, acc = data.get("model"), data.get("accelerator")
    if not isinstance(m, Mapping) or not isinstance(acc, Mapping):
        raise ValueError(f"{source}: needs 'model' and 'accelerator' mappings")
    _check_keys(m, "model", f"{source}: model")
    _check_keys(acc, "accelerator", f"{source}: accelerator")
    w = f"{source}: model"
    layers = int(_num(m, "layers", w))
    kvb = int(layers * _num(m, "kv_heads", w) * _num(m, "head_dim", w) * 2 * _num(m, "kv_dtype_bytes", w, 2))
    count = _num(acc, "count", f"{source}: accelerator", 1)
    if "prefill_s_per_token" in acc:  # measured: no roofline needed
        flops = 1.0
    else:
        flops = _num(acc, "peak_flops", f"{source}: accelerator") * _num(acc, "mfu", f"{source}: accelerator")
        flops *= count
    mem = _num(acc, "hbm_bytes_s", f"{source}: accelerator") * _num(acc, "mbu", f"{source}: accelerator")
    mem *= count
    if flops <= 0 or mem <= 0 or kvb <= 0:
        raise ValueError(f"{source}: peak_flops x mfu, hbm_bytes_s x mbu and KV bytes per token must be > 0")
    wa = f"{source}: accelerator"
    measured = "prefill_s_per_token" in acc  # a measured per-token cost instead of the FLOPs roofline
    compute = ComputeModel(
        name=str(m.get("name", "model")),
        kv_bytes_per_token=kvb,
        prefill_a_s=_num(acc, "prefill_s_per_token", wa)
        if measured
        else 2 * _num(m, "active_params", w) / flops,
        prefill_b_s=_num(acc, "prefill_s_per_token_per_position", wa, 0)
        if measured
        else 4 * layers * _num(m, "attn_dim", w) / flops,
        weight_bytes=_num(m, "weight_bytes", w),
        mem_bytes_s=mem,
        step_overhead_s=_num(acc, "step_overhead_s", f"{source}: accelerator", 0.002),
    )
    bt = int(_num(data, "block_tokens", source, 512))
    if bt <= 0:
        raise ValueError(f"{source}: block_tokens must be > 0")
    bb = kvb * bt
    raw = data.get("tiers")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: 'tiers' must be a non-empty list")
    tiers: list[TierSpec] = []
    for i, t in enumerate(raw):
        wt = f"{source}: tiers[{i}]"
        if not isinstance(t, Mapping) or "name" not in t:
            raise ValueError(f"{wt}: must be a mapping with a 'name'")
        _check_keys(t, "tier", wt)
        tier = normalize_tier(str(t["name"]))
        if "capacity_blocks" in t:
            cap = int(_num(t, "capacity_blocks", wt))
        else:
            cap = int(_num(t, "capacity_gib", wt) * GIB // bb)
        hbm = i == 0
        tiers.append(
            TierSpec(
                tier,
                cap,
                load_bandwidth_bytes_s=_num(t, "read_gbps", wt, 1e6 if hbm else None) * 1e9,
                write_bandwidth_bytes_s=_num(t, "write_gbps", wt, 1e6 if hbm else None) * 1e9,
                latency_s=_num(t, "latency_us", wt, 0) * 1e-6,
            )
        )
    if tiers[0].tier is not Tier.GPU:
        raise ValueError(f"{source}: the first tier must be gpu (the engine's HBM prefix cache)")
    ranks = [h.tier.rank for h in tiers]
    if ranks != sorted(set(ranks)):
        raise ValueError(f"{source}: tiers must be distinct and fastest first")
    sv = data.get("serving") or {}
    _check_keys(sv, "serving", f"{source}: serving")
    serving = Serving(
        concurrency=int(_num(sv, "concurrency", f"{source}: serving", 16)),
        token_budget=int(_num(sv, "token_budget", f"{source}: serving", 8192)),
        time_scale=_num(sv, "time_scale", f"{source}: serving", 1.0),
        closed_loop=bool(sv.get("closed_loop", False)),
    )
    if serving.concurrency < 1 or serving.token_budget < 1 or serving.time_scale <= 0:
        raise ValueError(f"{source}: serving needs concurrency >= 1, token_budget >= 1, time_scale > 0")
    tr = data.get("trace") or {}
    _check_keys(tr, "trace", f"{source}: trace")
    adm = str(data.get("disk_admission", "all"))
    if adm not in ("all", "frequency2"):
        raise ValueError(f"{source}: disk_admission must be 'all' or 'frequency2', got {adm!r}")
    ly = data.get("layer") or {}
    if not isinstance(ly, Mapping):
        raise ValueError(f"{source}: 'layer' must be a mapping")
    _check_keys(ly, "layer", f"{source}: layer")
    wm = ly.get("l1_watermark")
    behaviour = LayerBehaviour(
        touch_whole_prompt=bool(ly.get("touch_whole_prompt", False)),
        tail_first=bool(ly.get("tail_first", False)),
        retain_l2_hits=bool(ly.get("retain_l2_hits", True)),
        l1_watermark=None if wm is None else _num(ly, "l1_watermark", f"{source}: layer"),
        l1_eviction_ratio=_num(ly, "l1_eviction_ratio", f"{source}: layer", 0.2),
        l1_eviction_interval_s=_num(ly, "l1_eviction_interval_s", f"{source}: layer", 1.0),
        l2_loads_stage_in_l1=bool(ly.get("l2_loads_stage_in_l1", False)),
        l1_hits_prefix_only=bool(ly.get("l1_hits_prefix_only", False)),
    )
    if behaviour.l1_watermark is not None and not 0 < behaviour.l1_watermark <= 1:
        raise ValueError(f"{source}: layer.l1_watermark must be in (0, 1]")
    if behaviour.l1_eviction_interval_s <= 0 or behaviour.l1_eviction_ratio > 1:
        raise ValueError(f"{source}: layer needs l1_eviction_interval_s > 0 and l1_eviction_ratio <= 1")
    return Scenario(
        name=str(data.get("name", Path(source).stem)),
        compute=compute,
        block_tokens=bt,
        tiers=tuple(tiers),
        serving=serving,
        max_requests=None if tr.get("max_requests") is None else int(_num(tr, "max_requests", source)),
        min_input_tokens=int(_num(tr, "min_input_tokens", source, 0)),
        disk_admission=adm,
        tick_interval_s=_num(data, "tick_interval_s", source, 2.0),
        description=str(data.get("description", "")),
        layer=behaviour,
    )


def bundled_scenario(name: str) -> Path:
    from importlib import resources

    return Path(str(resources.files("kvtier.replay.sim").joinpath(f"scenarios/{name}.yaml")))


def load_scenario(spec: str) -> Scenario:
    """A scenario YAML path or the name of a bundled one (``demo-8b``, ``seed-480b``)."""
    import yaml

    p = Path(spec)
    if not p.exists():
        p = bundled_scenario(spec)
    if not p.exists():
        from importlib import resources

        root = resources.files("kvtier.replay.sim").joinpath("scenarios")
        names = sorted(x.name.removesuffix(".yaml") for x in root.iterdir() if x.name.endswith(".yaml"))
        raise FileNotFoundError(
            f"scenario {spec!r} not found (neither a file nor a bundled scenario name; bundled: "
            f"{', '.join(names)})"
        )
    return parse_scenario(yaml.safe_load(p.read_text()), source=str(p))
