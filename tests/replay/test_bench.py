"""The benchmarks run end to end on a small slice and print their ratios (guards against bit-rot)."""

from __future__ import annotations

import re

import pytest

from bench import index_scale, libcachesim_policies, replay_throughput
from kvtier.policies.registry import get_policy
from kvtier.replay.engine import replay
from kvtier.replay.runner import capacity_for, load_workload


def test_replay_throughput_prints_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--max-requests", "400", "--policies", "lru,fifo,belady,nope", "--capacities", "0.05"]
    assert replay_throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert "not registered here (skipped): nope" in out
    # the table's hit ratios are the replay engine's (recomputed here), and Belady beats both online policies
    row = r"^(\w+)\s+5%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$"
    rows = {m[1]: m for m in re.finditer(row, out, re.M)}
    assert set(rows) == {"lru", "fifo", "belady"}, out
    wl = load_workload("bundled", max_requests=400)
    cap = capacity_for(0.05, None, wl.distinct_blocks)
    assert cap is not None
    for name, m in rows.items():
        want = 100 * replay(wl.requests, get_policy(name, cap, 0)).prefix_hit_ratio
        assert float(m[5]) == pytest.approx(want, abs=0.005)
        assert float(m[2]) > 0  # a throughput was measured
    assert float(rows["belady"][5]) > max(float(rows["lru"][5]), float(rows["fifo"][5]))
    ratios = dict(re.findall(r"^  (\w+)\s+([\d.]+)x$", out, re.M))
    assert set(ratios) == {"lru", "fifo", "belady"} and all(float(v) > 0 for v in ratios.values()), out


def test_index_scale(capsys: pytest.CaptureFixture[str]) -> None:
    assert index_scale.main(["--blocks", "20000"]) == 0
    assert "memory per block" in capsys.readouterr().out


def test_libcachesim_policies(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libcachesim_policies, "NAMED", ["LRU", "ARC"])
    assert libcachesim_policies.main(["--capacities", "0.05", "--ours", "lru,arc"]) == 0
    out = capsys.readouterr().out
    lcs_lru = re.search(r"libcachesim:LRU\s+([\d.]+)", out)
    ours = re.search(r"kvtier:lru\s+([\d.]+)", out)
    assert lcs_lru and ours and lcs_lru.group(1) == ours.group(1)  # same trace, same capacity
