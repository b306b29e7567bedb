"""``learned``: reuse predictor + prefix-closed planner (admission by bypass, leaf-first eviction).

The predictor models the log-odds that a block is accessed again within the horizon ``h`` given its
last access's features ``x`` and its age ``a`` as ``f(x) - a / tau``: ``f`` is a binned logistic
model (a GAM) and ``tau`` (seconds) a learned linear age coefficient. Ranking resident blocks by their
current odds is then ranking by the *static* key ``f(x) + t / tau`` (t = last access, seconds), so a
heap serves eviction. Eviction pops the smallest key among resident leaves only (never a block whose
child stays resident; the in-flight request's blocks are ancestors of the block being inserted), so the
resident set stays prefix-closed. Admission is a bypass: a missed block is inserted and, if it is itself
the smallest key, dropped again with the rest of the request.

Experts: full-size shadow caches serve every request too -- the learned planner alone at recency scales
``tau x learned_mults`` (default x0.1, x1), the same planner keyed by the fixed heuristic (the fallback's
log-odds and time scale) at ``heuristic_mults`` (default x16: the frequency-weighted expert; the model's
labels lag by the horizon, so a model-keyed x16 ranked by a regime that was over), and the classic
policies named in ``experts`` (default ARC). The real cache follows the one with a significant paired
lead in prefix-hit tokens (>= ``switch_margin`` x) over a decayed window; on a switch it keeps its
contents and from then on ranks by its own key (the followed keyed expert's; while a classic expert is
followed, that of the keyed expert with the most recent tokens, ``classic_key`` "best") plus
``lead_bias`` log-odds for the blocks the new leader holds (a soft preference: a block the leader
dropped can still outrank a leader-held one with much lower odds, so a short-lived or noisy lead costs
little; no block appears without a miss).

Features: the base columns of ``kvtier.policies.features`` plus ``extra_features`` (default: time since
the block's first access, and first touch x log distinct blocks seen, which enters raw so its slope
extrapolates past the label lag).

Causal: a training row is (features of an access, age a) -> "next access in (a, a + h]", used only
once ``a + h`` has passed; ``h`` and the ages follow the cache's own time scale (ages of recently
evicted blocks). Until the first fit, a heuristic (tail penalty, frequency bonus, ``tau`` = 60 s) is
used. Refit every ``retrain_every`` requests on a bounded seeded sample. Pure, no I/O; numpy state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.policies.base import HitMask, Policy, Request, prefix_tokens
from kvtier.policies.features import (
    EXTRA_FEATURES,
    FEATURE_NAMES,
    RAW_ONLY_FEATURES,
    FeatureRing,
    request_features,
)
from kvtier.policies.heuristic import HeuristicPredictor
from kvtier.policies.keyed_planner import KeyedPlanner
from kvtier.policies.predictor import BinnedLogit, auc, brier, reliability, sigmoid, sigmoid32
from kvtier.policies.slot_expert import make_expert
from kvtier.policies.slotmap import LogitCache, SlotMap, grown_size

_I64 = np.int64
# re-touch columns on by default (docs/perf/learned.md): the block's age since its first access, and
# first touch x log(distinct blocks seen), a raw linear term that carries the drift of first-touch reuse
# past the horizon the labels lag by; log_gap2_s stays optional
DEFAULT_EXTRA_FEATURES: tuple[str, ...] = ("log_life_s", "first_log_seen")
DEFAULT_EXPERTS = ("arc",)  # classic policies shadowed at full size as experts next to the learned planner
# recency scales of the planners keyed by the model, and of those keyed by the fixed heuristic (the
# fallback). The frequency-weighted expert (x16) is heuristic-keyed: the model's labels lag by the horizon,
# so a model-keyed x16 ranked by a regime that was over
DEFAULT_LEARNED_MULTS: tuple[float, ...] = (0.1, 1.0)
DEFAULT_HEURISTIC_MULTS: tuple[float, ...] = (16.0,)
_REKEY_CHUNK = 16384  # rows per model call when re-keying every resident block after a refit
_LEAD_BIAS = 3.0  # log-odds added to the real cache's key of a block the followed expert holds
# training sample: drawn from the last 4 x max_train access events -- recent enough to follow drift, wide
# enough that the seeded sample is not only the newest burst
_TRAIN_WINDOW_MULT = 4
# share of training rows aged like recently evicted blocks (the rest at age 0): the one model answers both
# the admission question (age 0) and the eviction question (age of a block about to be dropped)
_EVICT_AGE_SHARE = 0.5
# the age column enters the fit in units of 100 s (ages are in ms): on the features' scale, so the fit's L2
# penalty does not shrink the age coefficient more than the others
_AGE_SCALE_MS = 100_000.0
# bounds of the fitted recency scale tau, s: below 1 s it is noise; 1e6 s (~12 days) means "age is irrelevant"
_TAU_MIN_S, _TAU_MAX_S = 1.0, 1e6
# tau_mode "evict": tau = a quarter of the horizon (ms of horizon per s of tau)
_EVICT_TAU_DIV = 4000.0
# log-odds of a block whose last access fell out of the event ring (P ~ 5e-5): ranked as cold
_COLD_LOGIT = -10.0
# the heuristic's recency scale (ms): the model's tau until the first fit, and the heuristic experts' for good
_HEURISTIC_TAU_MS = 60_000.0


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
        max_train: int = 16000,
        min_class: int = 200,
        tau_mode: str = "gap",
        experts: tuple[str, ...] = DEFAULT_EXPERTS,
        learned_mults: tuple[float, ...] = DEFAULT_LEARNED_MULTS,
        switch_every: int = 100,
        switch_margin: float = 1.005,
        switch_z: float = 0.5,
        recency_mult: float = 1.0,
        expert_decay: float = 0.998,
        event_buffer: int = 1 << 18,
        lead_bias: float = _LEAD_BIAS,
        home_z: float | None = None,
        extra_features: tuple[str, ...] = DEFAULT_EXTRA_FEATURES,
        heuristic_mults: tuple[float, ...] = DEFAULT_HEURISTIC_MULTS,
        classic_key: str = "best",
        return_z: float | None = 1.0,
        return_within: int = 1500,
    ) -> None:
        super().__init__(capacity_blocks, seed=seed)
        unknown = [f for f in extra_features if f not in EXTRA_FEATURES]
        if unknown:
            raise ValueError(f"learned: unknown extra features {unknown} (known: {EXTRA_FEATURES})")
        # optional re-touch columns, appended after the base features in EXTRA_FEATURES order
        self._extra = tuple(f for f in EXTRA_FEATURES if f in extra_features)
        self.feature_names = FEATURE_NAMES + self._extra
        self.horizon_ms = horizon_s * 1000.0
        self.retrain_every = retrain_every
        self.max_train = max_train
        self.min_class = min_class
        self.tau_mode = tau_mode
        self.switch_every = switch_every
        self.switch_margin = switch_margin
        self.switch_z = switch_z
        self.expert_decay = expert_decay
        self.lead_bias = lead_bias
        if classic_key not in ("keep", "best"):
            raise ValueError(f"learned: classic_key must be 'keep' or 'best', not {classic_key!r}")
        self.classic_key = classic_key
        # evidence (standard errors) needed to leave the starting expert; None: switch_z like any other
        self.home_z = switch_z if home_z is None else home_z
        # anti-whipsaw: going back to the expert left at the last switch, within
        # ``return_within`` requests of that switch, needs ``return_z`` (None: no extra bar)
        self.return_z = return_z
        self.return_within = return_within
        self._left = -1  # the expert left at the last switch
        self._left_at = 0  # request of that switch
        # the prior until the first fit, and the key of the heuristic-keyed experts: log-odds and tau 60 s
        self.heuristic = HeuristicPredictor(tau_ms=_HEURISTIC_TAU_MS)
        self.tau_s = self.heuristic.tau_s
        self._train_rng = np.random.default_rng(seed + 1)
        raw = tuple(self.feature_names.index(f) for f in self._extra if f in RAW_ONLY_FEATURES)
        lin = (FEATURE_NAMES.index("log_freq"), *raw)
        self.model = BinnedLogit(seed=seed, linear_cols=lin, raw_only=raw)
        # block state, indexed by dense slot (block id -> slot: a compact numpy hash map)
        cap0 = 1024
        self._slot = SlotMap(cap0)
        # the static key f(x) + t / c of each slot's last access (t its time, c = ms per unit of log-odds
        # decay): P(reuse) at ``now`` is sigmoid(key - now / c), for reuse_probability
        self._kcache = LogitCache()
        self._k_c: float | None = None
        self._ids = np.zeros(cap0, dtype=_I64)
        self._parent = np.full(cap0, -1, dtype=np.int32)  # slots fit int32 (_grow checks)
        self._children = np.zeros(cap0, dtype=np.int32)  # <= number of slots
        self._freq = np.zeros(cap0, dtype=_I64)
        self._last_ms = np.zeros(cap0, dtype=np.float64)
        self._first_ms = np.zeros(cap0, dtype=np.float64)  # first access (for the extra features)
        self._prev_ms = np.zeros(cap0, dtype=np.float64)  # the access before the last one
        self._turn = np.zeros(cap0, dtype=_I64)
        self._last_event = np.full(cap0, -1, dtype=_I64)
        self._n_slots = 0
        self._seen_before = 0
        # experts, each a full-size shadow cache over the same stream: 0 is the learned planner on its own,
        # then the classic policies named in ``experts``. The real cache follows the best recent one.
        self._keyed = [KeyedPlanner(capacity_blocks, m, cap0) for m in learned_mults] + [
            KeyedPlanner(capacity_blocks, m, cap0, heuristic=True) for m in heuristic_mults
        ]
        self._classic = [make_expert(e, capacity_blocks, seed, cap0) for e in experts if capacity_blocks > 0]
        self.expert_names = (
            ["learned" if m == 1.0 else f"learned-tau-x{m:g}" for m in learned_mults]
            + [f"heuristic-x{m:g}" for m in heuristic_mults]
            + [e for e in experts if capacity_blocks > 0]
        )
        self._any_heuristic = bool(heuristic_mults)
        self._n_keyed = len(self._keyed)
        # membership of each classic expert's resident set, per slot (advisory: it only biases eviction)
        self._member = [np.zeros(cap0, dtype=bool) for _ in self._classic]
        self._biased = np.zeros(cap0, dtype=bool)  # the real cache's key of this slot carries lead_bias
        self._lead = learned_mults.index(recency_mult) if recency_mult in learned_mults else 0
        self._home = self._lead  # the starting expert (the model's own time scale by default)
        # the real cache is the leading learned expert itself until the first switch (see _maybe_alias)
        aliased = (
            bool(self._keyed)
            and self._keyed[self._lead].mult == recency_mult
            and not self._keyed[self._lead].heuristic
        )
        self._real = self._keyed[self._lead] if aliased else KeyedPlanner(capacity_blocks, recency_mult, cap0)
        self._switches = 0
        # paired expert statistics over the same requests (decayed): per-expert prefix-hit tokens S, and
        # pairwise differences D[i, j] = sum(h_i - h_j) and their squares Q[i, j]
        k = len(self.expert_names)
        self._ex_S = np.zeros(k)
        self._ex_D = np.zeros((k, k))
        self._ex_Q = np.zeros((k, k))
        # per-request expert tokens, folded into the statistics every window (or when the buffer is full)
        self._tok_buf = np.zeros((min(switch_every, 1024), k))
        self._n_buf = 0
        self._last_tok_row = -1  # the row of the last request served with blocks (-1: none yet)
        self._since_check = 0  # requests since the last switch check
        self.switch_log: list[dict[str, Any]] = []  # every switch: request, from/to expert, scores, z
        self._views()
        self._evict_age = np.zeros(4096, dtype=np.float64)  # ages (ms) of recently evicted blocks
        self._n_evict_age = 0
        # ring of past accesses (features + outcome) for training and self-evaluation
        self._E = event_buffer
        # reads as float32 features (int16 for the small-int columns)
        self._ev_x = FeatureRing(self._E, len(self.feature_names))
        self._ev_t = np.zeros(self._E, dtype=np.float64)
        self._ev_y = np.zeros(self._E, dtype=bool)
        self._ev_gap = np.zeros(self._E, dtype=np.float64)
        self._ev_zm = np.full(self._E, np.nan, dtype=np.float64)  # model log-odds at decision time
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
        self._last_now = 0.0  # time of the last request served, ms
        self._t_max = 0.0  # latest request time so far, ms (every last access is at or before it)

    # ----------------------------------------------------------------- state helpers
    def _grow(self, need: int) -> None:
        size = self._ids.shape[0]
        if need <= size:
            return
        new = grown_size(size, need)
        if new > np.iinfo(np.int32).max:
            raise OverflowError("learned: more than 2**31 - 1 block slots")
        for name, fill in (
            ("_ids", 0),
            ("_parent", -1),
            ("_children", 0),
            ("_freq", 0),
            ("_last_ms", 0.0),
            ("_first_ms", 0.0),
            ("_prev_ms", 0.0),
            ("_turn", 0),
            ("_last_event", -1),
        ):
            old = getattr(self, name)
            arr = np.full(new, fill, dtype=old.dtype)
            arr[:size] = old
            setattr(self, name, arr)
        for pl in self._planners():
            pl.grow(new)
        for ex in self._classic:
            ex.grow(new)
        for i, m in enumerate(self._member):
            arr = np.zeros(new, dtype=bool)
            arr[:size] = m
            self._member[i] = arr
        arr = np.zeros(new, dtype=bool)
        arr[:size] = self._biased
        self._biased = arr
        self._views()

    def _views(self) -> None:
        """Memoryviews over the per-block arrays: fast scalar access in the planner's Python loops."""
        self._v_par = self._parent.data

    def _slots_for(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Dense slots of a request's blocks, allocating new ones in request order (one probing pass); a
        new block's parent is the request's previous block."""
        idl = ids.tolist()
        s0 = self._n_slots
        got, m = self._slot.get_or_assign(idl, s0)
        out = np.array(got, dtype=_I64)
        if m == 0:
            return out
        if s0 + m > self._ids.shape[0]:
            self._grow(s0 + m)
        self._n_slots = s0 + m
        k = len(idl) - m
        if got[k] == s0 and (k == 0 or max(got[:k]) < s0):
            # the usual tree case: a known prefix, then a suffix of never-seen blocks (set up in bulk)
            self._ids[s0 : s0 + m] = ids[k:]
            prev = got[k - 1] if k > 0 else -1
            self._parent[s0] = prev
            self._parent[s0 + 1 : s0 + m] = out[k:-1]
            self._children[s0 : s0 + m - 1] += 1
            if prev >= 0:
                self._children[prev] += 1
            return out
        # general case (a known block after a new one, or a block repeated within the request)
        prev, nxt = -1, s0
        for b, s in zip(idl, got, strict=True):
            if s == nxt:  # first occurrence of a new block
                nxt += 1
                self._ids[s] = b
                self._parent[s] = prev
                if prev >= 0:
                    self._children[prev] += 1
            prev = s
        return out

    # ----------------------------------------------------------------- Policy API
    def contains(self, block: int) -> bool:
        s = self._slot.get(int(block))
        return s >= 0 and bool(self._real.resident[s])

    def contains_many(self, block_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Vectorised :meth:`contains`."""
        slots = self._slot.get_many(block_ids)
        return (slots >= 0) & self._real.resident[np.maximum(slots, 0)]

    def __len__(self) -> int:
        return self._real.n_resident

    @property
    def blocks_seen(self) -> int:
        """Distinct blocks the policy keeps per-block state for (grows until a restart; blocks)."""
        return len(self._slot)

    @property
    def followed_expert(self) -> str:
        """Name of the expert the real cache follows now (one of :attr:`expert_names`)."""
        return self.expert_names[self._lead]

    def last_expert_tokens(self) -> npt.NDArray[np.float64]:
        """Prefix-hit tokens each expert (:attr:`expert_names` order) got on the last request with blocks
        (a new array; zeros before the first). Read it before the next :meth:`access`."""
        if self._last_tok_row < 0:
            return np.zeros(len(self.expert_names))
        return self._tok_buf[self._last_tok_row].copy()

    def stored_features(self, n_rows: int) -> npt.NDArray[np.float64]:
        """The last ``n_rows`` access feature rows kept for training, oldest first, as the event ring reads
        them back (float32 / int16 precision); columns :attr:`feature_names`. A new array. Raises
        ``ValueError`` for more rows than the ring holds."""
        held = min(self._n_events, self._E)
        if not 0 <= n_rows <= held:
            raise ValueError(f"learned: {n_rows} feature rows asked, the event ring holds {held}")
        e = np.arange(self._n_events - n_rows, self._n_events) % self._E
        return self._ev_x[e]

    @property
    def handoff_blocks(self) -> int:
        """Blocks the real cache holds that the followed expert does not (the hand-off to it still to be
        paid by misses; blocks)."""
        n = self._n_slots
        return int(np.count_nonzero(self._real.resident[:n] & ~self._lead_member()[:n]))

    def access(self, req: Request) -> HitMask:
        now = float(req.timestamp_ms)
        self._last_now = now
        self._t_max = max(self._t_max, now)
        ids = np.asarray(req.hash_ids, dtype=_I64)
        n = ids.shape[0]
        self._requests += 1
        if n == 0:
            self._maybe_retrain(now)
            return np.zeros(0, dtype=bool)
        self._seen_before = self._n_slots  # distinct blocks seen before this request
        slots = self._slots_for(ids)
        freq = self._freq[slots]
        new = freq == 0
        known = int(new.argmax()) if new.any() else n
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
            extra_cols=len(self._extra),
        )
        if self._extra:
            x = self._with_extras(x, slots, freq, now)
        trained = self.model.trained
        z = self.model.predict_logit(x) if trained else self.heuristic.log_odds(x)
        self._record_events(slots, x, z, now)
        if self._k_c is not None:  # P(reuse) is asked for (the controller's tick): memoise the fresh
            version, key_of = self._key_memo()  # keys here, on the feeding path, not in the tick
            self._kcache.warm(slots, self._last_event[slots], version, key_of)
        self._freq[slots] = freq + 1
        if known < n:
            self._turn[slots[new]] = turn + 1
        # heuristic-keyed planners use the fallback's log-odds and time scale, whatever the model
        zh = self.heuristic.log_odds(x) if self._any_heuristic and trained else z
        rh = self._real.heuristic
        tau_real = self.heuristic.tau_s if rh else self.tau_s
        base = (zh if rh else z) + now / 1000.0 / (tau_real * self._real.mult)
        toks = self._tok_buf[self._n_buf]
        dropped: list[int] | npt.NDArray[np.int64] = []
        aliased = self._aliased()
        hit = np.zeros(0, dtype=bool)
        ev: list[int] = []
        # the learned planner on its own, at each recency scale
        for i, pl in enumerate(self._keyed):
            lost: list[int] = []
            if pl.mult == self._real.mult and pl.heuristic == rh:
                b = base
            elif pl.heuristic:
                b = zh + now / 1000.0 / (self.heuristic.tau_s * pl.mult)
            else:
                b = z + now / 1000.0 / (self.tau_s * pl.mult)
            h = pl.serve(slots, b, self._v_par, lost if i == self._lead else None)
            toks[i] = prefix_tokens(req, pl.n_lead)
            if i == self._lead:
                dropped = lost
                if aliased:
                    hit, ev = h, lost
        nk = self._n_keyed
        # classic experts see the request by dense slot (a bijection of block ids): what they evict is
        # a slot already, no reverse lookup; ARC runs natively on slots (SlotARC)
        for i, ex in enumerate(self._classic):
            h, es = ex.serve(req, slots)
            toks[nk + i] = prefix_tokens(req, ex.n_lead)
            mem = self._member[i]
            mem[slots] = True
            if len(es):
                mem[es] = False
                if nk + i == self._lead:
                    dropped = es
        if not aliased:
            # the real cache: its learned key + lead_bias (log-odds) on the blocks the leader holds
            lead_in = self._lead_member()
            lb = self.lead_bias
            if len(dropped):
                d = np.asarray(dropped, dtype=_I64)
                d = d[self._biased[d]]
                self._biased[d] = False
                self._real.unbias(d, lb, exact=True)
            li = lead_in[slots]
            self._biased[slots] = li
            hit = self._real.serve(slots, base + lb * li, self._v_par, ev)
        if ev:
            es = np.asarray(ev, dtype=_I64)
            self._evicted.extend(self._ids[es].tolist())
            k = self._evict_age.shape[0]
            self._evict_age[(self._n_evict_age + np.arange(es.size)) % k] = now - self._last_ms[es]
            self._n_evict_age += es.size
        if self._extra:
            self._first_ms[slots[new]] = now
            self._prev_ms[slots] = self._last_ms[slots]
        self._last_ms[slots] = now
        self._last_tok_row = self._n_buf
        self._n_buf += 1
        self._since_check += 1
        if self._n_buf == self._tok_buf.shape[0] or self._since_check == self.switch_every:
            self._fold_expert_stats()
        if self._since_check == self.switch_every:
            self._since_check = 0
            if len(toks) > 1:
                self._follow_leader()
                self._maybe_alias()
        self._maybe_retrain(now)
        return hit

    def _with_extras(
        self,
        x: npt.NDArray[np.float64],
        slots: npt.NDArray[np.int64],
        freq: npt.NDArray[np.int64],
        now: float,
    ) -> npt.NDArray[np.float64]:
        """``x`` with its last columns filled with the selected :data:`EXTRA_FEATURES` (state before this
        request), in place."""
        j = x.shape[1] - len(self._extra)
        for name in self._extra:
            if name == "log_life_s":
                c = np.log1p(np.maximum(now - self._first_ms[slots], 0.0) / 1000.0)
                c[freq == 0] = -1.0
            elif name == "first_log_seen":
                c = (freq == 0) * np.log1p(self._seen_before / 1000.0)
            else:  # "log_gap2_s"
                c = np.log1p(np.maximum(now - self._prev_ms[slots], 0.0) / 1000.0)
                c[freq < 2] = -1.0
            x[:, j] = c
            j += 1
        return x

    def _fold_expert_stats(self) -> None:
        """Fold the buffered per-request expert tokens into the decayed paired statistics (exactly the
        per-request recurrence ``X = decay * X + x``, applied to the window at once)."""
        m = self._n_buf
        if m == 0:
            return
        self._n_buf = 0
        t = self._tok_buf[:m]
        r = self.expert_decay
        w = r ** np.arange(m - 1, -1, -1, dtype=np.float64)
        rm = r**m
        wt = w @ t
        d = t[:, :, None] - t[:, None, :]
        self._ex_S = rm * self._ex_S + wt
        self._ex_D = rm * self._ex_D + (wt[:, None] - wt[None, :])
        self._ex_Q = rm * self._ex_Q + np.einsum("i,iab->ab", w, d * d)

    def _aliased(self) -> bool:
        """Is the real cache the followed learned expert itself (same object)?"""
        return self._lead < self._n_keyed and self._real is self._keyed[self._lead]

    def _maybe_alias(self) -> None:
        """Once the real cache holds exactly what the followed learned expert holds (same recency scale),
        both would decide alike from now on: serve one object for both (halves the planner work)."""
        if self._lead >= self._n_keyed or self._aliased():
            return
        ex = self._keyed[self._lead]
        n = self._n_slots
        if (
            ex.mult == self._real.mult
            and ex.heuristic == self._real.heuristic
            and np.array_equal(ex.resident[:n], self._real.resident[:n])
        ):
            self._real = ex

    def _lead_member(self) -> npt.NDArray[np.bool_]:
        """Per-slot membership of the followed expert's resident set."""
        nk = self._n_keyed
        return self._keyed[self._lead].resident if self._lead < nk else self._member[self._lead - nk]

    def _planners(self) -> list[KeyedPlanner]:
        """The real cache and the learned experts, each object once."""
        return list({id(p): p for p in (self._real, *self._keyed)}.values())

    def _follow_leader(self) -> None:
        """Follow an expert that was *significantly* better than the current one over the recent window.

        All experts serve the same requests, so their per-request prefix-hit tokens are paired: expert j
        replaces the current expert c only if over the decayed window it got more tokens by
        ``switch_margin`` and the paired lead is ``switch_z`` standard errors above zero
        (``D[j, c] / sqrt(Q[j, c])``; ``home_z`` while c is the starting expert, so leaving the model's
        own time scale can take more evidence than coming back to it). This is the hysteresis: noise on
        short traces does not switch. Going back to the expert left at the last switch, within
        ``return_within`` requests of it, needs ``return_z`` standard errors (else a one-window lead
        of the old expert otherwise reverses a switch whose hand-off is still being paid, and the
        switch forward again pays it twice).
        The real cache keeps its contents (hand-off): from now on blocks the new leader holds get
        ``lead_bias`` extra log-odds in its key, so it drifts towards the leader's set by its own misses,
        never by teleporting blocks. Its own key becomes the new leader's (model or heuristic, and its
        recency scale); for a classic leader (no key of its own), with ``classic_key`` "best", that of
        the keyed expert with the most recent tokens ("keep": unchanged, the round-10 behaviour).
        """
        c = self._lead
        best, best_z = -1, self.home_z if c == self._home else self.switch_z
        back = self._left if self._requests - self._left_at <= self.return_within else -1
        for j in range(len(self.expert_names)):
            if j == c or self._ex_S[j] <= self.switch_margin * self._ex_S[c]:
                continue
            q = self._ex_Q[j, c]
            zj = self._ex_D[j, c] / np.sqrt(q) if q > 0 else 0.0
            if j == back and self.return_z is not None and zj < self.return_z:
                continue  # the expert just left: a short lead back to it is the whipsaw, not a regime
            if zj > best_z:
                best, best_z = j, zj
        if best < 0:
            return
        self.switch_log.append(
            {
                "request": self._requests,
                "from": self.expert_names[c],
                "to": self.expert_names[best],
                "from_score": float(self._ex_S[c]),
                "to_score": float(self._ex_S[best]),
                "z": float(best_z),
            }
        )
        if self._aliased():
            self._real = self._real.copy()  # the real cache gets its own state again
        self._left, self._left_at = c, self._requests
        self._lead = best
        if best < self._n_keyed:
            self._real.mult = self._keyed[best].mult
            self._real.heuristic = self._keyed[best].heuristic
        elif self.classic_key == "best" and self._n_keyed:
            # following a classic expert: the real cache's own key (under the leader's bias) is that of
            # the keyed expert with the most recent tokens, the one closest to the regime the leader wins
            kb = int(np.argmax(self._ex_S[: self._n_keyed]))
            self._real.mult = self._keyed[kb].mult
            self._real.heuristic = self._keyed[kb].heuristic
        self._switches += 1
        self._rekey([self._real])

    # ----------------------------------------------------------------- learning
    def _record_events(
        self,
        slots: npt.NDArray[np.int64],
        x: npt.NDArray[np.float64],
        z: npt.NDArray[np.float64],
        now: float,
    ) -> None:
        E = self._E
        # label the previous access of re-touched blocks (reuse within the horizon)
        prev = self._last_event[slots]
        live = prev > max(self._n_events - E, -1)
        if live.any():
            pe = prev[live] % E
            gap = now - self._ev_t[pe]
            self._ev_gap[pe] = gap
            self._ev_y[pe[gap <= self.horizon_ms]] = True
        n = slots.shape[0]
        p0 = self._n_events % E
        pos: slice | npt.NDArray[np.int64]
        pos = slice(p0, p0 + n) if p0 + n <= E else np.arange(p0, p0 + n, dtype=_I64) % E
        self._ev_x[pos] = x
        self._ev_t[pos] = now
        self._ev_y[pos] = False
        self._ev_gap[pos] = np.inf
        self._ev_zm[pos] = z if self.model.trained else np.nan
        self._last_event[slots] = np.arange(self._n_events, self._n_events + n, dtype=_I64)
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
        self._retrain(now)

    @property
    def retrains(self) -> int:
        """Model refits so far (a version number: memoised scores and quality change only when it does)."""
        return self._n_retrains

    def retrain(self, now_ms: float | None = None) -> bool:
        """Score and refit now (normally every ``retrain_every`` requests), as of ``now_ms`` (default: the
        last request's time). Causal like the periodic refit. Returns whether a model was fitted."""
        before = self._n_retrains
        self._retrain(self._last_now if now_ms is None else max(float(now_ms), self._last_now))
        return self._n_retrains > before

    def reuse_probability(
        self, block_ids: npt.ArrayLike, now_ms: float | None = None
    ) -> npt.NDArray[np.float32]:
        """P(block accessed again within the horizon) as of ``now_ms`` (default: the last request's time),
        per id: the log-odds ``f(x) - age / tau`` of the block's last access. NaN where the policy cannot
        score (never seen, or its last access fell out of the event ring). float32."""
        return self.reuse_probability_slots(self.slots_of(block_ids), now_ms)

    def slots_of(self, block_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Dense slot per block id, -1 = never seen. A slot never changes once assigned, so callers may
        cache it and use :meth:`reuse_probability_slots`."""
        return self._slot.get_many(block_ids)

    def reuse_probability_slots(
        self, slots: npt.NDArray[np.int64], now_ms: float | None = None
    ) -> npt.NDArray[np.float32]:
        """:meth:`reuse_probability` by slot (-1 = unknown block: NaN), in float32 (as the controller holds
        P). The log-odds ``f(x) - max(0, now - t) / c`` of the slot's last access (at ``t``; ``c`` = ms
        per unit of log-odds decay) are ``key - max(now, t) / c`` with the static ``key = f(x) + t / c``,
        memoised per slot until it is accessed again, the model changes (or ``c``: the keys are rescaled
        in one pass). The tick scores ~100k+ slots at 1M blocks: one gather, a subtraction and a float32
        sigmoid each."""
        slots = np.asarray(slots, dtype=_I64).ravel()
        m = slots.shape[0]
        if m == 0:
            return np.full(0, np.nan, np.float32)
        if int(slots.min()) >= 0:
            ev = self._last_event[slots]
        else:
            ev = np.where(slots >= 0, self._last_event[np.maximum(slots, 0)], -1)
        ok = ev > max(self._n_events - self._E, -1)  # seen, and its last access still in the ring
        n_ok = int(np.count_nonzero(ok))
        if n_ok == 0:
            return np.full(m, np.nan, np.float32)
        s_ok = slots if n_ok == m else slots[ok]
        a = self._static_keys(s_ok, ev if n_ok == m else ev[ok])  # a fresh array (gather)
        c = float(self._k_c)  # type: ignore[arg-type]  # set by _static_keys
        now = self._last_now if now_ms is None else float(now_ms)
        if now >= self._t_max:  # no access after ``now``: max(now, t) = now for every slot
            a -= now / c
        else:
            a -= np.maximum(now, self._last_ms[s_ok]) / c
        p = sigmoid32(a)
        if n_ok == m:
            return p
        out = np.full(m, np.nan, np.float32)
        out[ok] = p
        return out

    def _key_scale_ms(self) -> float:
        """ms of age per unit of log-odds decay in the real cache's key (tau x its recency multiplier)."""
        return 1000.0 * self.tau_s * self._real.mult

    def _static_keys(
        self, slots: npt.NDArray[np.int64], ev: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        """``f(x) + t / c`` of ``slots``' last access events ``ev`` (memoised)."""
        version, key_of = self._key_memo()
        return self._kcache.get(slots, ev, version, key_of)

    def _key_memo(
        self,
    ) -> tuple[tuple[int, bool, int], Callable[[npt.NDArray[np.int64]], npt.NDArray[np.float64]]]:
        """The static keys' memo version and how a missing key is computed; a new ``c`` (e.g. after an
        expert switch) first rescales the live entries instead of re-running the model on them."""
        c, old, E = self._key_scale_ms(), self._k_c, self._E
        version = self._score_version()
        if old is not None and c != old:

            def rescale(k: npt.NDArray[np.float64], e: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
                t = self._ev_t[e % E]
                return (k - t / old) + t / c

            self._kcache.remap(version, self._n_events - E + 1, rescale)
        self._k_c = c

        def key_of(e: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
            return self._logit_of_events(e) + self._ev_t[e % E] / c

        return version, key_of

    def warm_scores(self) -> int:
        """Fill the memo behind :meth:`reuse_probability_slots` for the resident blocks (after a refit
        every entry is stale; call this off the latency-critical path). Returns the entries computed."""
        res = np.flatnonzero(self._real.resident[: self._n_slots])
        ev = self._last_event[res]
        ok = ev > max(self._n_events - self._E, -1)
        version, key_of = self._key_memo()
        return self._kcache.warm(res[ok], ev[ok], version, key_of)

    def _score_version(self) -> tuple[int, bool, int]:
        return (id(self.model), self.model.trained, self._n_retrains)

    def _logit_of_events(self, ev: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """The current model's (or the fallback's) log-odds of stored access events ``ev``."""
        x = np.asarray(self._ev_x[ev % self._E], dtype=np.float64)  # (the ring reads float64 already)
        return self.model.predict_logit(x) if self.model.trained else self.heuristic.log_odds(x)

    def _retrain(self, now: float) -> None:
        lo, hi = self._labelled_range(now - self.horizon_ms)
        if hi > lo:
            self._score_quality(max(lo, self._evaluated_upto), hi)
            self._evaluated_upto = hi
        hz = self.train_horizon_ms()
        lo, hi = self._labelled_range(now - hz)
        if hi <= lo:
            return
        start = max(lo, hi - _TRAIN_WINDOW_MULT * self.max_train)
        idx = np.arange(start, hi, dtype=_I64)
        if idx.size > self.max_train:
            idx = np.sort(self._train_rng.choice(idx, size=self.max_train, replace=False))
        pos = idx % self._E
        t = self._ev_t[pos]
        gap = self._ev_gap[pos]
        # half the rows at age 0 (admission), half at ages of recently evicted blocks (eviction)
        age = np.zeros(idx.size)
        k = min(self._n_evict_age, self._evict_age.shape[0])
        if k:
            half = self._train_rng.random(idx.size) < _EVICT_AGE_SHARE
            age[half] = self._evict_age[self._train_rng.integers(0, k, size=int(half.sum()))]
        ok = (gap > age) & (t + age + hz <= now)  # not yet reused at that age; label final
        y = (gap <= age + hz)[ok]
        npos = int(y.sum())
        if npos < self.min_class or y.size - npos < self.min_class:
            return
        self.model.fit(self._ev_x[pos[ok]].astype(np.float64), y, extra=(age[ok] / _AGE_SCALE_MS)[:, None])
        self._n_retrains += 1
        beta = float(self.model.extra_coef[0]) / (_AGE_SCALE_MS / 1000.0)  # log-odds per second of age
        if self.tau_mode == "learned":
            self.tau_s = float(np.clip(-1.0 / beta, _TAU_MIN_S, _TAU_MAX_S)) if beta < 0 else _TAU_MAX_S
        elif self.tau_mode == "evict":
            self.tau_s = hz / _EVICT_TAU_DIV
        else:  # "gap": mean observed reuse gap within the horizon
            g = gap[(gap <= hz)]
            self.tau_s = float(np.clip(g.mean() / 1000.0, 1.0, hz / 1000.0)) if g.size else self.tau_s
        self._rekey([p for p in self._planners() if not p.heuristic])  # heuristic keys do not change

    def _rekey(self, planners: list[KeyedPlanner]) -> None:
        """Recompute resident blocks' keys with the current model and tau (from stored access features)."""
        n = self._n_slots
        mask = np.zeros(n, dtype=bool)
        for pl in planners:
            mask |= pl.resident[:n]
        res = np.flatnonzero(mask)
        z = np.full(n, _COLD_LOGIT)  # a block whose access fell out of the ring: treat as cold
        zh = np.full(n, _COLD_LOGIT)  # the same for the heuristic-keyed planners
        need_m = any(not pl.heuristic for pl in planners)
        need_h = any(pl.heuristic for pl in planners)
        if res.size:
            ev = self._last_event[res]
            live = ev > self._n_events - self._E
            ev, res = ev[live], res[live]
            for i in range(0, ev.shape[0], _REKEY_CHUNK):  # bounded temporaries (features, bins)
                e = ev[i : i + _REKEY_CHUNK]
                if need_m:
                    z[res[i : i + _REKEY_CHUNK]] = self._logit_of_events(e)
                if need_h:
                    zh[res[i : i + _REKEY_CHUNK]] = self.heuristic.log_odds(self._ev_x[e % self._E])
        last_s = self._last_ms[:n] / 1000.0
        for pl in planners:
            own = pl is self._real and not self._aliased()
            bias = None
            if own:
                lm = self._lead_member()[:n]
                self._biased[:n] = lm
                bias = np.where(lm, self.lead_bias, 0.0)
            if pl.heuristic:
                pl.rekey(zh, last_s, self.heuristic.tau_s, bias)
            else:
                pl.rekey(z, last_s, self.tau_s, bias)

    def train_horizon_ms(self) -> float:
        """Training label horizon, ms: the cache's own time scale (mean age of recently evicted blocks),
        bounded to [``horizon_s``, 2 x ``horizon_s``]; ``horizon_s`` until anything was evicted."""
        k = min(self._n_evict_age, self._evict_age.shape[0])
        if k == 0:
            return self.horizon_ms
        return float(np.clip(self._evict_age[:k].mean(), self.horizon_ms, 2.0 * self.horizon_ms))

    def _score_quality(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        pos = np.arange(lo, hi, dtype=_I64) % self._E
        zm = self._ev_zm[pos]
        m = ~np.isnan(zm)
        if not m.any():
            return
        y = self._ev_y[pos][m]
        zf = self.heuristic.log_odds(self._ev_x[pos][m].astype(np.float64))  # the heuristic's, same rows
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
        self._fold_expert_stats()
        experts = {
            "recency_mult": self._real.mult,
            "expert": self.expert_names[self._lead],
            "expert_switches": self._switches,
            "expert_scores": {n: float(v) for n, v in zip(self.expert_names, self._ex_S, strict=True)},
        }
        if not self._q_y:
            return {
                "trained": self.model.trained,
                "retrains": self._n_retrains,
                "scored_accesses": 0,
                **experts,
            }
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
            "tau_s": self.tau_s,
            **experts,
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
        if s < 0:
            return {"known": False}
        e = int(self._last_event[s])
        out: dict[str, Any] = {
            "known": True,
            "resident": bool(self._real.resident[s]),
            "leaf": bool(self._real.res_children[s] == 0),
            "key": float(self._real.key[s]),
            "expert": self.expert_names[self._lead],
            "held_by_expert": bool(self._lead_member()[s]),
            "freq": int(self._freq[s]),
            "last_access_ms": float(self._last_ms[s]),
            "model_trained": self.model.trained,
        }
        if e >= 0 and e > self._n_events - self._E:
            pos = e % self._E
            x = self._ev_x[pos].astype(np.float64)
            out["features"] = dict(zip(self.feature_names, x.tolist(), strict=True))
            xx = x[None, :]
            zz = self.model.predict_logit(xx) if self.model.trained else self.heuristic.log_odds(xx)
            out["reuse_probability_at_access"] = float(sigmoid(zz)[0])
        return out
