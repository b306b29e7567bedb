"""Tier emulation: exclusive demotion/promotion, KV geometry, cost model, config validation."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from kvtier.policies.base import Request
from kvtier.replay.runner import Workload, load_workload, run_one
from kvtier.replay.tiers import TierStack, bundled_config, load_tier_config, parse_tier_config

MODEL = {
    "name": "m",
    "layers": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "dtype_bytes": 2,
    "prefill_tokens_per_s": 10000,
}


def cfg(*tiers: dict, prefetch: bool = False) -> dict:
    return {"model": MODEL, "tiers": list(tiers), "prefetch": prefetch}


GPU = {"name": "gpu", "capacity_blocks": 2}
CPU = {
    "name": "cpu",
    "capacity_blocks": 2,
    "read_gbps": 64 * 2**20 / 1e9 * 1000,
    "write_gbps": 10,
    "latency_us": 500,
}


@functools.cache
def conversation() -> Workload:
    return load_workload("bundled")


@pytest.mark.parametrize(
    ("name", "kv_per_token"),
    [("llama3-8b", 131072), ("llama3-70b", 327680), ("qwen2.5-7b", 57344), ("mistral-7b", 131072)],
)
def test_bundled_configs(name: str, kv_per_token: int) -> None:
    c = load_tier_config(bundled_config(name))
    assert c.model.kv_bytes_per_token == kv_per_token
    assert [t.tier.value for t in c.tiers] == ["gpu", "cpu", "disk", "remote"]
    assert c.block_bytes == kv_per_token * 512


def test_demote_promote_and_cost() -> None:
    c = parse_tier_config(cfg(GPU, CPU))
    st = TierStack.build(c, "lru", 100)
    r = lambda *ids: Request(0.0, 512 * len(ids), 1, np.asarray(ids))  # noqa: E731
    hit, tier, ttft = st.access(r(1, 2))
    assert hit.tolist() == [False, False] and ttft == pytest.approx(1024 / 10000 * 1e3)
    st.access(r(3, 4))  # 1, 2 demoted to cpu
    assert st.tier_policies[1].contains(1) and not st.top.contains(1)
    hit, tier, ttft = st.access(r(1, 5))  # 1 promoted from cpu; 5 computed
    assert tier.tolist() == [1, -1]
    assert not st.tier_policies[1].contains(1) and st.top.contains(1)  # exclusive
    # 1 block from cpu: 0.5 ms latency + 64 MiB at (64 MiB per ms) = 1.5 ms, plus 512 tokens of prefill
    assert ttft == pytest.approx(0.5 + 1.0 + 512 / 10000 * 1e3)
    s = st.ttft_summary()
    assert s["bytes_per_link"]["cpu->gpu"] == 64 * 2**20
    assert s["bytes_per_link"]["gpu->cpu"] == 4 * 64 * 2**20  # 1,2 then 3,4 demoted


def test_prefetch_overlaps_loads() -> None:
    c = parse_tier_config(cfg(GPU, CPU, prefetch=True))
    st = TierStack.build(c, "lru", 100)
    r = lambda *ids: Request(0.0, 512 * len(ids), 1, np.asarray(ids))  # noqa: E731
    st.access(r(1, 2))
    st.access(r(3, 4))
    _, _, ttft = st.access(r(1, 5))
    assert ttft == pytest.approx(max(1.5, 51.2))


def test_exclusive_lru_tiers_equal_one_big_lru() -> None:
    """trace_baselines.md §7: exclusive LRU(5 %) + LRU(40 %) equals a single LRU(45 %) exactly."""
    wl = conversation()
    c = parse_tier_config(
        cfg({"name": "gpu", "capacity": 0.05}, {**CPU, "capacity_blocks": None, "capacity": 0.4})
    )
    two = run_one(wl, "lru", None, tiers=c)
    one = run_one(wl, "lru", round(0.05 * wl.distinct_blocks) + round(0.4 * wl.distinct_blocks))
    assert two.block_hits == one.block_hits and two.prefix_hit_tokens == one.prefix_hit_tokens
    assert two.tiers is not None
    assert two.tiers[0]["hit_blocks"] + two.tiers[1]["hit_blocks"] == two.block_hits
    assert abs(100 * two.tiers[1]["hit_blocks"] / two.block_accesses - 16.62) < 0.1  # §7 tier-2 block hit


@pytest.mark.parametrize(
    ("bad", "msg"),
    [
        ({"tiers": [GPU]}, "missing 'model'"),
        (cfg(), "non-empty list"),
        (cfg(GPU, {"name": "cpu", "read_gbps": 1, "write_gbps": 1}), "capacity"),
        (cfg(GPU, {**CPU, "read_gbps": -1}), "non-negative"),
        ({"model": {**MODEL, "layers": "x"}, "tiers": [GPU]}, "layers"),
    ],
)
def test_config_errors(bad: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_tier_config(bad)


def test_yaml_and_json_files(tmp_path: Path) -> None:
    import json

    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg(GPU, CPU)))
    assert load_tier_config(p).tiers[1].tier.value == "cpu"
