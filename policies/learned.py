"""``learned``: reuse predictor + prefix-closed planner (admission by bypass, leaf-first eviction).

Every block access is scored by the predictor (or a recency heuristic until the first model is
trained): the log-odds that the block is accessed again within ``horizon_s``, given its access
features and its current *age* (time since that access). When the cache is full, the planner scores
the resident leaves (all of them, or a seeded random sample when there are many), evicts the lowest,
and re-scores a parent as soon as it becomes a leaf: eviction is leaf-only and the in-flight request
is pinned, so the resident set stays prefix-closed. Admission is a bypass: a missed block is admitted
only if it is likelier to return than the best eviction candidate; otherwise it and the rest of the
request are not admitted.

Causal: a training row is (access features, age a) -> "next access in (a, a + horizon]", used only
once ``a + horizon`` has passed; ages are drawn from the ages the planner actually met at eviction.
The model is refit every ``retrain_every`` requests on a bounded seeded sample. Pure, no I/O; state
lives in numpy arrays.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.policies.base import HitMask, Policy, Request
from kvtier.policies.features import (
    FEATURE_NAMES,
    N_FEATURES,
    fallback_logit,
    request_features,
    with_age,
)
from kvtier.policies.predictor import BinnedLogit, auc, brier, reliability, sigmoid

_I64 = np.int64


class LearnedPolicy(Policy):
    """Learned reuse predictor driving prefix-closed admission and leaf-first eviction."""

    name = "learned"

    def __init__(
        self,
        capacity_blocks: int,
        *,
        seed: int = 0,
        horizon_s: float = 300.0,
        retrain_every: int = 1000,
        max_train: int = 12000,
        min_class: int = 200,
        event_buffer: int = 1 << 18,
        pool_all: int = 256,
        pool_sample: int = 128,
    ) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self.horizon_ms = horizon_s * 1000.0
        self.retrain_every = retrain_every
        self.max_train = max_train
        self.min_class = min_class
        self.pool_all = pool_all
        self.pool_sample = pool_sample
        self._rng = np.random.default_rng(seed)
        self._train_rng = np.random.default_rng(seed + 1)
        self.model = BinnedLogit(seed=seed)
        # block state, indexed by dense slot
        self._slot: dict[int, int] = {}
        cap0 = 1024
        self._ids = np.zeros(cap0, dtype=_I64)
        self._parent = np.full(cap0, -1, dtype=_I64)
        self._resident = np.zeros(cap0, dtype=bool)
        self._res_children = np.zeros(cap0, dtype=np.int32)
        self._children = np.zeros(cap0, dtype=_I64)
        self._freq = np.zeros(cap0, dtype=_I64)
        self._last_ms = np.zeros(cap0, dtype=np.float64)
        self._turn = np.zeros(cap0, dtype=_I64)
        self._last_event = np.full(cap0, -1, dtype=_I64)
        self._cpos = np.full(cap0, -1, dtype=_I64)  # row in _cx while resident
        self._leaf_pos = np.full(cap0, -1, dtype=_I64)  # index in _leaves while a resident leaf
        self._n_slots = 0
        self._n_resident = 0
        # features of each resident block's last access, one row per cache slot
        self._cx = np.zeros((max(capacity_blocks, 1), N_FEATURES), dtype=np.float32)
        self._free: list[int] = list(range(max(capacity_blocks, 1) - 1, -1, -1))
        self._leaves: list[int] = []
        # eviction candidates as they were scored: (event of their last access, age ms) -> training rows
        self._cand_ev = np.zeros(1 << 16, dtype=_I64)
        self._cand_age = np.zeros(1 << 16, dtype=np.float64)
        self._n_cand = 0
        self._evict_age = np.zeros(4096, dtype=np.float64)  # ages (ms) of recently evicted blocks
        self._n_evict_age = 0
        # ring of past accesses (features + outcome) for training and self-evaluation
        self._E = event_buffer
        self._ev_x = np.zeros((self._E, N_FEATURES), dtype=np.float32)
        self._ev_t = np.zeros(self._E, dtype=np.float64)
        self._ev_y = np.zeros(self._E, dtype=bool)
        self._ev_gap = np.zeros(self._E, dtype=np.float64)
        self._ev_zm = np.full(self._E, np.nan, dtype=np.float64)  # model log-odds at decision time
        self._ev_zf = np.zeros(self._E, dtype=np.float64)  # fallback log-odds at decision time
        self._n_events = 0
        self._evaluated_upto = 0  # events before this index are already scored for quality
        self._requests = 0
        # quality accumulators (bounded: most recent labelled, model-predicted events)
        self._q_keep = 200_000
        self._q_z: list[npt.NDArray[np.float64]] = []
        self._q_zf: list[npt.NDArray[np.float64]] = []
        self._q_y: list[npt.NDArray[np.bool_]] = []
        self._q_first: list[npt.NDArray[np.bool_]] = []
        self._windows = 0
        self._windows_beat = 0
        self._n_retrains = 0

    # ----------------------------------------------------------------- state helpers
    def _grow(self, need: int) -> None:
        size = self._ids.shape[0]
        if need <= size:
            return
        new = max(need, 2 * size)
        for name, fill in (
            ("_ids", 0),
            ("_parent", -1),
            ("_resident", False),
            ("_res_children", 0),
            ("_children", 0),
            ("_freq", 0),
            ("_last_ms", 0.0),
            ("_turn", 0),
            ("_last_event", -1),
            ("_cpos", -1),
            ("_leaf_pos", -1),
        ):
            old = getattr(self, name)
            arr = np.full(new, fill, dtype=old.dtype)
            arr[:size] = old
            setattr(self, name, arr)

    def _slots_for(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        get = self._slot.get
        out = np.empty(ids.shape[0], dtype=_I64)
        prev = -1
        for i, b in enumerate(ids.tolist()):
            s = get(b)
            if s is None:
                s = self._n_slots
                self._n_slots += 1
                if s >= self._ids.shape[0]:
                    self._grow(s + 1)
                self._slot[b] = s
                self._ids[s] = b
                self._parent[s] = prev
                if prev >= 0:
                    self._children[prev] += 1
            out[i] = s
            prev = s
        return out

    # ----------------------------------------------------------------- Policy API
    def contains(self, block: int) -> bool:
        s = self._slot.get(int(block))
        return s is not None and bool(self._resident[s])

    def __len__(self) -> int:
        return self._n_resident

    def _score(self, x: npt.NDArray[np.float64], age_ms: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        xa = with_age(x, age_ms)
        return self.model.predict_logit(xa) if self.model.trained else fallback_logit(xa)

    def access(self, req: Request) -> HitMask:
        now = float(req.timestamp_ms)
        ids = np.asarray(req.hash_ids, dtype=_I64)
        n = ids.shape[0]
        self._requests += 1
        if n == 0:
            self._maybe_retrain(now)
            return np.zeros(0, dtype=bool)
        slots = self._slots_for(ids)
        freq = self._freq[slots]
        unseen = np.flatnonzero(freq == 0)
        known = int(unseen[0]) if unseen.size else n
        if known > 0:
            deep = slots[known - 1]
            turn, turn_last = int(self._turn[deep]), float(self._last_ms[deep])
        else:
            turn, turn_last = 0, float("nan")
        x = request_features(
            now_ms=now,
            input_length=req.input_length,
            output_length=req.output_length,
            block_tokens=req.block_tokens,
            known_blocks=known,
            turn=turn,
            turn_last_ms=turn_last,
            freq=freq,
            last_ms=self._last_ms[slots],
            children=self._children[slots],
        )
        xa = with_age(x, np.zeros(n))
        zf = fallback_logit(xa)
        z = self.model.predict_logit(xa) if self.model.trained else zf
        self._record_events(slots, freq, x, z, zf, now)
        self._freq[slots] = freq + 1
        self._last_ms[slots] = now
        new = freq == 0
        if new.any():
            self._turn[slots[new]] = turn + 1
        hit = self._resident[slots].copy()
        self._serve(slots, hit, x, z, now)
        self._maybe_retrain(now)
        return hit

    # ----------------------------------------------------------------- planner
    def _leaf_add(self, s: int) -> None:
        if self._leaf_pos[s] < 0:
            self._leaf_pos[s] = len(self._leaves)
            self._leaves.append(s)

    def _leaf_remove(self, s: int) -> None:
        i = int(self._leaf_pos[s])
        if i >= 0:
            last = self._leaves.pop()
            if last != s:
                self._leaves[i] = last
                self._leaf_pos[last] = i
            self._leaf_pos[s] = -1

    def _serve(
        self,
        slots: npt.NDArray[np.int64],
        hit: npt.NDArray[np.bool_],
        x: npt.NDArray[np.float64],
        z: npt.NDArray[np.float64],
        now: float,
    ) -> None:
        res = self._resident
        rc = self._res_children
        sl = slots.tolist()
        for i in np.flatnonzero(hit).tolist():  # refresh the features kept for resident blocks
            self._cx[self._cpos[sl[i]]] = x[i]
        if self.capacity_blocks <= 0:
            return
        miss = np.flatnonzero(~hit)
        if miss.size == 0:
            return
        parent = self._parent
        pin = set(sl)
        pool: list[tuple[float, int]] | None = None
        for i in range(int(miss[0]), len(sl)):
            s = sl[i]
            p = int(parent[s])
            if res[s] or (p >= 0 and not res[p]):
                break  # keep the resident set prefix-closed
            if self._n_resident >= self.capacity_blocks:
                if pool is None or not pool:
                    pool = self._candidate_pool(pin, now)
                if not pool:
                    break  # everything resident is pinned by this request
                if z[i] <= pool[0][0]:
                    break  # bypass: the newcomer is the least likely to return
                self._evict(heapq.heappop(pool)[1], pool, pin, now)
            res[s] = True
            self._n_resident += 1
            c = self._free.pop()
            self._cpos[s] = c
            self._cx[c] = x[i]
            if p >= 0:
                if rc[p] == 0:
                    self._leaf_remove(p)
                rc[p] += 1
            self._leaf_add(s)

    def _candidate_pool(self, pin: set[int], now: float) -> list[tuple[float, int]]:
        leaves = self._leaves
        if len(leaves) <= self.pool_all:
            cand = [s for s in leaves if s not in pin]
        else:
            pick = self._rng.choice(len(leaves), size=self.pool_sample, replace=False)
            cand = [leaves[i] for i in sorted(pick.tolist()) if leaves[i] not in pin]
        if not cand:
            return []
        ca = np.asarray(cand, dtype=_I64)
        age = now - self._last_ms[ca]
        self._note_candidates(ca, age)
        sc = self._score(self._cx[self._cpos[ca]].astype(np.float64), age)
        pool = list(zip(sc.tolist(), cand, strict=True))
        heapq.heapify(pool)
        return pool

    def _evict(self, s: int, pool: list[tuple[float, int]], pin: set[int], now: float) -> None:
        res = self._resident
        rc = self._res_children
        res[s] = False
        self._n_resident -= 1
        self._leaf_remove(s)
        self._free.append(int(self._cpos[s]))
        self._cpos[s] = -1
        self._evicted.append(int(self._ids[s]))
        self._evict_age[self._n_evict_age % self._evict_age.shape[0]] = now - self._last_ms[s]
        self._n_evict_age += 1
        p = int(self._parent[s])
        if p >= 0:
            rc[p] -= 1
            if rc[p] == 0 and res[p]:
                self._leaf_add(p)
                if p not in pin:
                    age = np.array([now - self._last_ms[p]])
                    sc = self._score(self._cx[self._cpos[p]][None, :].astype(np.float64), age)
                    heapq.heappush(pool, (float(sc[0]), p))

    def _note_candidates(self, ca: npt.NDArray[np.int64], age: npt.NDArray[np.float64]) -> None:
        k = self._cand_ev.shape[0]
        m = min(ca.shape[0], 16)
        pos = (self._n_cand + np.arange(m)) % k
        self._cand_ev[pos] = self._last_event[ca[:m]]
        self._cand_age[pos] = age[:m]
        self._n_cand += m

    # ----------------------------------------------------------------- learning
    def _record_events(
        self,
        slots: npt.NDArray[np.int64],
        freq: npt.NDArray[np.int64],
        x: npt.NDArray[np.float64],
        z: npt.NDArray[np.float64],
        zf: npt.NDArray[np.float64],
        now: float,
    ) -> None:
        E = self._E
        # label the previous access of re-touched blocks (reuse within the horizon)
        prev = self._last_event[slots]
        live = (prev >= 0) & (prev > self._n_events - E)
        if live.any():
            pe = prev[live] % E
            gap = now - self._ev_t[pe]
            self._ev_gap[pe] = gap
            ok = gap <= self.horizon_ms
            self._ev_y[pe[ok]] = True
        n = slots.shape[0]
        ev = np.arange(self._n_events, self._n_events + n, dtype=_I64)
        pos = ev % E
        self._ev_x[pos] = x
        self._ev_t[pos] = now
        self._ev_y[pos] = False
        self._ev_gap[pos] = np.inf
        self._ev_zm[pos] = z if self.model.trained else np.nan
        self._ev_zf[pos] = zf
        self._last_event[slots] = ev
        self._n_events += n

    def _labelled_range(self, hi_cut: float) -> tuple[int, int]:
        """Event indices [lo, hi) with access time <= ``hi_cut`` (ms) that are still in the ring."""
        lo = max(0, self._n_events - self._E)
        # events are time-ordered: binary search over the ring window
        idx = np.arange(lo, self._n_events, dtype=_I64)
        t = self._ev_t[idx % self._E]
        hi = lo + int(np.searchsorted(t, hi_cut, side="right"))
        return lo, hi

    def _maybe_retrain(self, now: float) -> None:
        if self._requests % self.retrain_every != 0:
            return
        lo, hi = self._labelled_range(now - self.horizon_ms)
        if hi > lo:
            self._score_quality(max(lo, self._evaluated_upto), hi)
            self._evaluated_upto = hi
        hz = self.train_horizon_ms()
        lo, hi = self._labelled_range(now - hz)
        if hi <= lo:
            return
        # admission rows: recent accesses at age 0, label "next access within the horizon"
        start = max(lo, hi - 4 * self.max_train)
        idx = np.arange(start, hi, dtype=_I64)
        n_adm = self.max_train // 2
        if idx.size > n_adm:
            idx = np.sort(self._train_rng.choice(idx, size=n_adm, replace=False))
        ev = [idx]
        ages = [np.zeros(idx.size)]
        # eviction rows: leaves the planner actually scored, at the age it scored them
        k = min(self._n_cand, self._cand_ev.shape[0])
        if k:
            cev = self._cand_ev[:k]
            cage = self._cand_age[:k]
            live = cev > self._n_events - self._E
            cev, cage = cev[live], cage[live]
            ok = self._ev_t[cev % self._E] + cage + hz <= now
            cev, cage = cev[ok], cage[ok]
            if cev.size > self.max_train - idx.size:
                pick = np.sort(self._train_rng.choice(cev.size, size=self.max_train - idx.size, replace=False))
                cev, cage = cev[pick], cage[pick]
            ev.append(cev)
            ages.append(cage)
        evs = np.concatenate(ev)
        age = np.concatenate(ages)
        pos = evs % self._E
        gap = self._ev_gap[pos]
        ok = gap > age  # a candidate is by definition not yet reused at its age
        y = (gap <= age + hz)[ok]
        npos = int(y.sum())
        if npos < self.min_class or y.size - npos < self.min_class:
            return
        xa = with_age(self._ev_x[pos[ok]].astype(np.float64), age[ok])
        self.model.fit(xa, y)
        self._n_retrains += 1

    def train_horizon_ms(self) -> float:
        """Training label horizon, ms: the cache's own time scale (mean age of recently evicted blocks),
        bounded to [10 s, ``horizon_s``]; ``horizon_s`` until anything was evicted."""
        k = min(self._n_evict_age, self._evict_age.shape[0])
        if k == 0:
            return self.horizon_ms
        return float(np.clip(self._evict_age[:k].mean(), 10_000.0, self.horizon_ms))

    def _score_quality(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        pos = np.arange(lo, hi, dtype=_I64) % self._E
        zm = self._ev_zm[pos]
        m = ~np.isnan(zm)
        if not m.any():
            return
        y = self._ev_y[pos][m]
        zf = self._ev_zf[pos][m]
        zmm = zm[m]
        self._q_z.append(zmm)
        self._q_zf.append(zf)
        self._q_y.append(y)
        self._q_first.append(self._ev_x[pos, FEATURE_NAMES.index("first_touch")][m] > 0.5)
        a_m, a_f = auc(y, zmm), auc(y, zf)
        if a_m is not None and a_f is not None:
            self._windows += 1
            self._windows_beat += int(a_m > a_f)
        total = sum(len(a) for a in self._q_y)
        while total > self._q_keep and len(self._q_y) > 1:
            total -= len(self._q_y[0])
            for lst in (self._q_z, self._q_zf, self._q_y, self._q_first):
                lst.pop(0)

    # ----------------------------------------------------------------- reporting
    def quality(self) -> dict[str, Any]:
        """Out-of-sample quality of the predictor on accesses whose horizon has passed.

        Each access is scored by the model that was live when it was served, before its label existed.
        """
        if not self._q_y:
            return {"trained": self.model.trained, "retrains": self._n_retrains, "scored_accesses": 0}
        y = np.concatenate(self._q_y)
        z = np.concatenate(self._q_z)
        zf = np.concatenate(self._q_zf)
        first = np.concatenate(self._q_first)
        p = sigmoid(z)
        return {
            "trained": self.model.trained,
            "retrains": self._n_retrains,
            "scored_accesses": int(y.size),
            "positive_rate": float(y.mean()),
            "horizon_s": self.horizon_ms / 1000.0,
            "train_horizon_s": self.train_horizon_ms() / 1000.0,
            "auc": auc(y, z),
            "auc_first_touch": auc(y[first], z[first]),
            "auc_retouched": auc(y[~first], z[~first]),
            "fallback_auc": auc(y, zf),
            "brier": brier(y, p),
            "fallback_brier": brier(y, sigmoid(zf)),
            "reliability": reliability(y, p),
            "windows": self._windows,
            "windows_beat_fallback": self._windows_beat,
            "beat_fallback_rate": (self._windows_beat / self._windows) if self._windows else None,
        }

    def explain(self, block: int) -> dict[str, Any]:
        s = self._slot.get(int(block))
        if s is None:
            return {"known": False}
        e = int(self._last_event[s])
        out: dict[str, Any] = {
            "known": True,
            "resident": bool(self._resident[s]),
            "leaf": bool(self._res_children[s] == 0),
            "freq": int(self._freq[s]),
            "last_access_ms": float(self._last_ms[s]),
            "model_trained": self.model.trained,
        }
        if e >= 0 and e > self._n_events - self._E:
            pos = e % self._E
            x = self._ev_x[pos].astype(np.float64)
            out["features"] = dict(zip(FEATURE_NAMES, x.tolist(), strict=True))
            out["reuse_probability_at_access"] = float(sigmoid(self._score(x[None, :], np.zeros(1)))[0])
        return out
