"""Scenario files: the bundled ones load with the documented geometry; typos and bad values are errors."""

from __future__ import annotations

import pytest

from kvtier.policies.tiers import Tier
from kvtier.replay.sim.layer import LayerBehaviour
from kvtier.replay.sim.scenario import load_scenario, parse_scenario


def test_bundled_scenarios() -> None:
    d = load_scenario("demo-8b")
    assert d.compute.kv_bytes_per_token == 131072 and d.block_bytes == 64 << 20
    assert [h.tier for h in d.tiers] == [Tier.GPU, Tier.CPU, Tier.DISK]
    assert 1 / d.compute.prefill_a_s == pytest.approx(989e12 * 0.5 / (2 * 8.03e9))
    s = load_scenario("seed-480b")
    assert s.compute.kv_bytes_per_token == 62 * 8 * 128 * 2 * 2
    assert [h.tier for h in s.tiers] == [Tier.GPU, Tier.CPU, Tier.REMOTE]
    assert s.serving.closed_loop and s.min_input_tokens == 16384
    assert s.tier(Tier.REMOTE) is not None and s.tier(Tier.REMOTE).load_bandwidth_bytes_s == 11e9  # type: ignore[union-attr]


def _doc(**over: object) -> dict[str, object]:
    d: dict[str, object] = {
        "model": {"layers": 2, "kv_heads": 1, "head_dim": 4, "active_params": 1e6, "attn_dim": 8,
                  "weight_bytes": 1e6},
        "accelerator": {"peak_flops": 1e12, "mfu": 0.5, "hbm_bytes_s": 1e11, "mbu": 0.5},
        "tiers": [{"name": "gpu", "capacity_blocks": 4}, {"name": "cpu", "capacity_blocks": 8, "read_gbps": 1,
                  "write_gbps": 1}],
    }  # fmt: skip
    d.update(over)
    return d


def test_typos_and_bad_values_are_errors() -> None:
    assert parse_scenario(_doc()).tiers[1].capacity_blocks == 8
    with pytest.raises(ValueError, match="unknown key"):
        parse_scenario(_doc(servng={}))
    with pytest.raises(ValueError, match="unknown key"):
        parse_scenario(_doc(serving={"concurency": 8}))
    with pytest.raises(ValueError, match="first tier must be gpu"):
        parse_scenario(_doc(tiers=[{"name": "cpu", "capacity_blocks": 1, "read_gbps": 1, "write_gbps": 1}]))
    with pytest.raises(ValueError, match="fastest first"):
        low = {"capacity_blocks": 1, "read_gbps": 1, "write_gbps": 1}
        parse_scenario(_doc(tiers=[{"name": "gpu", "capacity_blocks": 1}, {"name": "disk", **low},
                                   {"name": "cpu", **low}]))  # fmt: skip
    with pytest.raises(ValueError, match="disk_admission"):
        parse_scenario(_doc(disk_admission="sometimes"))
    with pytest.raises(ValueError, match="must be a number"):
        parse_scenario(_doc(accelerator={"peak_flops": "fast", "mfu": 0.5, "hbm_bytes_s": 1, "mbu": 1}))


def test_one_tier_model_feeds_replay_and_the_planner() -> None:
    from kvtier.controller.policy_doc import PolicyDoc
    from kvtier.replay.runner import resolve_tiers

    tc = resolve_tiers("llama3-8b")
    hw = tc.tiers
    assert [h.tier for h in hw] == [Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE]
    assert hw[1].capacity_blocks == 512 * 2**30 // tc.block_bytes and hw[2].load_bandwidth_bytes_s == 12e9
    assert hw[2].write_bytes_s == 8e9 and hw[2].load_s(12e9) == pytest.approx(1.0 + 100e-6)
    # the policy document carries the planner's fields of the same object (hardware-only ones stay out)
    doc = PolicyDoc(tiers=[hw[2]])
    (spec,) = doc.planner_config().tiers
    assert spec.capacity_blocks == hw[2].capacity_blocks and spec.load_bandwidth_bytes_s == 12e9
    assert set(doc.model_dump(mode="json")["tiers"][0]) == {
        "tier",
        "capacity_blocks",
        "high_watermark",
        "low_watermark",
        "load_bandwidth_bytes_s",
    }


def test_cpu_tiny_measured_costs_and_the_layers_own_details() -> None:
    c = load_scenario("cpu-tiny")
    assert c.compute.kv_bytes_per_token == 1024 and c.block_bytes == 64 << 10  # LMCache's 64 KiB chunk
    assert [h.capacity_blocks for h in c.tiers[:2]] == [47, 458]
    assert c.compute.prefill_a_s == 0.0 and c.compute.step_overhead_s > 0  # measured, not a roofline
    assert c.layer.touch_whole_prompt and c.layer.tail_first and not c.layer.retain_l2_hits
    assert c.layer.l1_watermark == 0.8
    assert load_scenario("demo-8b").layer == LayerBehaviour()  # the other scenarios keep the original model
    with pytest.raises(ValueError, match="unknown key"):
        parse_scenario(_doc(layer={"watermark": 0.8}))
    with pytest.raises(ValueError, match="l1_watermark"):
        parse_scenario(_doc(layer={"l1_watermark": 1.5}))
    measured = parse_scenario(_doc(accelerator={"prefill_s_per_token": 1e-4, "hbm_bytes_s": 1e10, "mbu": 1}))
    assert measured.compute.prefill_a_s == 1e-4 and measured.compute.prefill_b_s == 0.0
