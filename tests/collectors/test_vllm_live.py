"""Against a REAL vLLM (CPU build, tiny model, prefix caching + ZMQ KV events): the sidecar's counts, index,
hit ratio, garbage handling and kill/restart behaviour. One vLLM server for the module.

The independent subscriber is vLLM's own replay ROUTER (a DEALER asking for every buffered batch from seq 0,
decoded with plain untyped msgpack): vLLM's PUB connects to the one address the sidecar binds, so a second
SUB cannot attach to the same stream, but the replay buffer holds exactly the batches that were published.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvtier.collectors.promtext import parse_families
from kvtier.controller.settings import Settings
from tests.peers import sidecar as sidecar_peer
from tests.peers import vllm as vllm_peer
from tests.peers.sidecar import wait_for

pytestmark = pytest.mark.vllm

SHARED = "the quick brown fox jumps over the lazy dog and the cache block stores every token " * 6


def distinct(j: int) -> str:
    return " ".join(f"w{j}x{k}" for k in range(120))  # ~700 tokens: 22 blocks of 32


def independent_counts(srv: vllm_peer.VllmServer) -> tuple[Counter[str], int, int, int]:
    """Replay every buffered batch from seq 0: (events by type, stored hashes, removed hashes, batches)."""
    assert srv.replay_endpoint
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(srv.replay_endpoint)
    s.send_multipart([b"", (0).to_bytes(8, "big")])
    kinds: Counter[str] = Counter()
    stored = removed = batches = 0
    try:
        while True:
            if not s.poll(10_000):
                raise TimeoutError("replay did not end")
            parts = s.recv_multipart()[1:]
            if parts[1] == b"\xff" * 8:
                break
            batches += 1
            for e in msgspec.msgpack.decode(parts[2])[1]:
                kinds[e["type"]] += 1
                if e["type"] == "BlockStored":
                    stored += len(e["block_hashes"])
                elif e["type"] == "BlockRemoved":
                    removed += len(e["block_hashes"])
    finally:
        s.close()
        ctx.term()
    return kinds, stored, removed, batches


def vllm_ratio(srv: vllm_peer.VllmServer) -> float:
    p = parse_families(srv.metrics_text())
    h = p.get("vllm:prefix_cache_hits_total")[0].value
    q = p.get("vllm:prefix_cache_queries_total")[0].value
    return float(h / q)


def events_of(st: dict[str, Any], engine: str) -> dict[str, int]:
    return dict(st["kv_events_received_by_engine"].get(engine, {}))


@pytest.fixture(scope="module")
def srv() -> Iterator[vllm_peer.VllmServer]:
    with vllm_peer.running(num_gpu_blocks=64) as s:
        yield s


@pytest.fixture(scope="module")
def side(srv: vllm_peer.VllmServer) -> Iterator[sidecar_peer.SidecarThread]:
    settings = Settings.model_validate(
        dict(engine_urls=[srv.url], scrape_interval_s=0.5, discovery_interval_s=0.5, storage_interval_s=1.0)
    )
    with sidecar_peer.running(settings) as sc:
        wait_for(lambda: sc.get("/readyz").json()["peers_up"], 60, "sidecar ready, peers up")
        yield sc


def _engine(srv: vllm_peer.VllmServer) -> str:
    return f"127.0.0.1:{srv.port}"


def _matches(side: sidecar_peer.SidecarThread, srv: vllm_peer.VllmServer) -> Any:
    kinds, stored, removed, batches = independent_counts(srv)
    st = side.status()
    got = {k: v for k, v in events_of(st, _engine(srv)).items() if v}
    return (got == dict(kinds), st, kinds, stored, removed)


def test_counts_index_ratio_match_vllm(srv: vllm_peer.VllmServer, side: sidecar_peer.SidecarThread) -> None:
    for i in range(3):
        srv.complete(SHARED + f" question {i}", max_tokens=2)
    for j in range(4):  # 4 x 22 blocks > 64: forces evictions
        srv.complete(distinct(j), max_tokens=2)
    res = wait_for(lambda: (r := _matches(side, srv))[0] and r, 60, "sidecar event counts == independent")
    _, st, kinds, stored, removed = res
    assert kinds["BlockRemoved"] > 0, "the scenario must force evictions"
    assert st["kv_events_lost"] == 0
    assert st["blocks_tracked"]["gpu"] == stored - removed
    assert st["kv_events_received"] == sum(kinds.values())
    # hit ratio in /v1/status equals vLLM's own counters (no requests in between; wait for a fresh scrape)
    want = vllm_ratio(srv)
    assert 0 < want < 1
    ratio = wait_for(lambda: (x := side.status()["engines"][0]["prefix_cache_hit_ratio"]) == want and x, 30,
                     "sidecar hit ratio == vLLM's")  # fmt: skip
    assert ratio == pytest.approx(want, abs=0)
    # /metrics exposes the same figures
    m = parse_families(side.get("/metrics").text)
    by = {(s.labels.get("engine"), s.labels.get("type")): s.value for s in m.get("kvtier_kv_events_total")}
    assert by[(_engine(srv), "BlockRemoved")] == kinds["BlockRemoved"]
    gpu = [s.value for s in m.get("kvtier_blocks_tracked") if s.labels["tier"] == "gpu"]
    assert gpu == [stored - removed]
    assert [s.value for s in m.get("kvtier_kv_events_lost_total")] == [0.0]


def test_full_report_mode_hits_are_accesses(
    srv: vllm_peer.VllmServer, side: sidecar_peer.SidecarThread
) -> None:
    before = side.status()["engines"][0]["blocks"]
    srv.complete(SHARED + " again", max_tokens=2)  # make sure the prefix is cached
    srv.complete(SHARED + " and again", max_tokens=2, vllm_xargs={"kv_cache_report_mode": "full"})
    after = wait_for(lambda: (b := side.status()["engines"][0]["blocks"])["reannounced"] > before["reannounced"]  # noqa: E501
                     and b, 30, "hit reports counted as re-announcements")  # fmt: skip
    assert after["accesses_inferred"] > before["accesses_inferred"]
    res = wait_for(lambda: (r := _matches(side, srv))[0] and r, 30, "counts equal after hit reports")
    _, st, _, stored, removed = res
    # re-announced hashes are accesses, not new residents
    assert st["blocks_tracked"]["gpu"] == stored - removed - after["reannounced"]


def test_all_blocks_cleared(srv: vllm_peer.VllmServer, side: sidecar_peer.SidecarThread) -> None:
    assert httpx.post(srv.url + "/reset_prefix_cache", timeout=30).status_code == 200
    srv.complete(
        "a short prompt after the reset " * 4, max_tokens=2
    )  # the clear is published with the next step
    st = wait_for(lambda: (s := side.status())["kv_events_received_by_engine"][_engine(srv)]["AllBlocksCleared"]  # noqa: E501
                  and s, 30, "AllBlocksCleared received")  # fmt: skip
    kinds, *_ = independent_counts(srv)
    assert kinds["AllBlocksCleared"] == 1
    held = st["engines"][0]["blocks_held"]["gpu"]
    assert st["blocks_tracked"]["gpu"] == held
    assert held <= 3  # only the blocks of the request after the reset


def test_garbage_counted_and_later_events_processed(
    srv: vllm_peer.VllmServer, side: sidecar_peer.SidecarThread
) -> None:
    def errors() -> float:
        m = parse_families(side.get("/metrics").text)
        return sum(s.value for s in m.get("kvtier_collector_errors_total")
                   if s.labels["collector"].startswith("vllm_kv_events"))  # fmt: skip

    e0 = errors()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(srv.kv_endpoint)  # the sidecar's bound SUB accepts any publisher
    garbage = [
        [b"kv-events", b"\x00" * 8],  # 2 frames
        [b"kv-events", b"\x01\x02", b"\x93"],  # short seq frame
        [b"kv-events", (10**6).to_bytes(8, "big"), b"\xdc\x00\x05\x01"],  # truncated msgpack
        [b"kv-events", (10**6).to_bytes(8, "big"), msgspec.msgpack.encode({"not": "a batch"})],  # wrong type
        [b"kv-events", (10**6).to_bytes(8, "big"), b"\xc1"],  # reserved byte
    ]
    try:
        # the PUB connects asynchronously: resend until the sidecar has counted all five (poll, no sleep)
        def sent_and_counted() -> bool:
            for g in garbage:
                pub.send_multipart(g)
            return errors() >= e0 + len(garbage)

        wait_for(sent_and_counted, 30, "garbage frames counted")
    finally:
        pub.close(linger=0)
        ctx.term()
    assert side.get("/healthz").status_code == 200
    srv.complete(SHARED + " after garbage", max_tokens=2)
    res = wait_for(lambda: (r := _matches(side, srv))[0] and r, 30, "good events still processed")
    assert res[1]["kv_events_lost"] == 0


def test_broken_metrics_text_counted() -> None:
    """Unit level (pure parser; a real vLLM never serves broken text): broken blocks are skipped and counted."""  # noqa: E501
    from prometheus_client import CollectorRegistry

    from kvtier.collectors.vllm_metrics import VllmMetricsCollector

    reg = CollectorRegistry()
    c = VllmMetricsCollector("vllm_metrics:x", "http://127.0.0.1:1", client=httpx.AsyncClient(), registry=reg)
    text = (
        '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0",model_name="m"} 3\n'
        '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine="0",model_name="m"} 4\n'  # noqa: E501
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0" 0.5 oops\n'
    )
    obs = c.parse(text, 1.0)
    assert obs.broken_blocks == 1
    assert obs.engines[0].prefix_cache_hit_ratio == 0.75
    assert reg.get_sample_value("kvtier_collector_errors_total", {"collector": "vllm_metrics:x"}) == 1.0


def vllm_counter(srv: vllm_peer.VllmServer, name: str) -> float:
    return float(sum(x.value for x in parse_families(srv.metrics_text()).get(name)))


def test_kill_and_restart(srv: vllm_peer.VllmServer, side: sidecar_peer.SidecarThread) -> None:
    srv.complete(SHARED + " before the crash", max_tokens=2)
    # baseline: the sidecar has counted every event of the old process (== its replay buffer)
    _, st0, *_ = wait_for(lambda: (r := _matches(side, srv))[0] and r, 30, "counts equal before the crash")
    assert st0["blocks_tracked"]["gpu"] > 0
    base = events_of(st0, _engine(srv))
    eng0 = st0["engines"][0]
    restarts0, start0 = eng0["kv_events"]["sources"][0]["restarts"], eng0["process_start_time"]
    prompt0 = eng0["latest"]["prompt_tokens_total"]
    assert start0 is not None and prompt0 > 0
    srv.kill()
    r = wait_for(
        lambda: (x := side.get("/readyz")).json()["down"] and x, 30, "/readyz reports the engine down"
    )
    assert r.status_code == 200  # the sidecar itself stays ready: a peer down does not gate the pod
    down = r.json()["down"]
    assert any(_engine(srv) in name for name in down), down
    assert side.get("/healthz").status_code == 200
    assert side.get("/v1/status").status_code == 200  # keeps serving
    srv.launch()
    srv.wait_ready()
    wait_for(lambda: side.get("/readyz").json()["peers_up"], 60, "/readyz peers up again")
    # the restart is noticed (new process start time) and the dead process's blocks are dropped
    st = wait_for(lambda: (s := side.status())["engines"][0]["kv_events"]["sources"][0]["restarts"] > restarts0  # noqa: E501
                  and s, 30, "restart handled")  # fmt: skip
    assert st["engines"][0]["process_start_time"] > start0  # the engine sample's new process
    _, stored_new, removed_new, _ = independent_counts(srv)  # the new process (no requests yet)
    assert st["blocks_tracked"]["gpu"] == stored_new - removed_new  # the dead process's blocks were dropped
    assert st["engines"][0]["blocks"]["cleared"] > 0
    for i in range(2):
        srv.complete(SHARED + f" after the restart {i}", max_tokens=2)
    srv.complete(distinct(7), max_tokens=2)

    def since_restart() -> Any:
        """(sidecar's events since the baseline == the new process's, status, kinds, stored, removed)."""
        kinds, stored, removed, _ = independent_counts(srv)
        st = side.status()
        got = {k: n - base.get(k, 0) for k, n in events_of(st, _engine(srv)).items() if n - base.get(k, 0)}
        ok = got == dict(kinds) and st["blocks_tracked"]["gpu"] == stored - removed
        return (ok, st, kinds, stored, removed)

    _, st, kinds, stored, removed = wait_for(lambda: (r := since_restart())[0] and r, 60,
                                             "event counts and index == the new process's")  # fmt: skip
    assert kinds["BlockStored"] > 0 and stored > 0
    assert st["kv_events_lost"] == 0
    assert st["engines"][0]["kv_events"]["sources"][0]["held_seq"] is None
    # counters reset: the engine sample holds the new process's own counters (smaller than before the crash)
    want_prompt = vllm_counter(srv, "vllm:prompt_tokens_total")
    assert 0 < want_prompt < prompt0
    wait_for(lambda: side.status()["engines"][0]["latest"]["prompt_tokens_total"] == want_prompt, 30,
             "prompt tokens after restart")  # fmt: skip
    want = vllm_ratio(srv)
    wait_for(lambda: side.status()["engines"][0]["prefix_cache_hit_ratio"] == want, 30, "ratio after restart")
