"""LMCache MP L1 keeper: second-sight admission acted out chunk by chunk, behind a counterfactual guard.

Fed every ``BlockStored`` event's chain (through the token store), it maps the event's newly completed
vLLM blocks to LMCache chunk keys (LMCache's chunk hash over the whole token prefix, model *path*, kv_rank),
asks :class:`~kvtier.policies.l1_admission.AdmissionCore` which to drop -- first-sight chunks whose
probation (``probation_chunks`` newer first-sight chunks) ended before they were seen again, or with
probation 0 every first-sight chunk ``delay_s`` after its store -- and, in active mode while the guard lets
it, drops exactly those chunks from L1 (``DELETE /cache/objects`` tier ``l1``, each chunk by its own key --
never a prefix, so shared ancestors stay; the chunks due together go in one call) once their L2 copy is
verified (never the last copy; an unverified one is checked again every ``delay_s``). A chunk whose L2 copy
has not appeared after ``verify_deadline_s`` is left alone (counted ``skipped``). When a dropped chunk is
looked up again (its second sight), LMCache serves it from L2 through a temporary L1 copy it frees after the
read; so the keeper admits it itself: one ``POST /cache/prefetches`` (L2 -> L1) of the prefix through that
chunk, off the request path (counted ``l1_readmit``); with ``readmit_by_gap`` only when the core says chunks
back after as many requests are worth the room (the others counted ``readmit_declined``; on by default). With
``cold_fill`` (off by default) the core also names the admitted chunks of the chains least likely continued
next while its model of L1 is fuller than that share of capacity -- counted from the L1 object count
``/status`` last reported, moved by the keeper's own stores and drops since (cold-chain eviction, see
:mod:`kvtier.policies.l1_admission`); they go the same way as the probation drops (L2 copy verified, one
``DELETE`` per batch, readmitted at their next sight).

What the layer can and cannot tell (reported in ``status()``): L2 residency per key is verified (``fs``
files); L1 residency per key is not observable (LMCache MP exposes counts only), so the keeper never
assumes a chunk is in L1 -- a delete that finds nothing is counted ``skipped``, one that L1 refuses because
the chunk is locked (its L2 write or a read still under way) is sent again ``delay_s`` later until
``verify_deadline_s`` (counted ``locked`` per refusal), and the L1 capacity used by the counterfactual is the
largest L1 object count ``/status`` reported.

Work happens on one worker thread (never inside the reconcile tick). Outcomes go to
``kvtier_actuations_total{layer="lmcache-mp", action="l1_admission"}``; the guard exports
``kvtier_guard_trips_total``, ``kvtier_guard_resumes_total``, ``kvtier_guard_windows_total{verdict}`` and
``kvtier_guard_acting`` (1 = acting, 0 = held in shadow); refusals of locked chunks go to
``kvtier_l1_keeper_locked_refusals_total``.

With ``engine_ttft`` (vLLM's cumulative TTFT histogram ``_sum`` / ``_count``, read once per measurement
period) a second guard judges the cost the operator sees: :class:`~kvtier.policies.latency_guard.LatencyGuard`
runs a switchback experiment (blocks of periods acting, then periods held in shadow as a control) and holds
the keeper in shadow while acting costs TTFT beyond its margin (95 % interval); it exports
``kvtier_guard_latency_acting`` (1 = this period acts), ``kvtier_guard_latency_trips_total``,
``kvtier_guard_latency_resumes_total`` and ``kvtier_guard_latency_periods_total{why}``. The keeper acts
only when both guards let it.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvtier.collectors.promtext import parse_families
from kvtier.controller.actuators.base import BlockRef, Outcome
from kvtier.controller.actuators.lmcache_keys import ObjectKey, object_keys
from kvtier.controller.actuators.lmcache_mp import LMCacheMPActuator
from kvtier.policies.l1_admission import AdmissionCore
from kvtier.policies.latency_guard import LatencyGuard

log = logging.getLogger(__name__)


class GuardMetrics:
    """``kvtier_guard_*`` families (one set per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.trips = Counter("kvtier_guard_trips", "Guard fell back to shadow (acting was net harmful).",
                             registry=registry)  # fmt: skip
        self.resumes = Counter("kvtier_guard_resumes", "Guard resumed acting (the counterfactual pays).",
                               registry=registry)  # fmt: skip
        self.windows = Counter("kvtier_guard_windows", "Guard windows closed, by verdict.", ["verdict"],
                               registry=registry)  # fmt: skip
        self.acting = Gauge("kvtier_guard_acting", "1 while the guard lets the sidecar act, 0 in shadow.",
                            registry=registry)  # fmt: skip
        self.net = Gauge("kvtier_guard_last_window_net_hit_chunks",
                         "Simulated L1 hits of admission minus the layer default, last window, chunks.",
                         registry=registry)  # fmt: skip
        self.periods = Counter("kvtier_guard_measured_periods",
                               "Periods judged on the layer's own L1-hit counter, by verdict.", ["verdict"],
                               registry=registry)  # fmt: skip
        self.lat_acting = Gauge("kvtier_guard_latency_acting",
                                "1 while the latency guard's current period acts, 0 while it holds.",
                                registry=registry)  # fmt: skip
        self.lat_trips = Counter("kvtier_guard_latency_trips",
                                 "Latency guard held the sidecar in shadow (acting cost TTFT).",
                                 registry=registry)  # fmt: skip
        self.lat_resumes = Counter("kvtier_guard_latency_resumes",
                                   "Latency guard let the sidecar act again (acting stopped costing TTFT).",
                                   registry=registry)  # fmt: skip
        self.lat_periods = Counter("kvtier_guard_latency_periods",
                                   "Latency guard periods closed, by how they counted.", ["why"],
                                   registry=registry)  # fmt: skip
        self.k = Gauge("kvtier_guard_calibration_ratio",
                       "Real L1 hits per simulated default L1 hit, from periods the layer ran its default.",
                       registry=registry)  # fmt: skip


@dataclass(frozen=True)
class _LockedRetry:
    """A ``DELETE`` batch to send again: ``locked`` of its ``keys`` were locked in L1 at the last try."""

    keys: tuple[ObjectKey, ...]
    locked: int


_Due = ObjectKey | tuple[int, ...] | _LockedRetry  # a drop, a readmission (token prefix), a retry


class L1Keeper:
    """See module doc. ``is_active`` says whether the sidecar's mode is ``active``."""

    def __init__(
        self,
        actuator: LMCacheMPActuator,
        *,
        chain_tokens: Callable[[int], tuple[int, ...] | None],
        is_active: Callable[[], bool],
        registry: CollectorRegistry,
        record: Callable[[str, int], None] = lambda outcome, n: None,
        capacity_chunks: int = 256,
        window: int = 512,
        delay_s: float = 0.5,
        probation_chunks: int = 32,
        cold_fill: float | None = None,
        readmit_by_gap: bool = True,
        verify_deadline_s: float = 15.0,
        max_batch: int = 256,
        status_every_s: float = 2.0,
        measure_every_s: float = 10.0,
        engine_ttft: Callable[[], tuple[float, float] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.act = actuator
        self.chain_tokens = chain_tokens
        self.is_active = is_active
        self.record = record
        self.core = AdmissionCore(
            capacity_chunks,
            window=window,
            require_calibration=True,
            probation=probation_chunks,
            cold_fill=cold_fill,
            readmit_by_gap=readmit_by_gap,
        )
        self._core_lock = threading.Lock()  # observe (ingest thread) vs measure (worker)
        self.metrics = GuardMetrics(registry)
        self.locked_refusals = Counter(
            "kvtier_l1_keeper_locked_refusals",
            "L1 drops LMCache refused because the chunk was locked (one per refusal; the batch goes again).",
            registry=registry,
        )
        self.metrics.acting.set(1)
        self.engine_ttft = engine_ttft
        self.latency = LatencyGuard() if engine_ttft is not None else None
        self.metrics.lat_acting.set(1)
        self.delay_s = delay_s
        self.verify_deadline_s = verify_deadline_s
        self.max_batch = max_batch  # due items handled per worker step (one DELETE for their drops)
        self.status_every_s = status_every_s
        self.measure_every_s = measure_every_s
        self._next_measure = 0.0
        self.clock = clock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        # (due, seq, give-up time, chunk key to drop | token prefix to load into L1 | batch to send again)
        self._due: list[tuple[float, int, float, _Due]] = []
        self._seq = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._next_status = 0.0
        self._max_objects = 0
        self._dropped: OrderedDict[str, None] = OrderedDict()  # chunks we dropped from L1 (bounded)
        self._dropped_max = 1 << 18
        self._last_hash: int | None = None  # last block of the previous event
        self._synced = (0, 0, 0)  # core trips, resumes, windows already exported
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "applied",
                "skipped",
                "failed",
                "locked",
                "would_drop",
                "unmapped_events",
                "readmitted",
                "readmit_failed",
                "readmit_declined",
                "measure_failed",
                "held_by_latency_guard",
            ),
            0,
        )

    # ---- ingest (ingest thread) ------------------------------------------------------------------
    def on_block_stored(self, parent: int | None, last_hash: int, n_blocks: int, block_size: int) -> None:
        """The chain ending at ``last_hash`` just gained ``n_blocks`` blocks of ``block_size`` tokens.

        A request's look-up at the layer covers its whole prompt, GPU-cached prefix included, so the access
        the counterfactual sees is every chunk of the chain -- unless this event continues the previous
        one (``parent`` = its last block: the same request's prefill in pieces), then only the new chunks.
        Only new chunks (stored by this event) are candidates to drop."""
        toks = self.chain_tokens(last_hash)
        if not toks:
            self.counts["unmapped_events"] += 1
            return
        try:
            cs = self.act.chunk_size()
        except Exception:  # noqa: BLE001 - layer unreachable: nothing to map now
            self.counts["unmapped_events"] += 1
            return
        continues = parent is not None and parent == self._last_hash
        self._last_hash = last_hash
        start = max(0, len(toks) - n_blocks * block_size)
        first_new = start // cs  # chunks ending after ``start`` are new (or completed now)
        keys = object_keys(self.act.model_name, toks, cs)
        if first_new >= len(keys):
            return
        accessed = keys[first_new:] if continues else keys
        with self._core_lock:  # only this store's chunks may be dropped; with probation, earlier stores' too
            picked = self.core.observe(accessed, droppable=set(keys[first_new:]), continues=continues)
            todo = [k for k in picked if isinstance(k, ObjectKey)]
            self._sync_guard()
            # second sight of a chunk we dropped: LMCache serves it from L2 through a temporary L1 copy that
            # it frees after the read, so admission means loading the prefix into L1 ourselves -- if the
            # core says a chunk back after its gap is worth the room (with ``readmit_by_gap``)
            back = [i for i, k in enumerate(accessed) if k.chunk_hash_hex in self._dropped]
            worth = [i for i in back if self.core.readmit_pays(accessed[i])]
        if not todo and not back:
            return
        if not self.is_active():
            self.counts["would_drop"] += len(todo)
            return
        if not self._latency_acts():
            self.counts["held_by_latency_guard"] += len(todo)
            return
        now = self.clock()
        due = now if self.core.probation else now + self.delay_s  # probation already gave L2 its time
        with self._cv:
            for k in todo:
                self._seq += 1
                heapq.heappush(self._due, (due, self._seq, now + self.verify_deadline_s, k))
            if back and self.core.acting:
                for i in back:
                    self._dropped.pop(accessed[i].chunk_hash_hex, None)
                self._count("readmit_declined", "l1_readmit", len(back) - len(worth))
            if worth and self.core.acting:
                last = worth[-1] + (len(keys) - len(accessed))  # index in ``keys``
                self._seq += 1
                heapq.heappush(
                    self._due, (now, self._seq, now + self.verify_deadline_s, toks[: (last + 1) * cs])
                )
            self._cv.notify()

    def _sync_guard(self) -> None:
        c, m = self.core, self.metrics
        if c.trips > self._synced[0]:
            m.trips.inc(c.trips - self._synced[0])
            log.warning("guard: second-sight admission lost to the layer's default over a window; shadow")
        if c.resumes > self._synced[1]:
            m.resumes.inc(c.resumes - self._synced[1])
            log.warning("guard: second-sight admission would pay again; acting")
        for w in c.windows[len(c.windows) - (c.windows_closed - self._synced[2]) :]:
            m.windows.labels(verdict=w.verdict).inc()
        self._synced = (c.trips, c.resumes, c.windows_closed)
        m.acting.set(1 if c.acting else 0)
        if c.windows:
            w = c.windows[-1]
            m.net.set(w.admission_hits - w.default_hits)

    # ---- worker ----------------------------------------------------------------------------------
    def start(self) -> L1Keeper:
        self._thread = threading.Thread(target=self._run, name="kvtier-l1-keeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if isinstance(self.engine_ttft, EngineTtftReader):
            self.engine_ttft.close()

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                items = self._pop_due()
                if not items:
                    now = self.clock()
                    wait = min(
                        self._due[0][0] - now if self._due else self.status_every_s, self.status_every_s
                    )
                    self._cv.wait(timeout=max(wait, 0.01))
            self.step(items)

    def _pop_due(self) -> list[tuple[float, int, float, _Due]]:
        """Up to ``max_batch`` items due at ``clock()`` (caller holds ``_cv``)."""
        now = self.clock()
        items: list[tuple[float, int, float, _Due]] = []
        while self._due and self._due[0][0] <= now and len(items) < self.max_batch:
            items.append(heapq.heappop(self._due))
        return items

    def run_due(self) -> None:
        """One worker step over what is due at ``clock()``, on the caller's thread (a test with an injected
        clock drives the keeper this way instead of starting the worker)."""
        with self._cv:
            items = self._pop_due()
        self.step(items)

    def step(self, items: Sequence[tuple[float, int, float, _Due]] = ()) -> None:
        """One worker step at ``clock()``: the layer's capacity and the guards' periods when due, then the due
        ``items``. Each part survives the others' failures (a bad ``/status`` reply must not stop the guards).
        The worker thread calls it; so can a test with an injected clock."""
        for part in (self._refresh_capacity, self._measure, lambda: self._handle(items) if items else None):
            try:
                part()
            except Exception:  # noqa: BLE001 - the worker must survive a bad reply
                log.exception("l1 keeper: step failed")

    def _refresh_capacity(self) -> None:
        now = self.clock()
        if now < self._next_status:
            return
        self._next_status = now + self.status_every_s
        st = self.act.server_status()  # the same adapter: the same breaker
        l1s = [
            m
            for m in ((st.get("storage_manager") or {}).get("l1_managers") or {}).values()
            if isinstance(m, dict)
        ]
        n = sum(int(m.get("total_object_count", 0)) for m in l1s)
        used = sum(float(m.get("memory_used_bytes", 0)) for m in l1s)
        total = sum(float(m.get("memory_total_bytes", 0)) for m in l1s)
        # capacity in chunks: what the layer has held at most, or its byte capacity over the bytes per chunk
        # (our own drops keep the object count low, so the count alone would under-estimate it)
        est = int(total / (used / n)) if n > 0 and used > 0 else 0
        cap = max(self._max_objects, n, est)
        with self._core_lock:  # the ingest thread's observe reads both
            if cap > 0 and cap != self.core.capacity:
                self._max_objects = max(self._max_objects, n)
                self.core.set_capacity(cap)
            if l1s:
                self.core.set_occupancy(n)  # cold-chain eviction counts from the layer's own count

    def _measure(self) -> None:
        """Every ``measure_every_s``: close a guard period at LMCache's own L1-hit counter (see the core),
        then the latency guard's at vLLM's TTFT histogram."""
        now = self.clock()
        if now < self._next_measure:
            return
        self._next_measure = now + self.measure_every_s
        try:
            self._measure_l1()
        finally:
            self._measure_latency()

    def _measure_latency(self) -> None:
        if self.latency is None or self.engine_ttft is None:
            return
        try:
            ttft = self.engine_ttft()
        except Exception:  # noqa: BLE001 - engine unreachable: this period is not judged
            ttft = None
        if ttft is None:
            self.counts["measure_failed"] += 1
            return
        g, m = self.latency, self.metrics
        trips, resumes = g.trips, g.resumes
        p = g.close(*ttft)
        m.lat_periods.labels(why=p.why).inc()
        if g.trips > trips:
            m.lat_trips.inc(g.trips - trips)
            log.warning("guard: acting cost TTFT (%s s, 95 %% interval); shadow, probing", g.last_interval_s)
        if g.resumes > resumes:
            m.lat_resumes.inc(g.resumes - resumes)
            log.warning("guard: acting no longer costs TTFT (%s s); acting", g.last_interval_s)
        m.lat_acting.set(1 if g.acts_now() else 0)

    def _measure_l1(self) -> None:
        try:
            reply, _ = self.act.caller.request("GET", "/metrics")
            tokens = l1_hit_tokens(reply.body if reply.status == 200 and isinstance(reply.body, str) else "")
            chunks = tokens / self.act.chunk_size() if tokens is not None else None
        except Exception:  # noqa: BLE001 - layer unreachable: this period is not judged
            chunks = None
        if chunks is None:
            self.counts["measure_failed"] += 1
            return
        with self._core_lock:  # the period just closed let the keeper act iff both were on
            verdict = self.core.measure(chunks, layer_active=self.is_active() and self._latency_acts())
            self.metrics.periods.labels(verdict=verdict).inc()
            if self.core.k is not None:
                self.metrics.k.set(self.core.k)
            if verdict == "harmful":
                log.warning("guard: LMCache's L1 hits fell below the default's (measured); shadow")
            elif verdict == "calibrated" and not self.core.acting and self.core.trips > self._synced[0]:
                log.warning("guard: calibrated, but the simulated L1s say admission loses here; shadow")
            self._sync_guard()

    def _handle(self, items: Sequence[tuple[float, int, float, _Due]]) -> None:
        """Readmissions one by one; the due drops whose L2 copy is verified in one ``DELETE`` (one round trip
        per batch instead of per chunk: each call costs the layer's HTTP server CPU the engine shares); a
        batch some of whose keys L1 refused as locked is sent again ``delay_s`` later (see ``_delete``)."""
        v = self.act.verifier()
        drops: list[ObjectKey] = []
        for _, _, give_up, key in items:
            if isinstance(key, tuple):
                self._readmit(key)
            elif isinstance(key, _LockedRetry):
                self._retry_locked(key, give_up)
            elif v is not None and v.has_copy(key):
                drops.append(key)
            elif v is not None and self.clock() < give_up:
                self._push(self.clock() + self.delay_s, give_up, key)
            else:
                self._count("skipped")
        if drops:
            self._delete(drops, give_up=max(g for _, _, g, _ in items))

    def _push(self, due: float, give_up: float, item: _Due) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._due, (due, self._seq, give_up, item))
            self._cv.notify()

    def _delete(self, drops: list[ObjectKey], *, give_up: float) -> None:
        """One ``DELETE`` tier ``l1`` of ``drops`` (first attempt). LMCache refuses a key that is read- or
        write-locked -- a chunk whose L2 write or a look-up's read is still under way -- and replies with
        counts only (``deleted``, ``skipped`` = locked), not which keys; so when some were locked the whole
        batch goes again ``delay_s`` later (a delete of a key L1 no longer holds is a no-op), until
        ``give_up``. A key neither deleted nor locked was no longer in L1 (the layer evicted it): skipped."""
        counts = self._delete_call(drops, pending=len(drops))
        if counts is None:
            return
        deleted, locked = counts
        self._count("applied", n=deleted)
        self._count("skipped", n=len(drops) - deleted - locked)
        # every key is marked, the ones the layer had already evicted too: their second sight readmits them
        with self._cv:
            for k in drops:
                self._dropped[k.chunk_hash_hex] = None
            while len(self._dropped) > self._dropped_max:
                self._dropped.popitem(last=False)
        self._after_locked(tuple(drops), locked, give_up)

    def _retry_locked(self, retry: _LockedRetry, give_up: float) -> None:
        """Send a batch again for its ``locked`` keys. Keys seen again since (readmitted: no longer marked
        dropped) are left out; so are all of them once the guards stop the keeper acting."""
        with self._cv:
            keys = [k for k in retry.keys if k.chunk_hash_hex in self._dropped]
        counts = self._delete_call(keys, pending=retry.locked) if keys else (0, 0)
        if counts is None:
            return
        deleted, locked = min(counts[0], retry.locked), min(counts[1], retry.locked)
        self._count("applied", n=deleted)
        self._count("skipped", n=retry.locked - deleted - locked)  # evicted or seen again meanwhile
        self._after_locked(tuple(keys), locked, give_up)

    def _after_locked(self, keys: tuple[ObjectKey, ...], locked: int, give_up: float) -> None:
        if locked <= 0:
            return
        self.counts["locked"] += locked
        self.locked_refusals.inc(locked)
        if self.clock() + self.delay_s < give_up:
            self._push(self.clock() + self.delay_s, give_up, _LockedRetry(keys, locked))
        else:
            self._count("skipped", n=locked)

    def _delete_call(self, keys: list[ObjectKey], *, pending: int) -> tuple[int, int] | None:
        """``(deleted, locked)`` of one ``DELETE /cache/objects`` tier ``l1``, both clamped to ``len(keys)``;
        None when the keeper may not act now or the call failed: the ``pending`` keys whose outcome was
        still open are then counted ``skipped`` or ``failed``."""
        if not self.is_active() or not self.core.acting:
            self._count("skipped", n=pending)
            return None
        reply, _ = self.act.caller.request(
            "DELETE", "/cache/objects", {"keys": [k.encoded() for k in keys], "tier": "l1"}
        )
        if reply.status != 200 or not isinstance(reply.body, dict):
            self._count("failed", n=pending)
            return None
        deleted = min(max(int(reply.body.get("deleted", 0)), 0), len(keys))
        locked = min(max(int(reply.body.get("skipped", 0)), 0), len(keys) - deleted)
        return deleted, locked

    def _latency_acts(self) -> bool:
        return self.latency is None or self.latency.acts_now()

    def _readmit(self, tokens: tuple[int, ...]) -> None:
        if not self.is_active() or not self.core.acting or not self._latency_acts():
            return
        res = self.act.prefetch([BlockRef(model=self.act.model_name, token_ids=tokens)])
        ok = any(o.outcome is Outcome.APPLIED for o in res.outcomes)
        self._count("readmitted" if ok else "readmit_failed", "l1_readmit")

    def _count(self, outcome: str, action: str = "l1_admission", n: int = 1) -> None:
        if n <= 0:
            return
        self.counts[outcome] = self.counts.get(outcome, 0) + n
        self.record(f"{action}:{outcome}", n)

    def status(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._due)
        try:
            l2 = "per key (fs files)" if self.act.verifier() is not None else "not observable"
        except Exception:  # noqa: BLE001 - /v1/status must answer while the layer does not
            l2 = "unknown: the layer's /status does not answer"
        return {
            "strategy": "second-sight admission (drop first-sight chunks from L1 once L2 holds them)"
            + (
                f"; cold-chain eviction (keep L1 under {self.core.cold_fill:g} of capacity by dropping the"
                " chains least likely continued next)"
                if self.core.cold_fill is not None
                else ""
            ),
            "residency": {
                "l1": "counts only (LMCache MP /status); per-key L1 residency is not observable",
                "l2": l2,
            },
            "pending": pending,
            "counts": dict(self.counts),
            "guard": self.core.status(),
            "latency_guard": self.latency.status() if self.latency is not None else None,
        }


L1_HIT_TOKENS = "lmcache_mp_lookup_hit_l1_tokens"  # LMCache MP's counter (family name, no ``_total``)


def l1_hit_tokens(metrics_text: str) -> float | None:
    """LMCache MP's look-up hits served from L1 (tokens, summed over label sets) in a ``/metrics`` text;
    None when absent (LMCache creates the family lazily, at its first look-up: then no hits yet -> 0.0 if
    any other ``lmcache_mp_`` family is there). Only that counter's sample lines are parsed; a broken block
    elsewhere is skipped, but when the counter is absent and some block was broken it may have been the
    counter's, so the reading is unknown (None), not 0."""
    p = parse_families(metrics_text, keep={L1_HIT_TOKENS + "_total"})
    if L1_HIT_TOKENS in p.types:
        return float(sum(x.value for x in p.get(L1_HIT_TOKENS + "_total")))
    if p.broken_blocks:
        return None
    return 0.0 if any(n.startswith("lmcache_mp_") for n in p.types) else None


TTFT_FAMILY = "vllm:time_to_first_token_seconds"


class EngineTtftReader:
    """``engine_ttft`` for the keeper: GET ``<engine>/metrics`` (its own small client: the keeper's worker
    thread is synchronous) -> :func:`engine_ttft`; None on a non-200 reply."""

    def __init__(self, engine_url: str, timeout_s: float = 2.0) -> None:
        self.url = engine_url.rstrip("/") + "/metrics"
        self._client = httpx.Client(timeout=timeout_s)

    def __call__(self) -> tuple[float, float] | None:
        r = self._client.get(self.url)
        return engine_ttft(r.text) if r.status_code == 200 else None

    def close(self) -> None:
        self._client.close()


def engine_ttft(metrics_text: str) -> tuple[float, float] | None:
    """vLLM's cumulative TTFT histogram in a ``/metrics`` text -> (``_sum`` s, ``_count``), summed over its
    label sets (models, engines); None when the family is absent. A line scan, not a full parse: vLLM's
    exposition is hundreds of lines and only two series are needed."""
    total_s = count = 0.0
    seen = False
    for line in metrics_text.splitlines():
        if not line.startswith(TTFT_FAMILY):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in (TTFT_FAMILY + "_sum", TTFT_FAMILY + "_count"):
            continue
        try:  # ``name{labels} value [timestamp]`` or ``name value [timestamp]``
            v = float(line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1])
        except (IndexError, ValueError):
            continue
        seen = True
        if name.endswith("_sum"):
            total_s += v
        else:
            count += v
    return (total_s, count) if seen else None


def keeper_hook(keeper: L1Keeper) -> Callable[[int | None, Sequence[int], int], None]:
    """``(parent, event block hashes (folded), block_size)`` -> feed the keeper the event's chain."""

    def hook(parent: int | None, hashes: Sequence[int], block_size: int) -> None:
        if hashes:
            keeper.on_block_stored(parent, int(hashes[-1]), len(hashes), block_size)

    return hook
