"""Every user error of every ``kvtier`` subcommand: exit status 2, one line on stderr prefixed
``kvtier <command>:``, naming what is wrong (and the valid names where there is a list), no traceback.

Each case runs the real console entry point in a subprocess; the busy port is a real listening socket."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

NO_MPL = "import sys; sys.modules['matplotlib'] = None; "  # as if the 'plot' extra were not installed
POLICIES = "arc, belady, fifo, leaf-lru, learned, lfu, lfuda, lru, s3fifo"
CONFIGS = "llama3-70b, llama3-8b, mistral-7b, qwen2.5-7b"
SCENARIOS = "demo-8b, seed-480b"

# (id, argv with {bad} {missing} {busy} {badtoml} placeholders, stderr prefix, expected substrings)
CASES: list[tuple[str, list[str], str, list[str]]] = [
    ("root-unknown-option", ["--nope"], "kvtier", ["No such option: --nope"]),
    ("serve-mode-typo", ["serve", "--mode", "activ"], "kvtier serve", ["mode:", "or 'active'"]),
    ("serve-missing-config", ["serve", "--config", "{missing}"], "kvtier serve", ["no such file", "missing"]),
    ("serve-malformed-config", ["serve", "--config", "{badtoml}"], "kvtier serve", ["bad.toml"]),
    ("serve-busy-port", ["serve", "--listen", "{busy}"], "kvtier serve", ["cannot bind", "in use"]),
    ("serve-bad-listen", ["serve", "--listen", "nope"], "kvtier serve", ["HOST:PORT"]),
    ("serve-unknown-actuator", ["serve", "--actuator", "nope"], "kvtier serve",
     ["shadow, vllm-warmup, lmcache-mp, mooncake, lmcache-controller"]),
    ("serve-unknown-policy", ["serve", "--policy", "nope"], "kvtier serve", [POLICIES]),
    ("serve-unknown-option", ["serve", "--bogus"], "kvtier serve", ["No such option: --bogus"]),
    ("demo-unknown-scenario", ["demo", "--scenario", "nope"], "kvtier demo", [SCENARIOS]),
    ("demo-busy-port", ["demo", "--listen", "{busy}"], "kvtier demo", ["cannot bind"]),
    ("demo-bad-listen", ["demo", "--listen", "nope"], "kvtier demo", ["HOST:PORT"]),
    ("demo-concurrency", ["demo", "--concurrency", "0"], "kvtier demo", ["--concurrency", "or equal to 1"]),
    ("replay-missing-file", ["replay", "{missing}"], "kvtier replay", ["cannot read trace", "missing"]),
    ("replay-malformed", ["replay", "{bad}"], "kvtier replay", ["malformed trace", "bad.jsonl:1"]),
    ("replay-unknown-policy", ["replay", "bundled", "--policy", "nope"], "kvtier replay", [POLICIES]),
    ("replay-unknown-tiers", ["replay", "bundled", "--tiers", "nope"], "kvtier replay", [CONFIGS]),
    ("replay-no-trace", ["replay"], "kvtier replay", ["Missing argument"]),
    ("compare-missing-file", ["compare", "{missing}"], "kvtier compare", ["cannot read trace"]),
    ("compare-malformed", ["compare", "{bad}"], "kvtier compare", ["malformed trace"]),
    ("compare-unknown-policy", ["compare", "bundled", "--policies", "nope"], "kvtier compare", [POLICIES]),
    ("compare-capacities", ["compare", "bundled", "--capacities", "x"], "kvtier compare", ["--capacities"]),
    ("compare-plot-without-matplotlib", ["compare", "bundled", "--plot", "{png}"], "kvtier compare",
     ["--plot needs matplotlib", "kvtier[plot]"]),
    ("shadow-replay-missing-file", ["shadow-replay", "--trace", "{missing}"], "kvtier shadow-replay",
     ["cannot read trace"]),
    ("shadow-replay-malformed", ["shadow-replay", "--trace", "{bad}"], "kvtier shadow-replay",
     ["malformed trace"]),
    ("shadow-replay-unknown-policy", ["shadow-replay", "--policy", "nope"], "kvtier shadow-replay",
     ["none, " + POLICIES]),
    ("shadow-replay-bad-requests", ["shadow-replay", "--requests", "0"], "kvtier shadow-replay",
     ["--requests"]),
    ("bench-missing-file", ["bench", "{missing}", "--engine-url", "http://127.0.0.1:9", "--model", "m"],
     "kvtier bench", ["cannot read trace", "missing"]),
    ("bench-malformed", ["bench", "{bad}", "--engine-url", "http://127.0.0.1:9", "--model", "m"],
     "kvtier bench", ["cannot read trace", "bad.jsonl:1"]),
    ("bench-unknown-arm", ["bench", "--engine-url", "http://127.0.0.1:9", "--model", "m", "--arms", "nope"],
     "kvtier bench", ["baseline, shadow, active"]),
    ("bench-arm-args-unknown-arm", ["bench", "--engine-url", "http://127.0.0.1:9", "--model", "m",
                                    "--arm-args", "active/x=--debug"],
     "kvtier bench", ["--arm-args", "active/x"]),
    ("bench-no-engine-url", ["bench", "--model", "m"], "kvtier bench", ["--engine-url"]),
    ("bench-engine-down", ["bench", "--engine-url", "http://{busy}", "--model", "m", "--requests", "2"],
     "kvtier bench", ["cannot reach the engine"]),
    ("bench-engine-not-a-url", ["bench", "--engine-url", "nope", "--model", "m", "--requests", "2"],
     "kvtier bench", ["cannot reach the engine", "nope"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def busy() -> Iterator[str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.mark.parametrize(("argv", "prefix", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_error_is_one_line_exit_2(
    argv: list[str], prefix: str, want: list[str], tmp_path: Path, busy: str
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "hash_ids": [1]}\n{bad\n')
    (tmp_path / "bad.toml").write_text("engine_urls = [\n")
    subs = {"bad": str(tmp_path / "bad.jsonl"), "missing": str(tmp_path / "missing.jsonl"), "busy": busy,
            "badtoml": str(tmp_path / "bad.toml"), "png": str(tmp_path / "out.png")}  # fmt: skip
    args = [a.format(**subs) for a in argv]
    code = (NO_MPL if "--plot" in args else "") + "import sys; from kvtier.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})  # fmt: skip
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(prefix + ": "), lines[0]
    for w in want:
        assert w in lines[0], (w, lines[0])
    assert not (tmp_path / "out.png").exists() and r.stdout == ""  # failed before any work or output
