"""Per-request output hashes of ``kvtier replay`` on the bundled conversation trace.

A restructure must not change a single decision: this replays ``lru``, ``arc`` and ``learned`` at
1 %, 10 % and 40 % of the trace's distinct blocks, hashes each ``--per-request`` file (one JSON line
per request: hits, misses, tokens) and compares with ``tests/data/replay_fingerprints.json``.

python -m bench.decision_fingerprints           # compare (exit 1 on any difference)
python -m bench.decision_fingerprints --write   # record the current code's hashes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "tests" / "data" / "replay_fingerprints.json"
POLICIES = ("lru", "arc", "learned")
CAPACITIES = ("0.01", "0.1", "0.4")


def fingerprint(policy: str, capacity: str) -> str:
    """sha256 of the per-request JSON lines of one replay cell (a subprocess: the CLI is what users run)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "per_request.jsonl"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier",
                "replay",
                "bundled",
                "--policy",
                policy,
                "--capacity",
                capacity,
                "--per-request",
                str(out),
                "--format",
                "json",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            env={"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        return hashlib.sha256(out.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record the hashes instead of comparing")
    args = ap.parse_args(argv)
    got = {f"{p}@{c}": fingerprint(p, c) for p in POLICIES for c in CAPACITIES}
    if args.write:
        EXPECTED.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        print(f"wrote {len(got)} fingerprints to {EXPECTED.relative_to(ROOT)}")
        return 0
    want = json.loads(EXPECTED.read_text())
    bad = sorted(k for k in want if got.get(k) != want[k])
    for k in sorted(got):
        print(f"{k:14s} {got[k][:16]} {'ok' if k not in bad else 'DIFFERS'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
