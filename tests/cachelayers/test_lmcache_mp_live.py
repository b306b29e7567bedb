"""kvtier's LMCache MP actuator against a REAL vLLM CPU + LMCacheMPConnector + LMCache MP server.

kvtier's own moves change where vLLM's next hit comes from (reference/cachelayers/tiering_e2e.py by hand):
demoted chunks are then served from L2, promoted (prefetched) ones from L1, evicted ones miss -- measured
with ``lmcache_mp_lookup_hit_l{1,2}_tokens_total`` and ``vllm:external_prefix_cache_hits_total``. Before each
request vLLM's own 48-block prefix cache is flushed with filler prompts, so any hit is an external one.
Also checks the client-side keys against the live L2 files and the collector against the raw text.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvtier.collectors.lmcache_mp import LMCacheMPCollector
from kvtier.controller.actuators.base import BlockRef, Outcome
from kvtier.controller.actuators.lmcache_keys import object_keys
from kvtier.controller.actuators.lmcache_mp import LMCacheMPActuator
from kvtier.controller.actuators.resilience import HttpCaller
from kvtier.policies.tiers import Tier
from tests import figures
from tests.cachelayers.promlines import scrape_sum

pytestmark = [pytest.mark.lmcache, pytest.mark.vllm]

CAPTURES = Path(__file__).resolve().parent / "data"
VLLM_CAPTURE = Path(__file__).resolve().parents[1] / "e2e" / "data" / "vllm_cpu_0.32_metrics.txt"
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lam", "mu"]


def text(seed: int, n: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) + str(r.randint(0, 99)) for _ in range(n))


class Rig:
    def __init__(self, server: Any, vllm: Any) -> None:
        self.server, self.vllm = server, vllm
        self.filler = 50_000
        self.act = LMCacheMPActuator(HttpCaller(server.url, timeout_s=10.0))
        self.loop = asyncio.new_event_loop()
        self.collector = LMCacheMPCollector(
            "lmcache_mp:test", server.url, client=httpx.AsyncClient(), registry=CollectorRegistry()
        )

    def complete(self, prompt: str) -> dict[str, Any]:
        r = httpx.post(
            self.vllm.url + "/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
        )
        r.raise_for_status()
        return dict(r.json())

    def wait_l2(self, keys: list[Any], timeout_s: float = 30.0) -> None:
        """Poll until every key's L2 file exists: LMCache writes L2 behind the response (write-behind)."""
        from tests.peers.sidecar import wait_for

        names = {k.fs_filename() for k in keys}
        wait_for(
            lambda: names <= {f.name for f in self.server.l2_dir.iterdir()},
            timeout_s,
            f"{len(names)} L2 files in {self.server.l2_dir}",
        )

    def tokens(self, prompt: str) -> list[int]:
        r = httpx.post(self.vllm.url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30)
        return list(r.json()["tokens"])

    def flush_vllm(self) -> None:
        """Push the prompt out of vLLM's own 48-block prefix pool (6 distinct ~650-token prompts)."""
        for _ in range(6):
            self.filler += 1
            self.complete(text(self.filler, 150))

    def counters(self) -> dict[str, float]:
        obs = self.loop.run_until_complete(self.collector.poll())
        assert obs is not None, self.collector.health
        return {
            "l1": scrape_sum(self.server.url, "lmcache_mp_lookup_hit_l1_tokens_total"),
            "l2": scrape_sum(self.server.url, "lmcache_mp_lookup_hit_l2_tokens_total"),
            "ext": scrape_sum(self.vllm.url, "vllm:external_prefix_cache_hits_total"),
            "kvtier_cpu": obs.hit_tokens_by_tier["cpu"],
            "kvtier_disk": obs.hit_tokens_by_tier["disk"],
        }

    def ask(self, tag: str, prompt: str) -> dict[str, float]:
        c0 = self.counters()
        self.complete(prompt)
        # the connector reports the lookup before the response returns; the counters are in-process
        c1 = self.counters()
        d = {k: c1[k] - c0[k] for k in c0}
        # kvtier's collector sees exactly what LMCache's own counters say
        assert d["kvtier_cpu"] == d["l1"] and d["kvtier_disk"] == d["l2"], d
        figures.record("LMCACHE_MP", {"request": tag, **{k: d[k] for k in ("l1", "l2", "ext")}})
        return d


@pytest.fixture(scope="module")
def rig(mp_with_vllm: Any) -> Rig:
    return Rig(*mp_with_vllm)


def test_client_side_keys_match_live_l2_files(rig: Rig) -> None:
    p = text(11, 120)
    toks = rig.tokens(p)
    rig.complete(p)
    keys = object_keys(rig.vllm.model_path, toks, rig.act.chunk_size())
    assert len(keys) == len(toks) // 64 >= 4
    rig.wait_l2(keys)  # fails at the deadline if client-side names never match a live file


def test_kvtier_moves_change_where_vllms_next_hit_comes_from(rig: Rig) -> None:
    p = text(7, 120)
    toks = rig.tokens(p)
    n_chunk_tokens = len(toks) // 64 * 64
    ref = BlockRef(model=rig.vllm.model_path, token_ids=tuple(toks))
    n_keys = len(rig.act.keys_for(ref))

    d = rig.ask("P cold", p)
    assert d["ext"] == 0

    rig.flush_vllm()
    d = rig.ask("P again (LMCache L1 holds it)", p)
    assert d["l1"] == n_chunk_tokens and d["l2"] == 0 and d["ext"] == n_chunk_tokens

    rig.flush_vllm()
    rig.wait_l2(rig.act.keys_for(ref))
    res = rig.act.demote([ref], Tier.DISK)
    assert res.count(Outcome.APPLIED) == n_keys, res
    figures.record("LMCACHE_MP", {"move": "demote cpu->disk", "applied": res.count(Outcome.APPLIED)})
    d = rig.ask("P after kvtier demote", p)
    assert d["l2"] == n_chunk_tokens and d["l1"] == 0 and d["ext"] == n_chunk_tokens

    rig.flush_vllm()
    # a lookup-driven L2 load is not retained in L1: demote again finds nothing to free
    again = rig.act.demote([ref], Tier.DISK)
    assert again.ok and again.count(Outcome.APPLIED) + again.count(Outcome.SKIPPED) == n_keys
    res = rig.act.promote([ref], Tier.CPU)
    assert res.count(Outcome.APPLIED) == n_keys and res.handle, res
    figures.record(
        "LMCACHE_MP",
        {
            "move": "promote disk->cpu",
            "applied": res.count(Outcome.APPLIED),
            "elapsed_ms": round(res.elapsed_s * 1000, 1),
        },
    )
    d = rig.ask("P after kvtier promote", p)
    assert d["l1"] == n_chunk_tokens and d["l2"] == 0 and d["ext"] == n_chunk_tokens

    rig.flush_vllm()
    res = rig.act.evict([ref], None)
    assert res.count(Outcome.APPLIED) == n_keys, res
    figures.record("LMCACHE_MP", {"move": "evict all tiers", "applied": res.count(Outcome.APPLIED)})
    d = rig.ask("P after kvtier evict", p)
    assert d["l1"] == 0 and d["l2"] == 0 and d["ext"] == 0


def test_demote_never_deletes_the_last_copy(rig: Rig) -> None:
    q = text(8, 120)
    toks = rig.tokens(q)
    n_chunk_tokens = len(toks) // 64 * 64
    rig.complete(q)  # now in L1 and L2
    ref = BlockRef(model=rig.vllm.model_path, token_ids=tuple(toks))
    keys = rig.act.keys_for(ref)
    rig.wait_l2(keys)
    # drop only the L2 copies: L1 now holds the last copy
    res = rig.act.evict([ref], Tier.DISK)
    assert res.count(Outcome.APPLIED) == len(keys)
    assert not any(rig.server.l2_dir.joinpath(k.fs_filename()).exists() for k in keys)
    l1_before = rig.server.l1_objects()
    res = rig.act.demote([ref], Tier.DISK)
    assert res.count(Outcome.SKIPPED) == len(keys)
    assert all("last copy" in o.detail for o in res.outcomes)
    assert rig.server.l1_objects() == l1_before
    rig.flush_vllm()
    d = rig.ask("Q after refused demote (L1 kept the only copy)", q)
    assert d["l1"] == n_chunk_tokens and d["ext"] == n_chunk_tokens


def test_prefetch_of_unknown_model_fails_per_key_with_the_servers_reason(rig: Rig) -> None:
    ref = BlockRef(model="not-registered", token_ids=tuple(range(1, 129)))
    res = rig.act.prefetch([ref], Tier.CPU)
    assert res.count(Outcome.FAILED) == 2
    assert all("503" in o.detail and "no layout registered" in o.detail for o in res.outcomes)
    assert rig.act.health().breaker == "closed"  # a live server's refusal is not an outage


def test_quota_round_trip(rig: Rig) -> None:
    res = rig.act.set_quota("tenantA", 512 << 20)
    assert res.ok and res.count(Outcome.APPLIED) == 1
    assert rig.act.get_quota("tenantA")["limit_gb"] == pytest.approx(0.5)
    assert rig.act.set_quota("tenantA", None).ok
    assert rig.act.get_quota("tenantA").get("exists") is False


def test_sidecar_status_per_tier_hits_match_lmcache_and_vllm(rig: Rig) -> None:
    """``kvtier serve --engine-url V --lmcache-url M``: /v1/status's cache-layer view equals LMCache's own
    L1/L2 hit counters, and their sum equals vLLM's external prefix-cache hits (every external hit comes from
    LMCache). The test makes its own L1 and L2 hits first."""
    from kvtier.controller.settings import Settings
    from tests.peers.sidecar import running, wait_for

    p = text(9, 120)
    ref = BlockRef(model=rig.vllm.model_path, token_ids=tuple(rig.tokens(p)))
    rig.complete(p)
    rig.flush_vllm()
    assert rig.ask("S from L1", p)["l1"] > 0
    rig.flush_vllm()
    rig.wait_l2(rig.act.keys_for(ref))
    assert rig.act.demote([ref], Tier.DISK).count(Outcome.APPLIED) > 0
    assert rig.ask("S from L2 after a demote", p)["l2"] > 0
    own = {
        "cpu": scrape_sum(rig.server.url, "lmcache_mp_lookup_hit_l1_tokens_total"),
        "disk": scrape_sum(rig.server.url, "lmcache_mp_lookup_hit_l2_tokens_total"),
    }
    ext = scrape_sum(rig.vllm.url, "vllm:external_prefix_cache_hits_total")
    assert own["cpu"] > 0 and own["disk"] > 0 and own["cpu"] + own["disk"] == ext
    settings = Settings.model_validate(
        dict(
            engine_urls=[rig.vllm.url],
            lmcache_urls=[rig.server.url],
            scrape_interval_s=0.5,
            storage_enabled=False,
        )
    )
    with running(settings) as sc:

        def layer() -> dict[str, Any] | None:
            for c in sc.status().get("cache_layers") or []:
                latest = c.get("latest")
                if c.get("kind") == "lmcache_mp" and latest:
                    return dict(latest)
            return None

        latest = wait_for(layer, 30, "lmcache_mp in /v1/status")
    assert latest["hit_tokens_by_tier"] == own
    figures.record(
        "LMCACHE_MP",
        {"sidecar_v1_status_hit_tokens_by_tier": latest["hit_tokens_by_tier"], "vllm_external_hits": ext},
    )


def _shape(text: str, prefix: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Families named ``prefix*``: name -> (type, label names of its samples but le/quantile)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith(prefix):
            labels = {k for smp in fam.samples for k in smp.labels} - {"le", "quantile"}
            out[fam.name] = (fam.type, frozenset(labels))
    return out


def _keys(d: Any, at: str = "") -> set[str]:
    """Every key path of a JSON document (list items as ``[]``)."""
    if isinstance(d, dict):  # per-context ids (digits) are data, not fields
        named = {("<id>" if str(k).lstrip("-").isdigit() else k): v for k, v in d.items()}
        return {f"{at}.{k}" for k in named} | {p for k, v in named.items() for p in _keys(v, f"{at}.{k}")}
    if isinstance(d, list):
        return {p for v in d for p in _keys(v, f"{at}[]")}
    return set()


def test_canned_captures_match_the_installed_peers(rig: Rig) -> None:
    """The captures the parser tests read offline -- vLLM's ``/metrics`` (tests/e2e/data), LMCache MP's
    ``/metrics`` and ``/status`` (tests/cachelayers/data) -- are what the installed peers serve now: the same
    families with the same types and label names, the same status fields. A peer upgrade that renames or
    drops one fails here, not silently in a parser test that still reads the old text."""
    rig.complete(text(12, 120))  # every family has a sample
    vllm_now = httpx.get(rig.vllm.url + "/metrics", timeout=10).text
    lmc_now = rig.server.metrics_text()
    live = _shape(vllm_now, "vllm:")
    # a KV connector adds families to vLLM's (the capture is a plain vLLM): the LMCacheMPConnector's own
    # ``vllm:lmcache_mp_*`` and vLLM's KV-fetch stage gauge
    connector = {
        k for k in live if k.startswith("vllm:lmcache_mp_") or k == "vllm:num_requests_kv_fetch_by_stage"
    }
    assert "vllm:num_requests_kv_fetch_by_stage" in connector and len(connector) > 1, sorted(live)
    assert {k: v for k, v in live.items() if k not in connector} == _shape(VLLM_CAPTURE.read_text(), "vllm:")
    # LMCache creates most families at their first event, so the live server may hold more than the capture:
    # every captured family must still be served, with the same type and label names
    lmc_live = _shape(lmc_now, "lmcache")
    lmc_canned = _shape((CAPTURES / "lmcache_mp_metrics.txt").read_text(), "lmcache")
    assert lmc_canned and {k: lmc_live.get(k) for k in lmc_canned} == lmc_canned
    canned = json.loads((CAPTURES / "lmcache_mp_status.json").read_text())
    # every field of the captured /status is still served (the server adds per-context entries as engines
    # register, so the live document may hold more)
    assert _keys(canned) <= _keys(rig.server.status())


def test_keeper_drops_a_prompts_first_sight_chunks_in_one_call_and_keeps_their_l2_copy(rig: Rig) -> None:
    """Second-sight admission on the real layer: the chunks a prompt stored for the first time leave L1 in
    one ``DELETE`` (one round trip for the batch), their L2 copies stay, and the prompt's next look-up is
    served from L2 -- all of it, none lost."""
    from kvtier.controller.l1_keeper import L1Keeper
    from tests.peers.sidecar import wait_for

    p = text(21, 120)
    toks = rig.tokens(p)
    n_chunk_tokens = len(toks) // 64 * 64
    act = LMCacheMPActuator(HttpCaller(rig.server.url, timeout_s=10.0), model_name=rig.vllm.model_path)
    deletes: list[int] = []
    request = act.caller.request

    def spy(method: str, path: str, body: Any = None) -> Any:  # counts the keeper's round trips
        if method == "DELETE":
            deletes.append(len(body["keys"]))
        return request(method, path, body)

    act.caller.request = spy  # type: ignore[method-assign,assignment]
    keeper = L1Keeper(act, chain_tokens=lambda _h: tuple(toks), is_active=lambda: True,
                      registry=CollectorRegistry(), delay_s=0.0, probation_chunks=0)  # fmt: skip
    keeper.core.require_calibration = False
    keeper.core.acting = True  # the guard's calibration is the live A/B's subject, not this test's
    rig.ask("P cold (stored into L1 and L2)", p)
    keeper.start()
    try:
        keeper.on_block_stored(None, 1, len(toks) // 32, 32)
        n_chunks = len(toks) // 64
        wait_for(
            lambda: keeper.counts["applied"] + keeper.counts["skipped"] >= n_chunks, 30.0, "keeper drops"
        )
    finally:
        keeper.stop()
    assert keeper.counts["applied"] == n_chunks and keeper.counts["failed"] == 0, keeper.counts
    assert deletes == [n_chunks], deletes  # one call for the whole batch
    rig.flush_vllm()
    d = rig.ask("P after the keeper's drops", p)
    assert d["l1"] == 0 and d["l2"] == n_chunk_tokens and d["ext"] == n_chunk_tokens, d


def test_keeper_on_probation_drops_the_oldest_first_sight_chunks_and_keeps_the_newest_in_l1(rig: Rig) -> None:
    """Probation on the real layer: of a prompt's first-sight chunks, all but the ``probation_chunks``
    newest leave L1 (their L2 copies stay); the prompt's next look-up finds every chunk, the dropped ones in
    L2, none lost."""
    from kvtier.controller.l1_keeper import L1Keeper
    from tests.peers.sidecar import wait_for

    p = text(22, 150)
    toks = rig.tokens(p)
    n_chunks = len(toks) // 64
    assert n_chunks > 2
    act = LMCacheMPActuator(HttpCaller(rig.server.url, timeout_s=10.0), model_name=rig.vllm.model_path)
    keeper = L1Keeper(act, chain_tokens=lambda _h: tuple(toks), is_active=lambda: True,
                      registry=CollectorRegistry(), delay_s=0.05, probation_chunks=2)  # fmt: skip
    keeper.core.require_calibration = False
    keeper.core.acting = True
    rig.ask("Q cold (stored into L1 and L2)", p)
    keeper.start()
    try:
        keeper.on_block_stored(None, 1, len(toks) // 32, 32)
        wait_for(lambda: keeper.counts["applied"] + keeper.counts["skipped"] >= n_chunks - 2, 30.0, "drops")
    finally:
        keeper.stop()
    assert keeper.counts["applied"] == n_chunks - 2 and keeper.counts["failed"] == 0, keeper.counts
    rig.flush_vllm()
    d = rig.ask("Q after the keeper's drops", p)
    assert d["l2"] >= (n_chunks - 2) * 64 and d["l1"] + d["l2"] == n_chunks * 64, d
    assert d["ext"] == n_chunks * 64, d


def test_keeper_cold_chain_eviction_drops_the_coldest_admitted_chain_and_keeps_its_l2_copy(rig: Rig) -> None:
    """Cold-chain eviction on the real layer: with L1 (as ``/status`` counts it) over the fill line, the
    keeper drops the admitted chunks of the chain least likely continued next (here every chain comes back
    at the same age, so the older one), once their L2 copies are verified; that prompt's next look-up finds
    every chunk, in L2 -- none lost -- and the newer prompts' chunks stay in L1."""
    from kvtier.controller.l1_keeper import L1Keeper
    from tests.peers.sidecar import wait_for

    prompts = [text(31 + i, 120) for i in range(3)]
    toks = [tuple(rig.tokens(p)) for p in prompts]
    n = [len(t) // 64 for t in toks]
    act = LMCacheMPActuator(HttpCaller(rig.server.url, timeout_s=10.0), model_name=rig.vllm.model_path)
    keeper = L1Keeper(act, chain_tokens=lambda h: toks[h], is_active=lambda: True,
                      registry=CollectorRegistry(), delay_s=0.05, probation_chunks=64,
                      cold_fill=0.5)  # fmt: skip
    keeper.core.require_calibration = False
    keeper.core.acting = True
    for i, p in enumerate(prompts):
        rig.ask(f"C{i} cold (stored into L1 and L2)", p)
        keeper.on_block_stored(None, i, len(toks[i]) // 32, 32)  # first sight: on probation
    keeper.step()  # reads the layer's L1 capacity and object count from /status
    held = int(keeper.status()["guard"]["l1_reported_chunks"])
    assert held >= sum(n)  # the layer holds the three prompts (and whatever earlier tests left)
    keeper.core.cold_fill = (held - n[0] + 0.5) / keeper.core.capacity  # the line: n[0] chunks lower
    keeper.start()
    try:
        for i in (0, 1, 2):  # second sights: admitted; at prompt 1's, prompt 0's chain is the coldest
            keeper.on_block_stored(None, i, len(toks[i]) // 32, 32)
        wait_for(lambda: keeper.counts["applied"] + keeper.counts["skipped"] >= n[0], 30.0, "cold drops")
    finally:
        keeper.stop()
    assert keeper.core.cold_drops == n[0] and keeper.counts["applied"] == n[0], keeper.counts
    assert keeper.counts["failed"] == 0
    rig.flush_vllm()
    d = rig.ask("C0 after the keeper's cold drops", prompts[0])
    assert d["l1"] == 0 and d["l2"] == n[0] * 64 and d["ext"] == n[0] * 64, d
    rig.flush_vllm()
    d = rig.ask("C2 kept", prompts[2])
    assert d["l1"] == n[2] * 64, d
