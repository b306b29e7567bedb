"""Calibration of the simulator against the real stack (issue 15): vLLM CPU + LMCache MP, the layer's
default policy, no sidecar, a fresh stack; the simulator's ``default`` arm with ``scenarios/cpu-tiny.yaml``
and the costs the probe measured in the same session (``bench.calibrate_sim``, which the full-size run
``python -m bench.calibrate_sim`` uses too). Costly (a stack, ~270 requests): slow + vllm + lmcache.

Asserted at the issue's 10 %: hit tokens of vLLM's prefix cache, LMCache L1 lookups, and recomputed tokens
(exact or within 1 % on a loaded and on a quiet machine). Not met, so only bounded within a factor of 2 (a
unit or model error such as the earlier 7x, not the gap): LMCache L2 lookups and the tokens vLLM loaded from
LMCache. They match exactly under a CI run's load but are predicted 1.31-1.44x the measured on a quiet
machine, where requests arrive faster relative to LMCache's 1 s watermark-eviction loop and the real count
itself varies run to run (2,624 / 2,880) -- the simulator's eviction timing is the open part of issue 15
(docs/perf/calibration.md). TTFT p50 is printed and bounded within a factor of 3: 1.06 of the measured when
quiet, 0.54-1.43 at load 7-13."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.calibrate_sim import run

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.lmcache]

HIT_ROWS = ("GPU prefix cache (vLLM)", "LMCache L1 (lookup hits)", "recomputed")  # within 10 %
L2_ROWS = ("LMCache L2 (lookup hits)", "loaded from LMCache (vLLM external)")  # within 2x (not calibrated)


def test_predicted_hit_tokens_per_tier_and_ttft_match_the_real_stack(tmp_path: Path) -> None:
    out = run(180, probe_reps=3, root=tmp_path)  # from ~150 requests on, chunks come back from L2
    rows = {r["figure"]: r for r in out["comparison"]}
    assert out["measured"]["prompt_tokens"] == out["prompt_tokens"]  # every request reached the engine
    assert out["measured"]["l2_hit_tokens"] > 0 and out["measured"]["gpu_hit_tokens"] > 0  # tiers exercised
    for name in HIT_ROWS:
        r = rows[name]
        assert abs(r["predicted"] - r["measured"]) <= 0.10 * max(r["measured"], 1.0), r
    for name in L2_ROWS:
        r = rows[name]
        print(f"{name}: predicted {r['predicted']:.0f}, measured {r['measured']:.0f}, ratio {r['ratio']:.3f}")
        assert 0.5 * r["measured"] <= r["predicted"] <= 2.0 * r["measured"], r
    ttft = rows["TTFT p50 (s)"]
    print(
        f"TTFT p50 predicted {ttft['predicted']:.3f} s, measured {ttft['measured']:.3f} s, "
        f"ratio {ttft['ratio']:.3f}, load average {out['loadavg']['after_workload'][0]:.1f}"
    )
    assert 1 / 3 <= ttft["ratio"] <= 3.0, (ttft, out["probe_fit"], out["loadavg"])
