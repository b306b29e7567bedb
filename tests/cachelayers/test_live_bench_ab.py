"""Live A/B on the real stack (vLLM CPU + LMCache MP, fresh per arm): the self-guard.

Runs :func:`bench.live_ab.run_ab` (the same harness as ``python -m bench.live_ab``): a fresh LMCache MP
server (L1 0.028 GB, fs L2) and vLLM CPU with LMCacheMPConnector per run; the active arm runs ``kvtier serve
--mode active --actuator lmcache-l1``. Costly (a stack per arm, a few hundred requests): slow + vllm +
lmcache. Whether active mode beats the baseline is a measurement, not a unit property: ``python -m
bench.live_ab`` (interleaved repetitions, bootstrap CIs) answers it; one 500-request run was within noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.live_ab import run_ab

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.lmcache]


def test_guard_trips_on_a_workload_built_to_make_admission_lose(tmp_path: Path) -> None:
    """Every prompt comes back exactly once, eight prompts later: dropping first-sight chunks loses every
    L1 hit the layer's LRU would have had, so the guard must put the sidecar back in shadow.

    The arm is a variant (``active/fast-guard``) whose flags only it gets: two measured calibration periods
    within the run need the short guard period of its config (at the default 10 s they would not fit)."""
    cfg = tmp_path / "kvtier.yaml"  # short guard periods: calibrate on the layer's default within seconds
    cfg.write_text("actuator_options:\n  lmcache-l1:\n    measure_every_s: 2.0\n")
    out = run_ab("once-again", 240, arms=("active/fast-guard",), root=tmp_path,
                 arm_args={"active/fast-guard": ["--config", str(cfg)]})  # fmt: skip
    assert list(out["arms"]) == ["active/fast-guard"]
    act = out["arms"]["active/fast-guard"]
    assert act["failed"] == 0
    assert act["guard"].get("kvtier_guard_trips_total", 0) >= 1, act["guard"]
    calibrated = act["guard"].get("kvtier_guard_measured_periods_total{verdict=calibrated}", 0)
    assert calibrated >= 2, act["guard"]  # measured on LMCache's counter
