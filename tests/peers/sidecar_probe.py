"""Probes of a running ``kvtier serve`` for the cache-layer live tests (LMCache controller, Mooncake)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx

from tests.peers.procs import wait_for


def cache_layer(sidecar: str, name: str) -> dict[str, Any]:
    """The ``/v1/status`` ``cache_layers`` entry of collector ``name``."""
    layers = {c["name"]: c for c in httpx.get(sidecar + "/v1/status", timeout=5).json()["cache_layers"]}
    out: dict[str, Any] = layers[name]
    return out


def down_report(
    sidecar: str, name: str, what: str, proc: subprocess.Popen[bytes], log: Path
) -> dict[str, Any]:
    """After the peer behind collector ``name`` stopped: wait until ``/readyz`` names it down, then return
    what is down, whether storage stayed up, and the collector's error counts (``/metrics`` and status)."""
    ready = wait_for(lambda: (r := httpx.get(sidecar + "/readyz", timeout=5))
                     and name in r.json()["down"] and r.json(), 30, f"readyz names the {what}",
                     proc=proc, log=log)  # fmt: skip
    text = httpx.get(sidecar + "/metrics", timeout=5).text
    want = f'kvtier_collector_errors_total{{collector="{name}"}} '
    return {
        "down": sorted(ready["down"]),
        "storage_up": ready["collectors"].get("storage"),
        "errors_total": sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(want)),
        "fetch_errors": cache_layer(sidecar, name)["health"]["errors_by_kind"].get("fetch", 0),
    }
