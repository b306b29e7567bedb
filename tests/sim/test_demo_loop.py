"""The demo's closed loop: the real sidecar (active mode, ``memory`` actuator, simulated clock) drives the
simulated layer while the demo serves ``/metrics`` and ``/v1/demo`` over real HTTP; the moves the sidecar
counts as applied are exactly the moves the layer applied, and ``--json`` has the three arms with CIs."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from kvtier.controller.demo import DemoOptions, run_demo
from tests.peers.procs import free_port


def _applied(text: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("kvtier_actuations_total{")
            and 'layer="memory"' in line
            and 'outcome="applied"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(300)
def test_sidecar_moves_are_the_layers_applied_moves(tmp_path: Any) -> None:
    port = free_port()
    out: dict[str, Any] = {}
    opts = DemoOptions(max_requests=300, listen=f"127.0.0.1:{port}", speed=60.0, state_dir=str(tmp_path))
    th = threading.Thread(target=lambda: out.update(run_demo(opts)), daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    seen_running = None
    deadline = time.monotonic() + 240
    while th.is_alive() and time.monotonic() < deadline:
        th.join(0.1)  # the poll interval
        try:
            m = httpx.get(url + "/metrics", timeout=5).text
            st = httpx.get(url + "/v1/demo", timeout=5).json()
        except httpx.HTTPError:
            continue  # not serving yet (baseline arms first) or already stopped
        if st["running"] and _applied(m) > 0:
            seen_running = (_applied(m), st)
            break
    assert seen_running is not None, "no applied actuation seen on /metrics while the kvtier arm ran"
    st = seen_running[1]
    assert set(st["arms"]) == {"no_offload", "default"}
    # the status page's baseline line: the default arm over as many requests as kvtier has served
    line = 'kvtier_demo_ttft_seconds{arm="default",quantile="0.5"}'
    m = ""
    wait_deadline = time.monotonic() + 120
    while th.is_alive() and time.monotonic() < wait_deadline:
        st = httpx.get(url + "/v1/demo", timeout=5).json()
        m = httpx.get(url + "/metrics", timeout=5).text
        if "so_far" in st["arms"]["default"] and line in m:
            break
        th.join(0.1)
    assert st["kvtier"]["requests_done"] > 0 and st["arms"]["default"]["so_far"]["ttft_p50_s"] > 0
    assert line in m
    gpu = [ln for ln in m.splitlines() if ln.startswith('kvtier_blocks_tracked{tier="gpu"}')]
    assert gpu and float(gpu[0].rsplit(" ", 1)[1]) > 0  # counted from the index the layer reports into
    page = httpx.get(url + "/", timeout=5).text
    assert 'id="s-demo"' in page and "/v1/demo" in page
    th.join(timeout=240)
    assert not th.is_alive()
    k = out["arms"]["kvtier"]
    assert k["actuations_applied_total"] > 0
    assert k["kvtier_actuations_applied_metric"] == k["actuations_applied_total"]
    assert set(out["arms"]) == {"no_offload", "default", "kvtier"}
    for arm in out["arms"].values():
        for key in ("ttft_p50_s", "ttft_p99_s", "throughput_tokens_per_s"):
            assert arm[key] > 0 and arm[f"{key}_ci95"] >= 0
    json.dumps(out)  # what --json writes
    # tiering is worth something on this slice: the default beats no offload on hits
    assert out["arms"]["default"]["hit_ratio"] > out["arms"]["no_offload"]["hit_ratio"]


def test_cli_writes_the_three_arms_as_json(tmp_path: Any) -> None:
    import subprocess
    import sys

    out = tmp_path / "demo.json"
    args = ["demo", "--max-requests", "150", "--listen", "127.0.0.1:0", "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "kvtier", *args, "--state-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kvtier (active)" in r.stdout and "TTFT p50" in r.stdout
    arms = json.loads(out.read_text())["arms"]
    assert set(arms) == {"no_offload", "default", "kvtier"}
    for a in arms.values():
        assert {"ttft_p50_s", "ttft_p99_s", "throughput_tokens_per_s", "ttft_p50_s_ci95"} <= set(a)


@pytest.mark.timeout(300)
def test_the_kvtier_arm_is_deterministic_while_it_serves(tmp_path: Any) -> None:
    """The simulation alone drives the sidecar: paced over a few wall seconds (long enough for a wall-clock
    reconcile loop to tick in between, as the app's lifespan used to start one), two runs decide and apply
    exactly the same."""
    figs = []
    for i in range(2):
        opts = DemoOptions(
            max_requests=300, listen="127.0.0.1:0", speed=80.0, state_dir=str(tmp_path / f"{i}")
        )
        k = run_demo(opts)["arms"]["kvtier"]
        keys = ("ticks", "decisions", "actuations_applied_total", "ttft_p50_s", "ttft_p99_s")
        figs.append(tuple(k[key] for key in keys))
    assert figs[0] == figs[1]
    assert figs[0][2] > 0
