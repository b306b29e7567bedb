"""The simulator's LMCache model against the real stack (vLLM CPU + LMCache MP, one fresh stack, no sidecar).

Runs :func:`bench.calibrate_sim.measure` and :func:`~bench.calibrate_sim.run` -- the same code as ``python -m
bench.calibrate_sim`` -- on a 180-request slice of the bundled trace. Hit tokens per tier depend on when each
look-up and store meets LMCache's 1 s eviction loop; the timed replay takes those moments from LMCache's own
log (to the ms: on a loaded host a store ends up to ~1 s before the client sees the first token, and one L1
trim moved by 0.1 s moves a dozen chunks between L1 and L2), so they must agree within 10 % whatever the
load. TTFT p50 must agree within 25 % (issue 15) with the machine's costs measured in the same minutes:
the fixed and per-token prefill cost fitted on the even-numbered requests, the odd ones scored
(:func:`~bench.calibrate_sim.fit_run`); the 2 shared cores drift too much between the probe and the
workload for the probe's own rates (printed beside it) to hold that bound on every run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.calibrate_sim import measure, render, run
from bench.live_ab import MAX_PROMPT

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.lmcache]


def test_hit_tokens_per_tier_match_the_real_stack_within_ten_percent(tmp_path: Path) -> None:
    live = measure(180, root=tmp_path)  # 6 probe reps: one slow burst must not move the fit
    out = run(180, live=live)
    print(render(out))
    (tmp_path / "calibration.json").write_text(json.dumps(out, default=str))  # kept by pytest: post-mortem
    assert out["hit_timing"] == "LMCache's logged look-ups and stores and eviction-loop log"
    assert live["l1_loop_triggered_s"], "LMCache logged no eviction-loop run: L1 never filled"
    assert out["requests_placed_by_lmcache_log"] >= 0.9 * len(live["measured_sent_at_s"])
    rows = {r["figure"]: r for r in out["comparison"]}
    for figure in ("GPU prefix cache (vLLM)", "LMCache L1 (lookup hits)", "LMCache L2 (lookup hits)",
                   "loaded from LMCache (vLLM external)", "recomputed"):  # fmt: skip
        r = rows[figure]
        # 10 %, or one request's prompt: a store meeting a nearly full L1 is admitted or refused whole, and
        # the model's L1 occupancy at that moment can be a few chunks off LMCache's (docs/perf/calibration.md)
        assert abs(r["predicted"] - r["measured"]) <= max(0.1 * r["measured"], MAX_PROMPT), r
    assert out["run_fit"] is not None and out["ttft_held_out"]["requests"] >= 80
    assert 0.75 <= rows["TTFT p50 (s)"]["ratio"] <= 1.25, rows["TTFT p50 (s)"]
