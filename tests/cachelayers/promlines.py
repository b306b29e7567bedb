"""Independent Prometheus line reader for assertions (no kvtier code): sums a family's samples."""

from __future__ import annotations

import httpx


def scrape_sum(url: str, name: str) -> float:
    """Sum of every sample of ``name`` (exact sample name, any labels) in ``url``'s /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] == name:
            total += float(value)
    return total
