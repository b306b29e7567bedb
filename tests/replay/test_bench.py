"""The benchmarks run end to end on a small slice and print their ratios (guards against bit-rot)."""

from __future__ import annotations

import re

import pytest

from bench import index_scale, libcachesim_policies, replay_throughput


def test_replay_throughput_prints_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--max-requests", "400", "--policies", "lru,fifo,belady,nope", "--capacities", "0.05"]
    assert replay_throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert "not registered here (skipped): nope" in out
    assert re.search(r"lru\s+1\.00x", out) and re.search(r"belady\s+\d+\.\d\dx", out)


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
