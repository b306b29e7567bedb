"""A STAND-IN exporter of kvtier's metric contract (``dashboards/METRICS.md``), parsed from that file.

kvtier's own ``/metrics`` does not exist yet, so this serves every metric of the contract, with every label
value the contract lists (tiers default to gpu/cpu/disk/remote), counters increasing and the tick histogram
observing, from a private ``CollectorRegistry`` on 127.0.0.1. It proves the kvtier panels' PromQL (label
matching, ratios, quantiles) against a real Prometheus. It is NOT the end-to-end check: that is
``test_dashboard_queries.py`` with the real sidecar in ``SCRAPED``.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

CONTRACT = Path(__file__).resolve().parents[2] / "dashboards" / "METRICS.md"
TIERS = ("gpu", "cpu", "disk", "remote")
DEFAULT_VALUES = {
    "tier": TIERS,
    "src_tier": TIERS,
    "dst_tier": TIERS,
    "engine": ("http://127.0.0.1:8000",),
    "device": ("nvme0n1", "sda"),
    "collector": ("vllm", "lmcache", "storage"),
    "path": ("/mnt/kv-l2",),
    "action": ("promote", "demote"),
}
_ROW = re.compile(r"^\|\s*`(kvtier_\w+)`\s*\|\s*(counter|gauge|histogram)\s*\|([^|]*)\|", re.M)
_LABEL = re.compile(r"`(\w+)`(?:\s*\(([^)]*)\))?")


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str
    labels: dict[str, tuple[str, ...]]


def contract(path: Path = CONTRACT) -> list[Spec]:
    """Every ``| `kvtier_x` | type | labels |`` row of METRICS.md."""
    out = []
    for name, kind, cell in _ROW.findall(path.read_text()):
        labels: dict[str, tuple[str, ...]] = {}
        for m in _LABEL.finditer(cell):
            listed = tuple(re.findall(r"`([\w-]+)`", m.group(2) or ""))
            labels[m.group(1)] = listed or DEFAULT_VALUES.get(m.group(1), ("x",))
        out.append(Spec(name, kind, labels))
    return out


@contextmanager
def serving(specs: list[Spec] | None = None, step_s: float = 0.2) -> Iterator[int]:
    """Serve the contract on a free 127.0.0.1 port (yielded); a thread moves the values every ``step_s``."""
    specs = specs if specs is not None else contract()
    reg = CollectorRegistry()
    metrics = []
    for s in specs:
        base = s.name.removesuffix("_total") if s.kind == "counter" else s.name
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[s.kind]
        metrics.append((s, cls(base, f"contract stand-in for {s.name}", list(s.labels), registry=reg)))
    stop = threading.Event()

    def tick() -> None:
        for i in itertools.count(1):
            for s, m in metrics:
                for values in itertools.product(*s.labels.values()) if s.labels else [()]:
                    child = m.labels(*values) if values else m
                    if s.kind == "counter":
                        child.inc(1 + i % 3)
                    elif s.kind == "histogram":
                        child.observe(0.001 * (1 + i % 20))
                    else:  # ratios/sizes stay plausible: used < capacity, AUC in 0..1
                        child.set(50 + i % 10 if "capacity" not in s.name else 100)
                        if s.name.startswith("kvtier_predictor_"):
                            child.set(0.7 + 0.01 * (i % 5))
            if stop.wait(step_s):
                return

    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield int(server.server_address[1])
    finally:
        stop.set()
        t.join(timeout=5)
        server.shutdown()
        server.server_close()
