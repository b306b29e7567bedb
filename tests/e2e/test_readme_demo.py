"""The README's first command on a fresh venv: ``python3 -m venv .venv && .venv/bin/pip install . &&
.venv/bin/kvtier demo`` (no extras, no vLLM), bounded with ``--duration 30``; its live progress (with no
terminal: a ``progress:`` line every 5 s) must advance, and the final comparison must print.

Uses pip's configured index (the same one CI installs from). Run: ``pytest tests/e2e/test_readme_demo.py -s``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.peers.procs import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# controller/demo.py's line when stdout is not a terminal (a rich progress bar when it is)
PROGRESS = re.compile(
    r"^progress: (\d+)/(\d+) requests \| simulated (\d+) s \| ticks (\d+) \| moves applied (\d+)$", re.M
)


def check_progress(out: str) -> list[tuple[int, int]]:
    """The demo's ``progress:`` lines: several, each a step further -> [(requests arrived, simulated s)]."""
    lines = [(int(m[1]), int(m[3])) for m in PROGRESS.finditer(out)]
    assert len(lines) >= 3, f"expected several progress lines, got {len(lines)}:\n{out[:3000]}"
    served = [n for n, _ in lines]
    trace_s = [t for _, t in lines]
    assert served == sorted(served) and trace_s == sorted(trace_s), lines
    assert len(set(served)) >= 3 and len(set(trace_s)) >= 3, f"progress does not advance: {lines}"
    total = {int(m[2]) for m in PROGRESS.finditer(out)}
    assert len(total) == 1 and served[-1] <= total.pop(), lines
    return lines


def test_readme_first_command_prints_the_comparison() -> None:
    wd = Path(tempfile.mkdtemp(prefix="kvtier-readme-"))
    try:
        venv = wd / ".venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        # `pip install .` of a clone: a copy of the tracked files (building in the repository itself would
        # leave build/ there)
        clone = wd / "clone"
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        for name in filter(None, tracked.decode().split("\0")):
            if (REPO / name).is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, clone / name)
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(clone)],
                             capture_output=True, text=True, timeout=1800)  # fmt: skip
        assert pip.returncode == 0, pip.stderr[-3000:]
        # no dev extras, no vLLM: the demo's imports must not need them
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
        freeze = subprocess.run(
            [str(venv / "bin" / "pip"), "freeze"], capture_output=True, text=True, env=env
        )
        assert "vllm" not in freeze.stdout.lower() and "pytest" not in freeze.stdout.lower()
        cmd = [
            str(venv / "bin" / "kvtier"),
            "demo",
            "--duration",
            "30",
            "--listen",
            f"127.0.0.1:{free_port()}",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=wd, env=env)
        out = run.stdout
        print(out[-4000:])
        assert run.returncode == 0, run.stderr[-3000:]
        assert "status page: http://127.0.0.1:" in out
        print(f"progress (served, trace s): {check_progress(out)}")
        assert out.index("progress:") < out.index("kvtier (active)"), "progress after the comparison?"
        assert "no offload" in out and "layer default" in out and "kvtier (active)" in out
        for row in ("hit tokens from gpu", "hit tokens from cpu", "bytes cpu->gpu", "TTFT p50", "TTFT p99",
                    "throughput", "sidecar moves applied"):  # fmt: skip
            assert row in out, f"final comparison lacks {row!r}"
    finally:
        shutil.rmtree(wd, ignore_errors=True)
