"""The live sidecar's per-tier view (``controller/tier_view.py``): pure aggregation and its Prometheus export.

Inputs are parsed by the real parsers from vLLM exposition text (two DP ranks, written here in vLLM's own
family names) and from a capture of a real LMCache MP server's ``/metrics`` + ``/status``
(``tests/cachelayers/data``). The end-to-end check against a running vLLM + LMCache is
``tests/controller/test_lmcache_mp_serve.py::test_status_per_tier_view_matches_lmcache_and_vllm``.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.collectors.lmcache_mp import LMCacheMPSample, parse_lmcache_mp
from kvtier.collectors.vllm_metrics import VllmMetricsParser
from kvtier.controller.tier_view import PerTierView, PerTierViewExporter, build_tier_view

DATA = Path(__file__).resolve().parents[1] / "cachelayers" / "data"


def vllm_text(hits: tuple[float, float], queries: tuple[float, float]) -> str:
    lines = ["# TYPE vllm:prefix_cache_queries counter", "# TYPE vllm:prefix_cache_hits counter"]
    for eng in (0, 1):
        lab = f'engine="{eng}",model_name="tiny"'
        lines += [f"vllm:prefix_cache_queries_total{{{lab}}} {queries[eng]}",
                  f"vllm:prefix_cache_hits_total{{{lab}}} {hits[eng]}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def lmcache_sample() -> LMCacheMPSample:
    return parse_lmcache_mp(
        (DATA / "lmcache_mp_metrics.txt").read_text(),
        json.loads((DATA / "lmcache_mp_status.json").read_text()),
    )


def test_view_sums_engines_and_cache_layers() -> None:
    engines = VllmMetricsParser("v").parse(vllm_text((96.0, 32.0), (400.0, 100.0)), now=1.0).engines
    assert len(engines) == 2
    mp = lmcache_sample()
    v = build_tier_view(engines, [mp, mp])  # two LMCache servers
    assert v.hit_tokens["gpu"] == 128.0 and v.lookup_tokens == 500.0
    assert v.hit_tokens["cpu"] == 2 * mp.hit_tokens_by_tier["cpu"]
    assert v.hit_tokens["disk"] == 2 * mp.hit_tokens_by_tier["disk"]
    assert v.used_bytes == {t: 2 * b for t, b in mp.used_bytes.items()}
    assert v.objects == {t: 2 * n for t, n in mp.objects.items()} and v.objects["cpu"] > 0
    assert "remote" not in v.hit_tokens
    assert build_tier_view([], []) == PerTierView()


def test_exporter_serves_every_tier_and_follows_the_view() -> None:
    current = [PerTierView()]
    reg = CollectorRegistry()
    reg.register(PerTierViewExporter(lambda: current[0]))

    def scrape() -> dict[tuple[str, str], float]:
        out = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                out[(s.name, s.labels.get("tier", ""))] = s.value
        return out

    first = scrape()
    for t in ("gpu", "cpu", "disk", "remote"):  # created at zero: the panels have series from the start
        assert first[("kvtier_tier_hit_tokens_total", t)] == 0.0
        assert first[("kvtier_tier_objects", t)] == 0.0
    assert first[("kvtier_lookup_tokens_total", "")] == 0.0
    # no invented capacity: used / capacity (the TierNearlyFull alert) must not become +Inf
    assert not any(name in ("kvtier_tier_used_bytes", "kvtier_tier_capacity_bytes") for name, _ in first)
    current[0] = PerTierView({"gpu": 64.0, "disk": 512.0}, 1024.0, {"cpu": 3e6}, {"cpu": 8e6}, {"cpu": 7})
    later = scrape()
    assert later[("kvtier_tier_hit_tokens_total", "gpu")] == 64.0
    assert later[("kvtier_tier_hit_tokens_total", "disk")] == 512.0
    assert later[("kvtier_lookup_tokens_total", "")] == 1024.0
    assert later[("kvtier_tier_used_bytes", "cpu")] == 3e6
    assert later[("kvtier_tier_capacity_bytes", "cpu")] == 8e6
    assert later[("kvtier_tier_objects", "cpu")] == 7.0
    assert ("kvtier_tier_capacity_bytes", "disk") not in later
