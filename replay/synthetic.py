"""Seeded generators of trace variants for robustness checks of policies (pure, in-memory).

* :func:`multiturn_trace` — a generated multi-turn chat workload: sessions share a few system prompts,
  each turn re-sends the previous prompt + answer + a new user message, sessions continue with a
  turn-dependent probability after an exponential think time. Only *full* 512-token blocks of the
  previous prompt keep their ids (a partial tail block's content changes when it is extended).
* :func:`shared_document_trace` — retrieval/agent-style: each request = a system prompt + one of many
  documents (Zipf popularity, so frequency matters) + a unique question; many blocks used once.
* :func:`long_document_trace` — short trace of long requests over large shared documents plus
  follow-ups (shaped like Mooncake's *synthetic* trace: ~4 k requests, 58 % of blocks used once).
* :func:`subsample_sessions` — keep a seeded random subset of a real trace's root-children chains.
* :func:`time_stretch` — scale inter-arrival times (the trace replayed faster or slower).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from kvtier.policies.base import Request


def multiturn_trace(
    n_requests: int = 3000,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    sessions_per_s: float = 2.0,
    n_system_prompts: int = 4,
    system_blocks: int = 2,
    think_s: float = 60.0,
    p_continue: Sequence[float] = (0.35, 0.45, 0.55, 0.65),
) -> list[Request]:
    """``n_requests`` requests in arrival order (timestamps in ms)."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    systems = [[new_id() for _ in range(system_blocks)] for _ in range(n_system_prompts)]
    events: list[tuple[float, int, int]] = []  # (time ms, tie, session)
    sessions: list[dict[str, object]] = []
    t = 0.0
    out: list[Request] = []
    tie = 0
    while len(out) < n_requests:
        t_new = t + rng.exponential(1000.0 / sessions_per_s)
        while events and events[0][0] <= t_new and len(out) < n_requests:
            te, _, sid = heapq.heappop(events)
            out.append(_turn(sessions[sid], te, rng, block_tokens, new_id))
            cont = p_continue[min(int(sessions[sid]["turn"]), len(p_continue) - 1)]  # type: ignore[call-overload]
            if rng.random() < cont:
                tie += 1
                heapq.heappush(events, (te + rng.exponential(think_s * 1000.0), tie, sid))
        if len(out) >= n_requests:
            break
        t = t_new
        sys_p = systems[int(rng.integers(0, n_system_prompts))]
        sessions.append({"blocks": list(sys_p), "tokens": system_blocks * block_tokens, "turn": 0})
        tie += 1
        heapq.heappush(events, (t, tie, len(sessions) - 1))
    return out


def _turn(sess: dict[str, object], t_ms: float, rng: np.random.Generator, bt: int, new_id: object) -> Request:
    blocks: list[int] = sess["blocks"]  # type: ignore[assignment]
    tokens = int(sess["tokens"])  # type: ignore[call-overload]
    user = int(rng.integers(50, 3000))
    inp = tokens + user
    full_prev = tokens // bt  # full blocks of the previous prompt+answer keep their ids
    ids = blocks[:full_prev]
    while len(ids) * bt < inp:
        ids.append(new_id())  # type: ignore[operator]
    out_len = int(rng.integers(20, 800))
    sess["blocks"] = ids
    sess["tokens"] = inp + out_len
    sess["turn"] = int(sess["turn"]) + 1  # type: ignore[call-overload]
    return Request(t_ms, inp, out_len, np.array(ids, dtype=np.int64))


def shared_document_trace(
    n_requests: int = 4000,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    n_docs: int = 3000,
    zipf_a: float = 1.1,
    doc_blocks: tuple[int, int] = (4, 120),
    rate_per_s: float = 4.0,
) -> list[Request]:
    """``n_requests`` requests in arrival order (timestamps in ms)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(doc_blocks[0], doc_blocks[1] + 1, size=n_docs)
    next_id = 2
    docs: list[list[int]] = []
    for n in sizes.tolist():
        docs.append([0, *range(next_id, next_id + n)])  # block 0: the shared system prompt (own chain: 1)
        next_id += n
    w = 1.0 / np.arange(1, n_docs + 1) ** zipf_a
    order = rng.permutation(n_docs)
    p = np.empty(n_docs)
    p[order] = w / w.sum()
    t = 0.0
    out = []
    for _ in range(n_requests):
        t += rng.exponential(1000.0 / rate_per_s)
        d = int(rng.choice(n_docs, p=p))
        q_tokens = int(rng.integers(20, 1500))
        ids = list(docs[d])
        inp = len(ids) * block_tokens + q_tokens
        while len(ids) * block_tokens < inp:
            ids.append(next_id)
            next_id += 1
        out.append(Request(t, inp, int(rng.integers(20, 600)), np.array(ids, dtype=np.int64), block_tokens))
    return out


def subsample_sessions(reqs: Sequence[Request], keep: float, *, seed: int = 0) -> list[Request]:
    """Keep requests whose chain (the block under the common root, or the root) is in a random subset."""
    rng = np.random.default_rng(seed)
    chosen: dict[int, bool] = {}
    out = []
    for r in reqs:
        h = r.hash_ids
        key = int(h[1]) if h.shape[0] > 1 else int(h[0])
        if key not in chosen:
            chosen[key] = bool(rng.random() < keep)
        if chosen[key]:
            out.append(r)
    return out


def time_stretch(reqs: Sequence[Request], factor: float) -> list[Request]:
    """Same requests with timestamps multiplied by ``factor``."""
    return [
        Request(r.timestamp_ms * factor, r.input_length, r.output_length, r.hash_ids, r.block_tokens)
        for r in reqs
    ]


def long_document_trace(
    n_requests: int = 4000,
    *,
    seed: int = 0,
    block_tokens: int = 512,
    n_docs: int = 3000,
    zipf_a: float = 0.8,
    doc_log_mean: float = 3.0,
    doc_log_sigma: float = 1.0,
    max_blocks: int = 374,
    p_follow: float = 0.25,
    duration_s: float = 1020.0,
) -> list[Request]:
    """Short trace of long requests over large shared documents (shaped like Mooncake's *synthetic* trace).

    A new session reads one document (Zipf popularity, log-normal length in blocks, capped so a request
    stays <= ``max_blocks``) plus a unique 1-3 block question; with probability ``p_follow`` a request is
    instead a follow-up that re-sends a random earlier session's full blocks plus a new question. Arrivals
    are uniform over ``duration_s`` (Poisson). Timestamps in ms.
    """
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(np.exp(rng.normal(doc_log_mean, doc_log_sigma, size=n_docs))), 1, max_blocks - 4)
    next_id = 0
    docs: list[list[int]] = []
    for n in sizes.astype(int).tolist():
        docs.append(list(range(next_id, next_id + n)))
        next_id += n
    w = 1.0 / np.arange(1, n_docs + 1) ** zipf_a
    p = np.empty(n_docs)
    p[rng.permutation(n_docs)] = w / w.sum()
    times = np.sort(rng.uniform(0.0, duration_s * 1000.0, size=n_requests))
    sessions: list[tuple[list[int], int]] = []  # (ids, input tokens + output tokens)
    out: list[Request] = []
    for t in times.tolist():
        if sessions and rng.random() < p_follow:
            prev, tokens = sessions[int(rng.integers(0, len(sessions)))]
            ids = list(prev[: min(tokens // block_tokens, max_blocks - 3)])
        else:
            ids = list(docs[int(rng.choice(n_docs, p=p))])
            tokens = len(ids) * block_tokens
        q = int(rng.integers(50, 3 * block_tokens))
        inp = min(len(ids) * block_tokens + q, max_blocks * block_tokens)
        while len(ids) * block_tokens < inp:
            ids.append(next_id)
            next_id += 1
        out_len = int(rng.integers(20, 800))
        sessions.append((ids, inp + out_len))
        out.append(Request(t, inp, out_len, np.array(ids, dtype=np.int64), block_tokens))
    return out
