"""``vllm-warmup``: prefetch into vLLM's GPU prefix cache by replaying a block chain's tokens.

vLLM has no per-prefix load API; the only lever is a request. A ``max_tokens=1`` completion whose prompt is
the chain's token ids makes the engine compute (or load) and cache every full block of that prefix. Tokens
come from ``BlockStored`` events (or a pin's tokenized prompt). Refs whose tokens are a prefix of another
ref in the same call are covered by that one request. A token bucket (prompt tokens/s and requests/s) keeps
warm-ups within their budget so they never compete with real traffic beyond it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import httpx

from kvtier.controller.actuators.base import (
    ActuationResult,
    Actuator,
    AdapterHealth,
    BlockRef,
    Capability,
    KeyOutcome,
    Outcome,
)
from kvtier.controller.actuators.resilience import (
    CircuitBreaker,
    CircuitOpen,
    HttpCaller,
    Resilient,
    RetryPolicy,
)
from kvtier.policies.budget import TokenBucket
from kvtier.policies.tiers import Tier


class WarmupBudget:
    """Warm-up budget over prompt tokens and requests (a :class:`TokenBucket`, ``burst_s`` seconds of rate
    deep). Clock in seconds."""

    def __init__(
        self,
        tokens_per_s: float,
        requests_per_s: float,
        burst_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokens_per_s, self.requests_per_s, self.burst_s = tokens_per_s, requests_per_s, burst_s
        self._clock = clock
        self._bucket = TokenBucket.full(tokens_per_s, requests_per_s, burst_s, clock())

    def take(self, tokens: int) -> bool:
        """Spend one request of ``tokens`` prompt tokens if the budget allows it."""
        self._bucket.refill(self._clock(), self.tokens_per_s, self.requests_per_s, self.burst_s)
        return self._bucket.take(tokens)


class VllmWarmupActuator(Actuator):
    """Warm vLLM's GPU prefix cache with ``max_tokens=1`` completions (capability: ``prefetch`` to gpu)."""

    name = "vllm-warmup"
    tiers = frozenset({Tier.GPU})  # the only tier it can target
    recreates = True  # can bring back a block resident nowhere (recompute): plans "admit" through it

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        client: httpx.Client | None = None,
        budget: WarmupBudget | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.budget = budget or WarmupBudget(tokens_per_s=4096, requests_per_s=4)
        self.breaker = breaker or CircuitBreaker()
        self._http = HttpCaller(
            self.base_url,
            client=client or httpx.Client(timeout=timeout_s),
            timeout_s=timeout_s,
            resilient=Resilient(retry or RetryPolicy(max_attempts=2), self.breaker),
        )
        self.requests_sent = 0
        self.tokens_sent = 0

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.PREFETCH})

    def health(self) -> AdapterHealth:
        return AdapterHealth(
            self.name, self.breaker.state, self.breaker.consecutive_failures, self.breaker.last_error
        )

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        t0 = time.perf_counter()
        res = ActuationResult(self.name, Capability.PREFETCH.value)
        if to is not Tier.GPU:
            res.outcomes = [
                KeyOutcome(b.layer_key, Outcome.SKIPPED, f"vllm-warmup only warms gpu, not {to}")
                for b in blocks
            ]
            return res
        with_tokens = [b for b in blocks if b.token_ids]
        outcome: dict[str, KeyOutcome] = {}
        for b in blocks:
            if not b.token_ids:
                outcome[b.layer_key] = KeyOutcome(b.layer_key, Outcome.SKIPPED, "no token ids known")
        # longest chains first; a ref whose tokens prefix an already-chosen chain is covered by it
        chosen: list[BlockRef] = []
        covered_by: dict[str, BlockRef] = {}
        for b in sorted(with_tokens, key=lambda r: -len(r.token_ids or ())):
            toks = b.token_ids or ()
            host = next((c for c in chosen if (c.token_ids or ())[: len(toks)] == toks), None)
            if host is None:
                chosen.append(b)
            else:
                covered_by[b.layer_key] = host
        for c in chosen:
            outcome[c.layer_key] = self._warm(c, res)
        for key, host in covered_by.items():
            o = outcome[host.layer_key]
            outcome[key] = KeyOutcome(key, o.outcome, f"covered by {host.layer_key}: {o.detail}")
        res.outcomes = [outcome[b.layer_key] for b in blocks]
        res.elapsed_s = time.perf_counter() - t0
        return res

    def _warm(self, ref: BlockRef, res: ActuationResult) -> KeyOutcome:
        toks = list(ref.token_ids or ())
        if not self.budget.take(len(toks)):
            return KeyOutcome(ref.layer_key, Outcome.SKIPPED, "warm-up budget exhausted")
        body = {"model": ref.model or self.model, "prompt": toks, "max_tokens": 1, "temperature": 0.0}
        try:
            reply, attempts = self._http.request("POST", "/v1/completions", json=body)
        except CircuitOpen as e:
            return KeyOutcome(ref.layer_key, Outcome.FAILED, str(e))
        except Exception as e:  # noqa: BLE001 - transport failures become per-key outcomes
            res.attempts += self._http.resilient.retry.max_attempts
            return KeyOutcome(ref.layer_key, Outcome.FAILED, f"{type(e).__name__}: {e}")
        res.attempts += attempts
        if reply.status >= 400:
            return KeyOutcome(ref.layer_key, Outcome.FAILED, f"HTTP {reply.status}: {str(reply.body)[:200]}")
        self.requests_sent += 1
        self.tokens_sent += len(toks)
        return KeyOutcome(ref.layer_key, Outcome.APPLIED, f"warmed {len(toks)} tokens")

    def close(self) -> None:
        self._http.close()
