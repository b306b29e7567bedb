"""The discrete-event serving model (simpy): arrivals, a concurrency limit, a chunked-prefill engine.

Per request: arrive at its (scaled) trace time; wait for one of ``concurrency`` slots (FCFS); look up its
prefix in the cache layer, which loads the hit blocks into HBM over the links (shared with prefetches);
join the engine's prefill queue; the engine runs steps, each spending at most ``token_budget`` tokens on
one decode token per decoding sequence and prefill chunks FCFS (chunked prefill), lasting
``max(compute, memory) + overhead`` (:class:`~kvtier.replay.sim.scenario.ComputeModel`); after its last
prefill chunk the request has its first token (TTFT = queue wait + load + prefill) and its blocks are stored;
it then decodes ``output_length`` tokens and frees its slot.

Optional ``on_arrival`` (every request, at its arrival) and ``ticker`` (every ``tick_interval_s``) hooks let
a sidecar watch the same clock and act on the layer between events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import simpy

from kvtier.policies.base import Request
from kvtier.replay.sim.layer import CacheLayer
from kvtier.replay.sim.scenario import Scenario


def engine_hit_tokens(hit_blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Prompt tokens the engine takes from cache for ``hit_blocks`` cached blocks: never the last token
    (vLLM always computes it, to produce the first output token)."""
    hit = min(hit_blocks * block_tokens, input_tokens)
    return input_tokens - 1 if hit >= input_tokens > 0 else hit


@dataclass
class RequestRecord:
    arrival_s: float
    first_token_s: float = -1.0
    done_s: float = -1.0
    queue_s: float = 0.0
    load_s: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    hit_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass
class _Seq:
    rec: RequestRecord
    prefill_left: int
    pos: int
    decode_left: int
    prefilled: simpy.Event
    done: simpy.Event
    context: int = 0


@dataclass
class ServingResult:
    records: list[RequestRecord] = field(default_factory=list)
    steps: int = 0
    end_s: float = 0.0


class ServingModel:
    def __init__(
        self,
        scenario: Scenario,
        layer: CacheLayer,
        *,
        on_arrival: Callable[[Request, float], None] | None = None,
        ticker: Callable[[float], None] | None = None,
    ) -> None:
        self.sc = scenario
        self.layer = layer
        self.on_arrival = on_arrival
        self.ticker = ticker
        self.env = simpy.Environment()
        self.slots = simpy.Resource(self.env, capacity=scenario.serving.concurrency)
        self._prefill: deque[_Seq] = deque()
        self._decode: list[_Seq] = []
        self._work = self.env.event()
        self.result = ServingResult()
        self._pending = 0

    def clock(self) -> float:
        """Simulated seconds since the first arrival."""
        return float(self.env.now)

    def run(self, requests: Sequence[Request]) -> ServingResult:
        if not requests:
            return self.result
        t0 = requests[0].timestamp_ms
        scale = 1.0  # arrival times come scaled (run.load_requests)
        self._pending = len(requests)
        self.env.process(self._arrivals(requests, t0, scale))
        self.env.process(self._engine())
        if self.ticker is not None:
            self.env.process(self._ticks())
        self.env.run()
        self.result.end_s = float(self.env.now)
        return self.result

    def _arrivals(self, reqs: Sequence[Request], t0: float, scale: float):  # type: ignore[no-untyped-def]
        for r in reqs:
            at = (r.timestamp_ms - t0) / 1e3 / scale
            if at > self.env.now:
                yield self.env.timeout(at - self.env.now)
            if self.on_arrival is not None:
                self.layer.now = self.env.now
                self.on_arrival(r, self.env.now)
            self.env.process(self._request(r))

    def _ticks(self):  # type: ignore[no-untyped-def]
        assert self.ticker is not None
        while self._pending > 0:
            yield self.env.timeout(self.sc.tick_interval_s)
            self.layer.now = self.env.now
            self.ticker(self.env.now)

    def _request(self, r: Request):  # type: ignore[no-untyped-def]
        env = self.env
        rec = RequestRecord(arrival_s=env.now, input_tokens=r.input_length, output_tokens=r.output_length)
        self.result.records.append(rec)
        with self.slots.request() as slot:
            yield slot
            if self.sc.serving.closed_loop:  # a benchmark client with this many requests in flight
                rec.arrival_s = env.now
            rec.queue_s = env.now - rec.arrival_s
            self.layer.now = env.now
            chain = r.hash_ids.tolist()
            look = self.layer.lookup(chain, r.input_length, r.block_tokens)
            hit = engine_hit_tokens(look.hit_blocks, r.block_tokens, r.input_length)
            rec.hit_tokens = hit
            if look.ready_at > env.now:
                rec.load_s = look.ready_at - env.now
                yield env.timeout(look.ready_at - env.now)
            seq = _Seq(rec, r.input_length - hit, hit, max(0, r.output_length - 1), env.event(), env.event(),
                       r.input_length)  # fmt: skip
            self._prefill.append(seq)
            if not self._work.triggered:
                self._work.succeed()
            yield seq.prefilled
            self.layer.now = env.now
            self.layer.store(chain, look.hit_blocks)
            yield seq.done
        self._pending -= 1

    def _engine(self):  # type: ignore[no-untyped-def]
        env, cm = self.env, self.sc.compute
        budget0 = self.sc.serving.token_budget
        kvb = cm.kv_bytes_per_token
        while self._pending > 0:
            if not self._prefill and not self._decode:
                self._work = env.event()
                yield self._work
                continue
            budget = budget0 - len(self._decode)
            compute = cm.prefill_a_s * len(self._decode)
            mem_bytes = cm.weight_bytes + kvb * sum(s.context for s in self._decode)
            chunks: list[tuple[_Seq, int]] = []
            for s in self._prefill:
                if budget <= 0:
                    break
                n = min(budget, s.prefill_left)
                compute += cm.prefill_s(s.pos, n)
                mem_bytes += kvb * s.pos
                chunks.append((s, n))
                budget -= n
            yield env.timeout(max(compute, mem_bytes / cm.mem_bytes_s) + cm.step_overhead_s)
            self.result.steps += 1
            now = env.now
            finished = []
            for s in self._decode:
                s.decode_left -= 1
                s.context += 1
                if s.decode_left <= 0:
                    finished.append(s)
            if finished:
                self._decode = [s for s in self._decode if s.decode_left > 0]
                for s in finished:
                    s.rec.done_s = now
                    s.done.succeed()
            for s, n in chunks:
                s.prefill_left -= n
                s.pos += n
                if s.prefill_left <= 0:
                    self._prefill.remove(s)
                    s.rec.first_token_s = now
                    s.prefilled.succeed()
                    if s.decode_left > 0:
                        self._decode.append(s)
                    else:
                        s.rec.done_s = now
                        s.done.succeed()
