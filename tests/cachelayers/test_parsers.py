"""Pure parsers on canned text: a /metrics + /status captured from the real LMCache MP server in this
repo's tests (tests/cachelayers/data), the Mooncake summary line from the real master, and broken input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.collectors.lmcache_controller import parse_controller
from kvtier.collectors.lmcache_mp import parse_lmcache_mp
from kvtier.collectors.mooncake import parse_mooncake, parse_summary

DATA = Path(__file__).parent / "data"


def test_lmcache_mp_sample_maps_l1_l2_to_kvtier_tiers() -> None:
    text = (DATA / "lmcache_mp_metrics.txt").read_text()
    status = json.loads((DATA / "lmcache_mp_status.json").read_text())
    s = parse_lmcache_mp(text, status, now=12.5)
    assert s.timestamp == 12.5 and s.healthy is True and s.chunk_size == 64
    assert s.used_bytes == {"cpu": 262144.0, "disk": 262144.0}
    assert s.objects == {"cpu": 4} and s.capacity_bytes["cpu"] == 0.25 * (1 << 30)
    assert s.counters["l1_write_chunks"] == 4 and s.counters["l2_store_completed_chunks"] == 4
    assert set(s.hit_tokens_by_tier) == {"cpu", "disk"} and s.families >= 15 and s.broken_blocks == 0


def test_lmcache_mp_lookup_hits_summed_over_label_sets() -> None:
    text = "\n".join(
        [
            "# TYPE lmcache_mp_lookup_hit_l1_tokens_total counter",
            'lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="/m"} 512.0',
            'lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="t",model_name="/m"} 64.0',
            "# TYPE lmcache_mp_lookup_hit_l2_tokens_total counter",
            'lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="/m"} 128.0',
            "# TYPE lmcache_mp_l1_chunk_reuse_gap_seconds histogram",
            'lmcache_mp_l1_chunk_reuse_gap_seconds_bucket{le="1.0"} 2.0',
            'lmcache_mp_l1_chunk_reuse_gap_seconds_bucket{le="+Inf"} 3.0',
            "lmcache_mp_l1_chunk_reuse_gap_seconds_count 3.0",
            "lmcache_mp_l1_chunk_reuse_gap_seconds_sum 4.5",
            "",
        ]
    )
    s = parse_lmcache_mp(text, None)
    assert s.hit_tokens_by_tier == {"cpu": 576.0, "disk": 128.0}
    assert s.reuse_gap_seconds.count == 3 and s.reuse_gap_seconds.sum == 4.5
    assert s.reuse_gap_seconds.buckets == [(1.0, 2.0), (float("inf"), 3.0)]
    assert s.healthy is None and s.objects == {}


def test_broken_text_keeps_good_families_and_counts_the_rest() -> None:
    good = (DATA / "lmcache_mp_metrics.txt").read_text()
    broken = good + "# TYPE lmcache_mp_bogus gauge\n<html>502 Bad Gateway</html>\n"
    s = parse_lmcache_mp(broken, None)
    assert s.broken_blocks == 1 and s.counters["l1_write_chunks"] == 4
    # a malformed sample of a family the collector does not read is skipped before parsing, not counted
    unread = good + "# TYPE lmcache_mp_bogus gauge\nlmcache_mp_bogus{oops 1.0 nonsense\n"
    assert parse_lmcache_mp(unread, None).broken_blocks == 0
    with pytest.raises(ValueError, match="lmcache_mp"):
        parse_lmcache_mp("garbage\n", None)


def test_mooncake_summary_and_counter_renaming() -> None:
    summary = (
        "role=leader, state=serving, service_ready=true, master={Mem Storage: 2.02 MB / 128.00 MB "
        "(1.6%) | NVMe-oF SSD: 0 B / 0 B | SSD Storage: 0 B / 0 B | Keys: 4 (soft-pinned: 1) "
        "| Clients: 2 | ...}"
    )
    sm = parse_summary(summary)
    assert (sm.role, sm.state, sm.service_ready, sm.keys, sm.soft_pinned, sm.clients) == (
        "leader",
        "serving",
        True,
        4,
        1,
        2,
    )
    text = "\n".join(
        [
            "# TYPE master_key_count gauge",
            "master_key_count 3",
            "# TYPE master_evicted_key_count counter",
            "master_evicted_key_count 7",
            "# TYPE master_create_move_task_requests_total counter",
            "master_create_move_task_requests_total 2",
            "# TYPE master_create_move_task_failures_total counter",
            "master_create_move_task_failures_total 1",
            "# TYPE master_total_capacity_bytes gauge",
            "master_total_capacity_bytes 1024",
            "# TYPE master_total_nof_capacity_bytes gauge",
            "master_total_nof_capacity_bytes 4096",
            "# TYPE master_promotion_in_flight gauge",
            "master_promotion_in_flight 1",
            "# TYPE segment_allocated_bytes gauge",
            'segment_allocated_bytes{segment="127.0.0.1:17001"} 4096',
            "",
        ]
    )
    s = parse_mooncake(text, summary)
    assert s.key_count == 3 and s.eviction == {"master_evicted_key_count": 7.0}
    assert s.rpc_requests["create_move_task"] == 2 and s.rpc_failures["create_move_task"] == 1
    assert s.capacity_bytes == {"cpu": 1024.0, "disk": 0.0, "remote": 4096.0}
    assert s.promotion == {"master_promotion_in_flight": 1.0}
    assert s.segments == {"127.0.0.1:17001": {"allocated_bytes": 4096.0}}
    assert s.summary is not None and s.summary.keys == 4
    with pytest.raises(ValueError, match="master_"):
        parse_mooncake("up 1\n")


def test_controller_bodies() -> None:
    ks = {
        "total_key_count": 2,
        "total_instance_count": 1,
        "total_worker_count": 1,
        "instances": [{"instance_id": "standalone0", "key_count": 2, "worker_count": 1}],
    }
    ws = {
        "workers": [
            {
                "instance_id": "standalone0",
                "worker_id": 0,
                "ip": "127.0.0.1",
                "port": 9601,
                "last_heartbeat_time": 100.0,
                "key_count": 2,
            }
        ],
        "total_count": 1,
    }
    s = parse_controller(ks, ws, now=110.0)
    assert s.total_key_count == 2 and s.keys_by_instance == {"standalone0": 2}
    assert s.workers[0].port == 9601 and s.workers[0].heartbeat_age_s == 10.0
    with pytest.raises(ValueError):
        parse_controller({"detail": "err"}, None)


def test_scrape_get_retries_once_on_a_stale_keepalive_connection() -> None:
    """MockTransport: a peer closing an idle pooled connection is a race we cannot provoke on demand."""
    import asyncio

    import httpx
    from prometheus_client import CollectorRegistry

    from kvtier.collectors.lmcache_mp import LMCacheMPCollector

    calls = {"n": 0}

    def handler(r: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, text="ok")

    async def go() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            col = LMCacheMPCollector("mp", "http://peer", client=c, registry=CollectorRegistry())
            return (await col.get("/metrics")).text

    assert asyncio.run(go()) == "ok" and calls["n"] == 2


def test_lmcache_mp_parses_only_the_samples_it_reads_and_gets_the_same_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector parses only the sample lines it reads (every scrape, on the engine's host). On a real
    end-of-run scrape of LMCache MP 0.5.6 (277 lines) its sample equals the one a whole parse gives, so no
    read name is missing from ``READ_SAMPLES``, and most sample lines are skipped."""
    import kvtier.collectors.lmcache_mp as mp
    from kvtier.collectors.promtext import parse_families

    text = (DATA / "lmcache_mp_metrics_live.txt").read_text()
    status = json.loads((DATA / "lmcache_mp_status.json").read_text())
    reduced = parse_lmcache_mp(text, status)
    assert reduced.counters["l1_write_chunks"] > 0 and reduced.reuse_gap_seconds.count > 0
    monkeypatch.setattr(mp, "parse_families", lambda t, keep=None: parse_families(t))
    assert parse_lmcache_mp(text, status) == reduced
    whole, kept = parse_families(text), parse_families(text, keep=mp.READ_SAMPLES)
    assert kept.types == whole.types
    assert sum(map(len, kept.samples.values())) < sum(map(len, whole.samples.values())) / 2


def test_keeper_reads_lmcache_l1_hits_from_a_real_scrape_and_its_lazy_absence() -> None:
    """The keeper's guard reads one counter every period: on a real scrape it is what the collector reads;
    before LMCache's first look-up the family is absent (0 hits); a text with no lmcache_mp_ family is not
    LMCache at all (None); a broken line elsewhere does not hide the counter, a broken counter line makes
    the reading unknown (None: the guard skips the period) rather than 0 (which it would take for a reset)."""
    from kvtier.controller.l1_keeper import l1_hit_tokens

    text = (DATA / "lmcache_mp_metrics_live.txt").read_text()
    hits = l1_hit_tokens(text)
    assert hits is not None and hits > 0 and hits == parse_lmcache_mp(text, None).hit_tokens_by_tier["cpu"]
    lazy = "".join(line for line in text.splitlines(keepends=True) if "lookup_hit_l1_tokens" not in line)
    assert l1_hit_tokens(lazy) == 0.0
    assert l1_hit_tokens("# TYPE vllm:x counter\nvllm:x_total 1\n") is None
    assert l1_hit_tokens(text + "<html>502</html>\n") == hits
    broken = text.replace("lmcache_mp_lookup_hit_l1_tokens_total{", "lmcache_mp_lookup_hit_l1_tokens_total{{")
    assert broken != text and l1_hit_tokens(broken) is None  # unknown, not a counter reset to 0
