"""``kvtier replay`` / ``kvtier compare`` end to end (in-process via typer's runner, plus one real
subprocess of the console script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli import _register, app
from kvtier.policies.registry import CLASSIC

_register()
runner = CliRunner()
ONLINE = [*CLASSIC, "learned"]  # learned ships with kvtier: a broken import fails, never shrinks this


def invoke(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr if r.stderr_bytes is not None else ""


def test_replay_json_fields() -> None:
    code, out, _ = invoke("replay", "bundled", "--policy", "lru", "--capacity", "0.05", "--format", "json")
    assert code == 0, out
    d = json.loads(out)
    for k in (
        "policy",
        "capacity_blocks",
        "requests",
        "block_accesses",
        "block_hit_ratio",
        "prefix_hit_ratio",
    ):
        assert k in d
    assert d["capacity_blocks"] == round(0.05 * 182790) == 9140
    assert d["requests"] == 12031 and d["block_accesses"] == 288500
    assert abs(d["prefix_hit_ratio"] - 0.1993) < 0.0005


def test_replay_json_reports_the_learned_predictors_own_quality() -> None:
    """``--format json`` of a learned replay carries the predictor's out-of-sample quality; a classic
    policy has none to report."""
    code, out, _ = invoke("replay", "bundled", "--policy", "learned", "--capacity-blocks", "1500",
                          "--max-requests", "3000", "--format", "json")  # fmt: skip
    assert code == 0, out
    q = json.loads(out)["predictor"]
    assert q["trained"] and q["retrains"] >= 1 and q["scored_accesses"] > 0
    assert 0.5 < q["auc"] < 1 and 0.0 <= q["brier"] <= 0.25
    assert q["expert"] in q["expert_scores"] and "arc" in q["expert_scores"]
    code, out, _ = invoke("replay", "bundled", "--policy", "lru", "--capacity-blocks", "1500",
                          "--max-requests", "300", "--format", "json")  # fmt: skip
    assert code == 0 and "predictor" not in json.loads(out)


def test_capacity_counts_only_replayed_requests(tmp_path: Path) -> None:
    code, out, _ = invoke(
        "replay", "bundled", "--capacity", "0.1", "--max-requests", "100", "--format", "json"
    )
    d = json.loads(out)
    assert code == 0 and d["requests"] == 100
    assert d["capacity_blocks"] == round(0.1 * d["distinct_blocks"]) and d["distinct_blocks"] < 182790


@pytest.mark.parametrize("policy", ONLINE)
def test_per_request_is_causal(policy: str, tmp_path: Path) -> None:
    """With a fixed --capacity-blocks, the first N lines of a full run equal a --max-requests N run."""
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    base = ["replay", "bundled", "--policy", policy, "--capacity-blocks", "1500", "--format", "json"]
    code, out, _ = invoke(*base, "--max-requests", "3000", "--per-request", str(full))
    assert code == 0, out
    code, out, _ = invoke(*base, "--max-requests", "1200", "--per-request", str(part))
    assert code == 0, out
    a, b = full.read_text().splitlines(), part.read_text().splitlines()
    assert len(a) == 3000 and len(b) == 1200
    assert a[:1200] == b
    rec = json.loads(a[-1])
    assert {"request", "hit_blocks", "prefix_hit_tokens", "hit_tiers"} <= rec.keys()
    assert len(rec["hit_tiers"]) == rec["hit_blocks"]
    assert sum(json.loads(x)["hit_blocks"] for x in b) == json.loads(out)["block_hits"]


def test_per_request_sums_to_totals(tmp_path: Path) -> None:
    f = tmp_path / "pr.jsonl"
    args = ["replay", "bundled", "--policy", "s3fifo", "--capacity", "0.02", "--tiers", "llama3-8b"]
    code, out, _ = invoke(*args, "--per-request", str(f), "--format", "json")
    assert code == 0, out
    d = json.loads(out)
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert len(lines) == d["requests"]
    assert sum(x["hit_blocks"] for x in lines) == d["block_hits"]
    assert sum(x["prefix_hit_tokens"] for x in lines) == d["prefix_hit_tokens"]
    assert all("ttft_ms" in x and x["ttft_ms"] >= 0 for x in lines)
    assert {t for x in lines for t in x["hit_tiers"]} <= {"gpu", "cpu", "disk", "remote"}
    assert [t["tier"] for t in d["tiers"]] == ["gpu", "cpu", "disk", "remote"]
    assert d["tiers"][0]["capacity_blocks"] == round(0.02 * 182790)
    assert d["ttft"]["mean_ms"] < d["ttft"]["no_cache_mean_ms"]
    assert sum(t["hit_blocks"] for t in d["tiers"]) == d["block_hits"]
    cpu = d["tiers"][1]
    span_s = (lines[-1]["timestamp_ms"] - lines[0]["timestamp_ms"]) / 1e3
    assert cpu["write_utilization"] == pytest.approx(cpu["bytes_written"] / 50e9 / span_s, rel=1e-3)


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["replay", "bundled", "--policy", "nope", "--capacity", "0.1"], "not available"),
        (["replay", "bundled", "--policy", "lru"], "--capacity"),
        (["replay", "bundled", "--capacity", "1.5"], "fraction"),
        (["replay", "/nonexistent.jsonl", "--capacity", "0.1"], "cannot read trace"),
        (["replay", "bundled", "--capacity", "0.1", "--tiers", "nope"], "tier config"),
        (["compare", "bundled", "--capacities", "x"], "--capacities"),
        (["replay", "bundled", "--capacity", "0.1", "--per-request", "/no/such/dir/x.jsonl"], "cannot write"),
        (["replay", "bundled", "--capacity", "0.1", "--format", "xml"], "--format"),
    ],
)
def test_cli_errors(args: list[str], msg: str) -> None:
    code, out, err = invoke(*args)
    assert code == 2
    assert msg in out + err


def test_malformed_trace_reports_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    code, out, err = invoke("replay", str(p), "--capacity", "0.5")
    assert code == 2 and f"{p}:2:" in out + err


def test_compare_table_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "c.png"
    code, out, _ = invoke("compare", "bundled", "--policies", "fifo,s3fifo", "--capacities", "0.01,0.05",
                          "--max-requests", "2000", "--format", "json", "--plot", str(png))  # fmt: skip
    assert code == 0, out
    d = json.loads(out)
    assert d["policies"] == ["fifo", "s3fifo", "lru", "belady"]  # gap ends added
    cells = {(r["policy"], r["capacity"]): r for r in d["results"]}
    for f in (0.01, 0.05):
        assert cells[("lru", f)]["gap_closed"] in (0.0, None)
        assert cells[("belady", f)]["gap_closed"] in (1.0, None)
        assert all(
            cells[("belady", f)]["prefix_hit_ratio"] >= cells[(p, f)]["prefix_hit_ratio"]
            for p in d["policies"]
        )
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(png)  # a real picture: a sized canvas with several coloured lines, not a blank page
    assert img.shape[0] >= 300 and img.shape[1] >= 400, img.shape
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 20, len(colours)
    assert (img[..., :3] < 0.2).all(axis=-1).mean() > 0.001  # the black dashed Belady bound and the axes
    code, out, _ = invoke(
        "compare", "bundled", "--policies", "lru", "--capacities", "0.02", "--max-requests", "500"
    )
    assert code == 0 and "gap closed" in out and "belady" in out
    # the README's table: nine policies x six capacities, rendered at 80 columns (as when piped)
    names = "lru,fifo,lfu,lfuda,s3fifo,arc,leaf-lru,belady"
    caps = "0.01,0.02,0.05,0.1,0.2,0.4"
    code, out, _ = invoke(
        "compare", "bundled", "--policies", names, "--capacities", caps, "--max-requests", "300"
    )
    assert code == 0, out
    rows = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert len(rows) >= 3 * 8
    for name in names.split(","):  # every table row starts with its policy name, in full
        assert sum(ln.split("│")[1].strip() == name for ln in rows) == 3, name


def test_console_script_subprocess() -> None:
    """The installed entry point, as a user runs it."""
    env = {**os.environ, "DO_NOT_TRACK": "1"}
    exe = Path(sys.executable).with_name("kvtier")
    assert exe.exists(), f"console script {exe} missing: reinstall with `pip install -e .`"
    cmd = [str(exe)]
    args = ["replay", "bundled", "--policy", "fifo", "--capacity", "0.01", "--format", "json"]
    r = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert abs(json.loads(r.stdout)["block_hit_ratio"] - 0.0505) < 0.0005
