"""Subscribe to a vLLM engine's KV-cache events over ZMQ and feed them to a :class:`KvIngestor`.

* Discovery: ``GET /kv_event_sources`` -> ``{dp_rank: {endpoint, replay_endpoint, topic, ...}}`` (this is the
  collector's fetch/parse; :meth:`KvEventSubscriber.poll` (re)configures the sockets from it through
  :meth:`KvEventSubscriber.configure`).
* Bind-or-connect mirrors vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``): vLLM BINDS its PUB socket
  only for endpoints with ``*`` or ``::`` or ``ipc://``/``inproc://`` -> the SUB connects (wildcards replaced
  by the engine's host); for any other endpoint (e.g. ``tcp://127.0.0.1:P``) vLLM CONNECTS -> the SUB binds.
  The replay ROUTER is always bound by vLLM -> the DEALER connects.
* Sequence numbers (8-byte big-endian, +1 per batch per publisher). A batch whose seq is not the next one
  expected is *held*, not applied, until the next frame confirms it: one bad frame (a spoofed or corrupted
  seq) must never count a large loss or clear the index. The next frame confirms the held batch when it lies
  after it, at most ``max_seq_gap`` further on (``held < next <= held + max_seq_gap``) and, if the held batch
  went backwards, still before the old position (a restarted publisher counting up from 0). A confirmed
  forward jump is a gap: filled from the replay endpoint when there is one (``(b"", start_seq)`` -> batches
  then an end marker with seq -1), the rest counted lost. A confirmed backward jump is a publisher restart:
  what that source held is dropped (its caches are empty after a restart). Otherwise the held batch is
  dropped and counted as a ``sequence`` collector error. A new process start time (:meth:`note_engine_start`)
  is a restart too, and confirms a held seq-0 batch. Cost: after a real gap or restart, the first batch waits
  for the next one (or, for a restart, the next ``/metrics`` scrape).
* The receive loop never holds the event loop for long: it yields after every ``yield_every_s`` of work (the
  API, ``/healthz`` and the reconcile loop stay responsive during a flood, and a cancellation -- SIGTERM --
  lands within one slice). Queued index updates are applied at most every ``flush_interval_s`` (and when
  the stream goes quiet, after at most that long): a bulk apply has a fixed cost (~0.25 ms) that, paid per
  received message, was a quarter of the sidecar's CPU at one request at a time. Readers of the index see
  it at most ``flush_interval_s`` behind the stream. The backlog is bounded by ZMQ: ``RCVHWM`` messages
  queue in our socket and a publisher facing a full queue drops batches, which show up here as sequence
  gaps (counted in ``lost``); ``MAXMSGSIZE`` makes ZMQ drop a connection sending an oversized frame
  before it is buffered.
* Who can publish: a SUB that *binds* a TCP port (vLLM's connect-style endpoints) accepts frames from any
  process that can reach that port. Prefer an ``ipc://`` endpoint in a directory only the engine and the
  sidecar can write (file permissions gate who can connect), or a loopback-only TCP endpoint that vLLM binds;
  the stream position (``next_seq``) is only shown to callers holding the API token.
* Malformed frames / events, events with an unknown ``medium`` (kind ``unknown_medium``) and unconfirmed
  sequence jumps are counted in ``kvtier_collector_errors_total{collector}`` and skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvtier.collectors.base import Clock, HttpCollector, Observation
from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import DecodedBatch, DecodeError, decode_frames

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvSource:
    """One publisher (DP rank) as reported by ``/kv_event_sources``."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(frozen=True, slots=True)
class KvSourcesObservation(Observation):
    sources: tuple[KvSource, ...]


def parse_sources(text: str) -> tuple[KvSource, ...]:
    """Pure: ``/kv_event_sources`` JSON -> sources sorted by DP rank. Raises ValueError on a bad document."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("kv_event_sources is not a JSON object")
    out = []
    for rank, cfg in doc.items():
        if not isinstance(cfg, dict) or not isinstance(cfg.get("endpoint"), str):
            raise ValueError(f"kv_event_sources[{rank!r}] has no endpoint")
        if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher") not in (None, "zmq"):
            continue
        replay = cfg.get("replay_endpoint")
        out.append(
            KvSource(
                dp_rank=int(rank),
                endpoint=cfg["endpoint"],
                replay_endpoint=replay if isinstance(replay, str) and replay else None,
                topic=str(cfg.get("topic") or ""),
            )
        )
    return tuple(sorted(out, key=lambda s: s.dp_rank))


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: its PUB binds for '*', '::', ipc:// and inproc:// endpoints, else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_plan(endpoint: str, engine_host: str) -> tuple[str, str]:
    """('bind'|'connect', address) for our SUB socket facing vLLM's PUB ``endpoint``."""
    if endpoint.startswith("inproc://"):
        raise ValueError(f"{endpoint}: inproc endpoints are not reachable from another process")
    if not vllm_binds(endpoint):
        return "bind", endpoint
    return "connect", _dewildcard(endpoint, engine_host)


def _dewildcard(endpoint: str, engine_host: str) -> str:
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if host in ("*", "::", "[::]", "0.0.0.0"):
            h = f"[{engine_host}]" if ":" in engine_host else engine_host
            return f"tcp://{h}:{port}"
    return endpoint


@dataclass(slots=True)
class _SourceState:
    src: KvSource
    sub: zmq.asyncio.Socket
    sub_addr: str
    expected: int | None = None  # next sequence number expected
    batches: int = 0
    lost: int = 0  # batches (sequence numbers) neither received nor replayed
    replayed: int = 0  # batches recovered from the replay endpoint
    restarts: int = 0  # publisher restarts detected (sequence went backwards, or a new process start time)
    held: DecodedBatch | None = None  # out-of-sequence batch waiting for the next frame to confirm it
    rejected: int = 0  # held batches the next frame did not confirm (dropped, counted as errors)
    seq_reset_seen: bool = False  # the stream showed a restart the start time has not shown yet
    label: str = field(default="")


class KvEventSubscriber(HttpCollector[KvSourcesObservation]):
    """KV events of one vLLM engine (all its DP ranks) -> :class:`KvIngestor`."""

    kind = "vllm_kv_events"
    path = "/kv_event_sources"

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        ingestor: KvIngestor,
        client: httpx.AsyncClient,
        registry: CollectorRegistry,
        context: zmq.asyncio.Context,
        engine: str | None = None,
        clock: Clock = time.time,
        replay_timeout_s: float = 2.0,
        max_seq_gap: int = 10_000,
        timeout_s: float = 5.0,
        rcvhwm: int = 10_000,
        max_msg_bytes: int = 64 << 20,
        yield_every_s: float = 0.005,
        flush_interval_s: float = 0.0,
    ) -> None:
        """``max_seq_gap``: the largest seq step (batches) from a held out-of-sequence batch to the next frame
        that still confirms it (vLLM buffers 10,000 batches for replay by default)."""
        super().__init__(name, base_url, client=client, registry=registry, clock=clock, timeout_s=timeout_s)
        self.ingestor = ingestor
        self.ctx = context
        self.engine = engine or (urlsplit(base_url).netloc or base_url)
        self.engine_host = urlsplit(base_url).hostname or "127.0.0.1"
        self.replay_timeout_s = replay_timeout_s
        self.max_seq_gap = max_seq_gap
        self.rcvhwm = rcvhwm  # messages queued per socket before the publisher drops (a counted gap)
        self.max_msg_bytes = max_msg_bytes  # ZMQ refuses larger frames (bytes)
        self.yield_every_s = yield_every_s  # longest stretch of event work between event-loop yields
        self.yields = 0  # times the receive loop gave the event loop back mid-backlog
        self.flush_interval_s = flush_interval_s  # least time between index flushes of the receive loop, s
        self._flush_due = 0.0  # monotonic time of the next receive-loop flush
        self._states: dict[int, _SourceState] = {}
        self._engine_start: float | None = None
        self._lost_total = 0  # survive socket reconfiguration
        self._replayed_total = 0
        self._wake = asyncio.Event()
        self.ingestor.counts[self.engine]  # export zero counters from the start

    # ---- Collector ----------------------------------------------------------------------------------------
    def parse(self, raw: str, now: float) -> KvSourcesObservation:
        return KvSourcesObservation(collector=self.name, timestamp=now, sources=parse_sources(raw))

    async def poll(self) -> KvSourcesObservation | None:
        obs = await super().poll()
        if obs is not None:
            try:
                self.configure(obs.sources)
            except (zmq.ZMQError, ValueError) as exc:
                self._fail("socket", exc)
                return None
        return obs

    def status(self) -> dict[str, Any]:
        out = super().status()
        out["engine"] = self.engine
        out["sources"] = [
            {
                "dp_rank": r,
                "endpoint": st.src.endpoint,
                "socket": st.sub_addr,
                "replay_endpoint": st.src.replay_endpoint,
                "next_seq": st.expected,
                "batches": st.batches,
                "lost": st.lost,
                "replayed": st.replayed,
                "restarts": st.restarts,
                "held_seq": st.held.seq if st.held is not None else None,
                "rejected": st.rejected,
            }
            for r, st in sorted(self._states.items())
        ]
        return out

    @property
    def lost(self) -> int:
        """Batches lost (not received and not replayed), all DP ranks, since start."""
        return self._lost_total

    @property
    def replayed(self) -> int:
        return self._replayed_total

    @property
    def batches(self) -> int:
        return sum(st.batches for st in self._states.values())

    # ---- engine restarts ----------------------------------------------------------------------------------
    def note_engine_start(self, start_time: float | None) -> None:
        """Feed the engine's process start time (from /metrics); a change means it restarted."""
        if start_time is None:
            return
        prev, self._engine_start = self._engine_start, start_time
        if prev is None or start_time == prev:
            return
        for st in self._states.values():
            if st.seq_reset_seen:  # the event stream already told us (and we cleared then)
                st.seq_reset_seen = False
                continue
            self._restart(st, "process start time changed")
            held = st.held
            if held is not None and held.seq == 0:  # the new process's first batch: confirmed
                st.held = None
                self._apply(st, held)

    def _restart(self, st: _SourceState, why: str) -> None:
        n = self.ingestor.clear_source(self.engine, st.label)
        st.expected = 0
        st.restarts += 1
        log.info("%s dp%d: publisher restarted (%s); dropped %d blocks", self.engine, st.src.dp_rank, why, n)

    # ---- sockets ------------------------------------------------------------------------------------------
    def configure(self, sources: tuple[KvSource, ...]) -> None:
        """Open a SUB socket per source not yet open (bind or connect, module doc) and close those of
        sources gone or changed. :meth:`poll` calls this with the discovered sources; a caller that knows
        its sources (no ``/kv_event_sources`` to ask) may call it directly. Raises ``zmq.ZMQError`` /
        ``ValueError`` when a socket cannot be set up (the sockets opened before it stay open)."""
        wanted = {s.dp_rank: s for s in sources}
        for rank in list(self._states):
            if rank not in wanted or wanted[rank] != self._states[rank].src:
                self._states.pop(rank).sub.close(linger=0)
        for rank, src in wanted.items():
            if rank in self._states:
                continue
            how, addr = subscriber_plan(src.endpoint, self.engine_host)
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
            try:
                sock.bind(addr) if how == "bind" else sock.connect(addr)
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            label = self.engine if rank == 0 else f"{self.engine}/dp{rank}"
            self._states[rank] = _SourceState(src=src, sub=sock, sub_addr=f"{how} {addr}", label=label)
            log.info("%s dp%d: SUB %s %s (topic %r)", self.engine, rank, how, addr, src.topic)
        self._wake.set()

    def socket_endpoint(self, dp_rank: int) -> str:
        """The address our SUB socket for ``dp_rank`` is bound or connected to, as ZMQ resolved it (a bind to
        port 0 shows the port it got). Raises ``KeyError`` if no socket is open for that rank."""
        return self._states[dp_rank].sub.getsockopt_string(zmq.LAST_ENDPOINT)

    async def aclose(self) -> None:
        for st in self._states.values():
            st.sub.close(linger=0)
        self._states.clear()
        self._wake.set()

    # ---- receive loop -------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Receive and apply batches until cancelled. Never raises on bad input."""
        while True:
            if not self._states:
                self._wake.clear()
                await self._wake.wait()
                continue
            poller = zmq.asyncio.Poller()
            socks: dict[Any, _SourceState] = {}
            for st in self._states.values():
                poller.register(st.sub, zmq.POLLIN)
                socks[st.sub] = st
            self._wake.clear()
            timeout_ms = 200.0
            if self.ingestor.queued_ops:  # wake for the due flush even if the stream goes quiet
                timeout_ms = min(timeout_ms, max(0.0, (self._flush_due - time.monotonic()) * 1000.0))
            ready = await poller.poll(timeout=timeout_ms)
            t0 = time.monotonic()
            for sock, _ in ready:
                got = socks.get(sock)
                if got is None or got.sub.closed:
                    continue
                st = got
                while not st.sub.closed:
                    try:
                        frames = await st.sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self.handle(st.src.dp_rank, frames)
                    if time.monotonic() - t0 >= self.yield_every_s:
                        self.ingestor.flush(wait=False)  # bounded: one slice of queued index updates
                        await asyncio.sleep(0)  # let the API, the loop and cancellation in
                        self.yields += 1
                        t0 = time.monotonic()
            now = time.monotonic()
            if self.ingestor.queued_ops and now >= self._flush_due:
                done = self.ingestor.flush(wait=False)  # queued index updates -> BlockIndex
                # a flush put off by a tick holding the index retries in 10 ms, not in a busy loop
                self._flush_due = now + (self.flush_interval_s if done else max(self.flush_interval_s, 0.01))

    async def handle(self, rank: int, frames: list[bytes]) -> None:
        """One received message from DP rank ``rank``: decode, check sequence, replay gaps, apply."""
        st = self._states.get(rank)
        if st is None:
            return
        try:
            batch = decode_frames(frames)
        except DecodeError as exc:
            self.count_error("frame", exc)
            return
        if batch.seq < 0:
            self.count_error("frame", "replay end marker (seq -1) on the event stream")
            return
        await self._accept(st, batch)

    async def _accept(self, st: _SourceState, batch: DecodedBatch) -> None:
        """Apply ``batch`` if it is the next one expected; else hold it until the next frame (module doc)."""
        seq = batch.seq
        if st.expected is None:
            st.expected = 0  # a fresh subscriber: everything since seq 0 is wanted
        held = st.held
        if held is not None:
            st.held = None
            h, exp = held.seq, st.expected
            if h < seq <= h + self.max_seq_gap and (h > exp or seq < exp):
                if h < exp:
                    self._restart(st, f"sequence went back from {exp} to {h}, then on to {seq}")
                    st.seq_reset_seen = True
                if h > st.expected:
                    await self._fill_gap(st, st.expected, h)
                self._apply(st, held)
            else:
                st.rejected += 1
                why = f"dp{st.src.dp_rank}: dropped out-of-sequence batch {h} (expected {exp}, next {seq})"
                self.count_error("sequence", why)
        if seq == st.expected:
            self._apply(st, batch)
        else:
            st.held = batch

    def _apply(self, st: _SourceState, batch: DecodedBatch) -> None:
        if batch.skipped:
            self.count_error("event", f"malformed/unknown events in batch {batch.seq}", batch.skipped)
        if batch.unknown_media:
            media = sorted({repr(m)[:40] for m in batch.unknown_media})
            self.count_error("unknown_medium",
                             f"events with an unknown medium {', '.join(media)} in batch {batch.seq}",
                             len(batch.unknown_media))  # fmt: skip
        try:
            self.ingestor.apply(self.engine, batch, st.label)
        except (DecodeError, ValueError, OverflowError) as exc:
            self.count_error("apply", exc)
        st.batches += 1
        st.expected = batch.seq + 1

    async def _fill_gap(self, st: _SourceState, start: int, end: int) -> None:
        """Batches [start, end) are missing: replay what the engine still buffers; count the rest lost."""
        if st.src.replay_endpoint:
            try:
                await self._replay(st, end)
            except (zmq.ZMQError, TimeoutError) as exc:
                self.count_error("replay", exc)
        if st.expected is not None and st.expected < end:
            self._lose(st, end - st.expected)
            st.expected = end

    def _lose(self, st: _SourceState, n: int) -> None:
        st.lost += n
        self._lost_total += n
        log.warning(
            "%s dp%d: %d KV-event batches lost before seq %s", self.engine, st.src.dp_rank, n, st.expected
        )

    async def _replay(self, st: _SourceState, end: int) -> None:
        """Ask the ROUTER for batches from ``st.expected``; apply those < ``end`` in order."""
        assert st.src.replay_endpoint is not None and st.expected is not None
        addr = _dewildcard(st.src.replay_endpoint, self.engine_host)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(addr)
            await sock.send_multipart([b"", st.expected.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(timeout=max(1, int(left * 1000))):
                    raise TimeoutError(f"replay from {addr} timed out after {self.replay_timeout_s} s")
                parts = await sock.recv_multipart()
                if parts and parts[0] == b"":
                    parts = parts[1:]
                if len(parts) == 3 and parts[1] == b"\xff" * 8:
                    return  # end marker
                try:
                    b = decode_frames(parts)
                except DecodeError as exc:
                    self.count_error("frame", exc)
                    continue
                if b.seq < st.expected or b.seq >= end:
                    continue
                if b.seq > st.expected:  # the engine's buffer no longer has the older ones
                    self._lose(st, b.seq - st.expected)
                self._apply(st, b)
                st.replayed += 1
                self._replayed_total += 1
        finally:
            sock.close(linger=0)
