"""``kvtier serve --mode active --actuator lmcache-mp`` against a REAL vLLM CPU + LMCacheMPConnector +
LMCache MP server: everything goes through the running sidecar's REST API (a subprocess, exactly as an
operator runs it).

1. A pin to ``cpu`` (``POST /v1/pins {"prompt": ...}``) keeps that prefix in LMCache's L1 under pressure: the
   loop calls the adapter's ``refresh_pins()`` every tick, so after a flood that evicts L1 many times over,
   the pinned prefix's next request is an L1 hit while a prefix stored at the same time comes from L2.
2. The loop's own moves (demote cpu->disk, promote disk->cpu, evict cpu, triggered by policy capacities)
   are ``applied`` in ``/v1/decisions`` and ``kvtier_actuations_total{layer="lmcache-mp"}``, and change
   where vLLM's next hit comes from.
3. ``/v1/status``'s per-tier view equals LMCache's and vLLM's own counters.
4. Killing the LMCache server opens the adapter's circuit breaker (status + ``kvtier_actuator_up``), the
   sidecar keeps serving, ``/readyz`` names LMCache as down; after a restart the breaker closes again
   (reset interval 1 s via ``KVTIER_ACTUATOR_OPTIONS``).

vLLM's own GPU prefix cache is emptied before each measured request with ``POST /reset_prefix_cache`` (dev
mode, ``reset_external=false``), so every hit measured is an LMCache one. All waits poll with deadlines.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import figures
from tests.cachelayers.promlines import scrape_sum
from tests.peers import vllm as vllm_peer
from tests.peers.lmcache import LMCacheMPServer
from tests.peers.procs import free_port, wait_started

pytestmark = [pytest.mark.lmcache, pytest.mark.vllm]
TOKEN = "mp-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 64
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lam", "mu"]


def text(seed: int, n: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) + str(r.randint(0, 99)) for _ in range(n))


def tiers(cpu_capacity: int) -> list[dict[str, Any]]:
    """Policy tiers: LMCache L1 (cpu) and L2 (disk); disk loads are slower, so disk -> cpu gains."""
    return [
        {"tier": "cpu", "capacity_blocks": cpu_capacity, "load_bandwidth_bytes_s": 2e10},
        {"tier": "disk", "capacity_blocks": 100_000, "load_bandwidth_bytes_s": 1e9},
    ]


def until(cond: Callable[[], Any], what: str, timeout_s: float = 60.0, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except httpx.HTTPError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)  # polling interval of a condition with a deadline
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last={last!r})")


class Stack:
    """LMCache MP server + vLLM (KV events, sha256_cbor hashes, LMCacheMPConnector) + ``kvtier serve``."""

    def __init__(self, work: Path) -> None:
        self.work = work
        # ~65 chunks of 64 tokens (64 KiB each for the tiny model): a dozen prompts evict it several times
        self.mp = LMCacheMPServer(work / "mp", l1_gb=0.004)
        self.vllm: vllm_peer.VllmServer | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "kvtier-serve.log"
        self.filler = 10_000

    def start(self) -> Stack:
        self.mp.start()
        kvt = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.mp.zmq_port,
                "lmcache.mp.mq_timeout": 30,
            },
        }
        self.vllm = vllm_peer.start(
            extra_args=["--prefix-caching-hash-algo", "sha256_cbor", "--kv-transfer-config", json.dumps(kvt)],
            num_gpu_blocks=48, workdir=self.work / "vllm",
        )  # fmt: skip
        env = dict(os.environ)
        env.update({
            "KVTIER_API_TOKEN": TOKEN, "KVTIER_SCRAPE_INTERVAL_S": "0.5",
            "KVTIER_DISCOVERY_INTERVAL_S": "0.5",
            "KVTIER_STORAGE_ENABLED": "false",
            "KVTIER_ACTUATOR_OPTIONS": json.dumps(
                {"lmcache-mp": {"breaker_reset_s": 1.0, "retries": 2, "timeout_s": 2.0}}),
            "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "VLLM_NO_USAGE_STATS": "1",
        })  # fmt: skip
        cmd = [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--engine-url",
            self.vllm.url,
            "--lmcache-url",
            self.mp.url,
            "--mode",
            "active",
            "--actuator",
            "lmcache-mp",
            # the moves under test are driven by pins and tier capacities, not a placement policy
            "--policy",
            "none",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--state-dir",
            str(self.work / "state"),
        ]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip

        def ready() -> bool:
            r = self.get("/readyz")
            return r.status_code == 200 and bool(r.json()["peers_up"])

        wait_started(ready, "kvtier serve", proc=self.proc, log=self.log, stall_s=90)
        r = self.patch_policy({
            "tick_interval_s": 0.3, "pin_retry_s": 0.5, "hysteresis_s": 0.5,
            "tiers": tiers(100_000),
        })  # fmt: skip
        assert r.status_code == 200, r.text
        return self

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("kvtier serve exited:\n" + self.log.read_text(errors="replace")[-3000:])
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.vllm is not None:
            self.vllm.cleanup()
        self.mp.stop()

    # -- kvtier's API --------------------------------------------------------------------------------------
    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=15, **kw)

    def patch_policy(self, patch: dict[str, Any]) -> httpx.Response:
        return httpx.patch(self.url + "/v1/policy", json=patch, headers=AUTH, timeout=15)

    def status(self) -> dict[str, Any]:
        r = self.get("/v1/status")
        r.raise_for_status()
        return dict(r.json())

    def decisions(self, **params: Any) -> list[dict[str, Any]]:
        return list(self.get("/v1/decisions", params={"limit": 1000, **params}).json()["decisions"])

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in self.get("/metrics", follow_redirects=True).text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            fam, _, rest = head.partition("{")
            if fam == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += float(value)
        return total

    def acts(self, action: str, outcome: str) -> float:
        """``kvtier_actuations_total{layer="lmcache-mp",action,outcome}``."""
        return self.metric("kvtier_actuations_total", layer="lmcache-mp", action=action, outcome=outcome)

    # -- vLLM / LMCache ----------------------------------------------------------------------------------
    def tokens(self, prompt: str) -> list[int]:
        assert self.vllm is not None
        r = httpx.post(self.vllm.url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30)
        return list(r.json()["tokens"])

    def complete(self, prompt: str) -> None:
        assert self.vllm is not None
        self.vllm.complete(prompt, max_tokens=1)

    def reset_gpu(self) -> None:
        """Empty vLLM's own prefix cache (not LMCache's): the next hit can only come from LMCache."""
        assert self.vllm is not None
        r = httpx.post(self.vllm.url + "/reset_prefix_cache", params={"reset_external": "false"}, timeout=30)
        assert r.status_code == 200 and r.json().get("success", True) is not False, r.text

    def counters(self) -> dict[str, float]:
        assert self.vllm is not None
        return {"l1": scrape_sum(self.mp.url, "lmcache_mp_lookup_hit_l1_tokens_total"),
                "l2": scrape_sum(self.mp.url, "lmcache_mp_lookup_hit_l2_tokens_total"),
                "ext": scrape_sum(self.vllm.url, "vllm:external_prefix_cache_hits_total"),
                "gpu": scrape_sum(self.vllm.url, "vllm:prefix_cache_hits_total")}  # fmt: skip

    def flood_l1(self, min_evicted: int = 100, max_prompts: int = 80) -> tuple[int, float]:
        """Distinct prompts until LMCache's L1 evicted ``min_evicted`` chunks (more than its whole capacity);
        returns (prompts sent, chunks evicted). LMCache evicts in a periodic loop (about once a second), not
        on write, so each prompt waits for the next loop tick: a fast host would otherwise send every prompt
        before the first eviction (the L1 then refuses the writes instead)."""

        def evicted() -> float:
            return scrape_sum(self.mp.url, "lmcache_mp_l1_evicted_chunks_total")

        def ticks() -> float:
            return scrape_sum(self.mp.url, "lmcache_mp_l1_eviction_loop_ticks_total")

        ev0, sent = evicted(), 0
        while evicted() - ev0 < min_evicted:
            assert sent < max_prompts, f"no L1 pressure after {sent} prompts: {evicted() - ev0} evicted"
            t0 = ticks()
            self.filler += 1
            self.complete(text(self.filler, 150))
            sent += 1

            def ticked(before: float = t0) -> bool:
                return ticks() > before

            until(ticked, "an L1 eviction-loop tick", 30, interval_s=0.1)
        return sent, evicted() - ev0

    def ask(self, tag: str, prompt: str) -> dict[str, float]:
        """Reset vLLM's GPU cache, send ``prompt``, return the hit-token deltas by source."""
        self.reset_gpu()
        c0 = self.counters()
        self.complete(prompt)
        c1 = self.counters()
        d = {k: c1[k] - c0[k] for k in c0}
        figures.record("LMCACHE_MP_SERVE", {"request": tag, **d})
        return d


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("lmcache_mp_serve"))
    try:
        yield s.start()
    finally:
        s.stop()


P = text(301, 80)  # pinned
Q = text(302, 80)  # unpinned, stored at the same time
M = text(304, 80)  # moved by the loop
R = text(305, 80)  # pinned across the outage


def chunk_tokens(stack: Stack, prompt: str) -> int:
    return len(stack.tokens(prompt)) // CHUNK * CHUNK


@contextlib.contextmanager
def pinned(stack: Stack, prompt: str) -> Iterator[tuple[set[str], list[dict[str, Any]]]]:
    """Pin ``prompt`` to cpu (after sending it once, so vLLM's KV events put its blocks in the index); yields
    (its block hashes, its pin decisions once every block has one). Unpins on exit and waits for the unpin, so
    the next test starts without this pin."""
    stack.complete(prompt)
    r = httpx.post(stack.url + "/v1/pins", json={"prompt": prompt, "tier": "cpu"}, headers=AUTH, timeout=30)
    assert r.status_code == 201, r.text
    pin = r.json()
    hashes = set(pin["block_hashes"])

    def decided() -> list[dict[str, Any]]:
        ds = stack.decisions(action="pin")
        return [d for d in ds if d["block_hash"] in hashes and d["outcome"] in ("applied", "skipped")]

    try:
        got = until(
            lambda: len({d["block_hash"] for d in decided()}) == len(hashes) and decided(), "pin decisions"
        )
        yield hashes, got
    finally:
        unpins = stack.acts("unpin", "applied")
        r = httpx.delete(stack.url + f"/v1/pins/{pin['id']}", headers=AUTH, timeout=15)
        assert r.status_code == 204, r.text
        until(lambda: stack.acts("unpin", "applied") > unpins, "unpin applied")


def test_pin_to_cpu_keeps_the_prefix_in_l1_under_pressure(stack: Stack) -> None:
    n_p, n_q = chunk_tokens(stack, P), chunk_tokens(stack, Q)
    assert n_p >= 4 * CHUNK and n_q >= 4 * CHUNK
    stack.complete(Q)
    with pinned(stack, P) as (hashes, got):
        applied = [d for d in got if d["outcome"] == "applied"]
        # block 0 (32 tokens) is shorter than one LMCache chunk: nothing to hold, hence skipped
        assert {d["layer"] for d in got} == {"lmcache-mp"} and len(applied) == len(hashes) - 1, got
        assert stack.acts("pin", "applied") >= len(applied)
        refresh0 = stack.acts("pin_refresh", "applied")

        sent, evicted = stack.flood_l1()
        # the loop kept re-asserting the pin meanwhile (refresh_pins every tick)
        until(lambda: stack.acts("pin_refresh", "applied") > refresh0 + 2, "pin refreshes")
        # one more tick after the flood so the last evictions are repaired too
        t = stack.status()["controller"]["tick"]
        until(lambda: stack.status()["controller"]["tick"] >= t + 2, "two more ticks")

        dp = stack.ask("P pinned to cpu, after the L1 flood", P)
        dq = stack.ask("Q unpinned, stored with P, after the flood", Q)
    figures.record("LMCACHE_MP_SERVE", {"flood_prompts": sent, "l1_evicted_chunks": evicted})
    assert dp["l1"] == n_p and dp["l2"] == 0 and dp["ext"] == n_p, dp
    assert dq["l1"] == 0 and dq["l2"] == n_q and dq["ext"] == n_q, dq


def _moves(stack: Stack, action: str, since: int) -> list[dict[str, Any]]:
    return [d for d in stack.decisions(action=action) if d["id"] > since and d["layer"] == "lmcache-mp"]


def _last_id(stack: Stack) -> int:
    ds = stack.decisions()
    return max((int(d["id"]) for d in ds), default=0)


def test_loops_own_moves_change_where_the_next_hit_comes_from(stack: Stack) -> None:
    n_m = chunk_tokens(stack, M)
    # the loop puts M's chunks in cpu itself (a pin), then lets go: they are the loop's to move
    with pinned(stack, M) as (m_hashes, _):
        pass

    def act(action: str, cpu_capacity: int) -> list[dict[str, Any]]:
        since = _last_id(stack)
        before = stack.acts(action, "applied")
        if action == "promote":
            # a block vLLM holds in GPU is not promoted into cpu: empty vLLM's cache, wait for the index
            # (vLLM publishes the AllBlocksCleared event with its next engine step: a 2-token request)
            stack.reset_gpu()
            stack.complete("hello")

            def in_gpu() -> bool:
                tiers = [stack.get(f"/v1/blocks/{h}").json().get("tiers") or [] for h in m_hashes]
                return any("gpu" in t for t in tiers)

            until(lambda: not in_gpu(), "AllBlocksCleared in the index")
        r = stack.patch_policy({"tiers": tiers(cpu_capacity)})
        assert r.status_code == 200, r.text
        try:
            got = until(lambda: [d for d in _moves(stack, action, since) if d["outcome"] == "applied"],
                        f"a loop-decided {action}")  # fmt: skip
        except AssertionError as exc:
            recent = [{k: d[k] for k in ("id", "action", "src", "tier", "outcome", "layer", "detail")}
                      for d in stack.decisions()[:15]]  # fmt: skip
            ctl = stack.status()["controller"]
            raise AssertionError(f"{exc}; last decisions: {recent}; controller: {ctl}") from exc
        t = stack.status()["controller"]["tick"]
        until(lambda: stack.status()["controller"]["tick"] >= t + 2, "the move's tick to finish")
        mine = _moves(stack, action, since)
        assert mine and {d["outcome"] for d in mine} <= {"applied", "skipped"}, mine
        n_applied = sum(1 for d in mine if d["outcome"] == "applied")
        assert stack.acts(action, "applied") - before == n_applied
        figures.record("LMCACHE_MP_SERVE", {"loop_move": action, "applied": n_applied,
                                            "skipped": len(mine) - n_applied})  # fmt: skip
        return got

    try:
        # cpu capacity 0: the loop sheds M's L1 chunks (it put them there) to disk, L2 copy verified first
        demoted = act("demote", 0)
        assert {d["tier"] for d in demoted} == {"disk"} and {d["src"] for d in demoted} == {"cpu"}
        d = stack.ask("M after the loop's demote", M)
        assert d["l2"] == n_m and d["l1"] == 0 and d["ext"] == n_m, d

        # room in cpu again: M's blocks (recently used, now on disk) are promoted back (L2 -> L1 prefetch)
        promoted = act("promote", 100_000)
        assert {d["tier"] for d in promoted} == {"cpu"} and {d["src"] for d in promoted} == {"disk"}
        d = stack.ask("M after the loop's promote", M)
        assert d["l1"] == n_m and d["l2"] == 0 and d["ext"] == n_m, d

        # cpu capacity 0 again: now a disk copy is known, so the loop evicts the L1 copy instead of demoting
        evicted = act("evict", 0)
        assert {d["src"] for d in evicted} == {"cpu"}
        d = stack.ask("M after the loop's evict from cpu", M)
        assert d["l2"] == n_m and d["l1"] == 0 and d["ext"] == n_m, d
    finally:
        assert stack.patch_policy({"tiers": tiers(100_000)}).status_code == 200


def test_status_per_tier_view_matches_lmcache_and_vllm(stack: Stack) -> None:
    # this test's own hits from every source: vLLM's GPU cache, LMCache L1, then LMCache L2 (after a flood)
    r_prompt = text(303, 120)
    stack.complete(r_prompt)
    stack.complete(r_prompt)  # vLLM's own GPU prefix cache serves the second one
    assert stack.ask("R from LMCache L1", r_prompt)["l1"] > 0
    stack.flood_l1()
    assert stack.ask("R from LMCache L2 after an L1 flood", r_prompt)["l2"] > 0
    own = stack.counters()
    assert own["gpu"] > 0 and own["l1"] > 0 and own["l2"] > 0, own
    # every external hit came from LMCache's L1 or L2; LMCache's lookup also counts the prefix vLLM's GPU
    # already held (the connector looks up the whole prompt), so the excess is bounded by the GPU hits
    assert own["ext"] <= own["l1"] + own["l2"] <= own["ext"] + own["gpu"], own

    def view() -> dict[str, Any] | None:
        st = stack.status()
        layer = next((c for c in st["cache_layers"] if c.get("kind") == "lmcache_mp"), None)
        latest = (layer or {}).get("latest")
        eng = (st["engines"][0].get("latest") or {}) if st["engines"] else {}
        if not latest or latest["hit_tokens_by_tier"] != {"cpu": own["l1"], "disk": own["l2"]}:
            return None
        if eng.get("prefix_cache_hits") != own["gpu"] or eng.get("external_prefix_cache_hits") != own["ext"]:
            return None
        return {
            "gpu": eng["prefix_cache_hits"],
            **latest["hit_tokens_by_tier"],
            "external": eng["external_prefix_cache_hits"],
        }

    got = until(view, "/v1/status per-tier hits equal to LMCache's and vLLM's counters", 30)
    figures.record("LMCACHE_MP_SERVE", {"v1_status_hit_tokens": got, "lmcache_and_vllm_own": own})

    # the same view as kvtier's own /metrics families (and /v1/status "tier_view"): hits served per tier, the
    # lookups behind the per-tier hit ratio, and the chunks LMCache holds in L1
    assert stack.vllm is not None
    queries = scrape_sum(stack.vllm.url, "vllm:prefix_cache_queries_total")
    want_hits = {"gpu": own["gpu"], "cpu": own["l1"], "disk": own["l2"], "remote": 0.0}

    def l1_objects() -> int:
        st = httpx.get(stack.mp.url + "/status", timeout=10).json()
        return sum(int(m.get("total_object_count", 0))
                   for m in st["storage_manager"]["l1_managers"].values())  # fmt: skip

    def exported() -> dict[str, Any] | None:
        hits = {t: stack.metric("kvtier_tier_hit_tokens_total", tier=t) for t in want_hits}
        lookups = stack.metric("kvtier_lookup_tokens_total")
        objects = stack.metric("kvtier_tier_objects", tier="cpu")
        tiers_st = stack.status()["tier_view"]
        if hits != want_hits or lookups != queries or objects != l1_objects() or objects <= 0:
            return None
        if tiers_st["hit_tokens"] != {k: v for k, v in want_hits.items() if k != "remote"}:
            return None
        return {
            "hit_tokens": hits,
            "lookup_tokens": lookups,
            "cpu_objects": objects,
            "cpu_used_bytes": stack.metric("kvtier_tier_used_bytes", tier="cpu"),
        }

    got_m = until(exported, "kvtier_tier_* in /metrics equal to LMCache's and vLLM's counters", 30)
    assert got_m["cpu_used_bytes"] > 0
    figures.record("LMCACHE_MP_SERVE", {"metrics_tier_view": got_m})


def test_lmcache_outage_opens_the_breaker_and_recovery_closes_it(stack: Stack) -> None:
    with pinned(stack, R):
        refresh0 = stack.acts("pin_refresh", "applied")
        until(lambda: stack.acts("pin_refresh", "applied") > refresh0, "refreshes of the new pin")
        assert stack.metric("kvtier_actuator_up", layer="lmcache-mp") == 1.0

        def breaker() -> str:
            return str(stack.status()["controller"]["actuators"][0]["health"]["breaker"])

        failed0 = stack.acts("pin_refresh", "failed")
        stack.mp.stop()  # LMCache dies mid-run
        try:
            t0 = time.monotonic()
            until(lambda: breaker() == "open", "breaker open", 60, interval_s=0.1)
            opened_s = time.monotonic() - t0
            until(
                lambda: stack.metric("kvtier_actuator_up", layer="lmcache-mp") == 0.0, "kvtier_actuator_up 0"
            )
            assert stack.get("/healthz").status_code == 200
            ready = until(lambda: (r := stack.get("/readyz")).json()["down"] and r.json(), "/readyz names it")
            # a peer outage does not take the pod out of its Service
            assert stack.get("/readyz").status_code == 200
            assert any(k.startswith("lmcache_mp:") for k in ready["down"]), ready
            st = stack.status()
            assert st["controller"]["last_tick"]["outcome"] == "ok"  # the loop keeps ticking
            assert st["controller"]["actuators"][0]["health"]["last_error"], st["controller"]["actuators"]
            failed = stack.acts("pin_refresh", "failed") - failed0
            assert failed > 0
        finally:
            stack.mp.start()  # back on the same ports with the same L2 directory
        t1 = time.monotonic()
        until(lambda: breaker() == "closed", "breaker closed after the reset interval", 60, interval_s=0.1)
        closed_s = time.monotonic() - t1
        until(lambda: stack.metric("kvtier_actuator_up", layer="lmcache-mp") == 1.0, "kvtier_actuator_up 1")
        until(lambda: stack.get("/readyz").json()["peers_up"], "/readyz peers up again")
    figures.record("LMCACHE_MP_SERVE", {"outage": {"breaker_open_after_s": round(opened_s, 2),
                                                   "breaker_closed_after_restart_s": round(closed_s, 2),
                                                   "pin_refresh_failed": failed}})  # fmt: skip
