"""Run a test driver inside a private network namespace (``unshare -n``, loopback only; needs root or
user namespaces) and return the JSON it prints on its ``RESULT`` line. Used for peers that bind 0.0.0.0
(Mooncake, the LMCache controller's worker): their processes are unreachable from outside the namespace,
so the driver that exercises them runs inside it too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from .procs import PEER_ENV

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def run_in_netns(
    python: str,
    script: str,
    workdir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Execute ``tests/peers/scripts/<script>`` with ``python`` in a fresh network namespace."""
    workdir.mkdir(parents=True, exist_ok=True)
    full = dict(os.environ)
    full.update(PEER_ENV)
    # the repo (for tests.peers) + kvtier and its deps (httpx, prometheus_client) from the test venv, after
    # python's own; the venv's .pth files are processed (site.addsitedir below) because kvtier's editable
    # install maps kvtier.collectors etc. onto the repo's folders with an import hook a .pth installs
    purelib = sysconfig.get_paths()["purelib"]
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), purelib])
    full["PYTHONUNBUFFERED"] = "1"
    full.update(env or {})
    cmd = [
        "unshare",
        "-n",
        "--",
        "bash",
        "-c",
        'ip link set lo up && exec "$@"',
        "bash",
        python,
        "-c",
        "import runpy, site, sys; site.addsitedir(sys.argv[1]); sys.argv = sys.argv[2:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')",
        purelib,
        str(HERE / "scripts" / script),
        "--workdir",
        str(workdir),
        *args,
    ]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise TimeoutError(f"{script} timed out after {timeout_s} s\n{err.decode()[-4000:]}") from None
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(
            f"{script} failed (rc {p.returncode})\nstdout:\n{out.decode()[-3000:]}\n"
            f"stderr:\n{err.decode()[-4000:]}"
        )
    return dict(json.loads(lines[-1][len("RESULT ") :]))
