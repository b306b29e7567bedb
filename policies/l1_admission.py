"""Second-sight admission for a cache layer's L1 (LMCache MP's DRAM tier), with a counterfactual guard.

Pure (no I/O): fed the chunk keys the engine stores, in order, it says which to drop from L1 and keeps two
simulated L1s over the same stream -- the layer's default (LRU, every stored chunk admitted) and LRU with
second-sight admission (a chunk seen for the first time is dropped from L1 right after its write; its L2
copy stays) -- so the sidecar can measure, online, whether acting pays.

Why second sight: on the conversation trace 82 % of the chunks are used once; an LRU L1 spends most of its
room on them. Dropping first-sight chunks keeps L1 for chunks that came back (a second look-up finds them in
L2 and the layer reloads them into L1 itself). In a trace-driven simulation of the layer's L1 at 5 % of the
distinct chunks this raises L1 hits by about a fifth; on a workload where every chunk is reused exactly once
it loses everything -- hence the guard.

Probation (``probation`` > 0, chunks): a first-sight chunk is not dropped at once but stays in L1 until
``probation`` newer first-sight chunks have arrived, and is dropped then only if it was not seen again in
the meantime (the small FIFO of S3-FIFO). Why: a chunk reused soon after its store (the next turn of a busy
conversation) keeps its L1 hit, and the wait is counted in chunks, not seconds, so it does not stretch or
shrink with the request rate -- a wait in seconds let first-sight chunks fill L1 at a fast pace (in the
calibrated simulator with the keeper's calibration hold, probation 32 gives +5.4 % L1 hits at 20
requests/s where dropping at once gives +1.2 %).

Cold-chain eviction (``cold_fill``, a share of capacity): the layer's own LRU decides which admitted chunks
leave L1 when it passes its watermark, by recency. In a conversation trace the next turn comes back after
the user's think time, so recency ranks a chain in its think-time peak below one just used. With
``cold_fill`` the core keeps a model of what the layer's L1 holds and, while it is fuller than ``cold_fill``
x capacity, also drops the chunks least likely needed next by
:class:`~kvtier.policies.chain_hazard.ChainHazard` (continuation rate by chain age, learned online). It
does not pay: on the live rig it was neutral counted on the model and 8 points worse counted from the
layer's reported occupancy, and the calibrated simulator, once it models the keeper's calibration hold,
agrees (5 points worse than probation 32 on the bundled trace; docs/perf/live_ab_lmcache_l1.md). The
keeper runs it only when configured. Cold
drops are not played into the simulated admission L1 (a plain LRU at full capacity that cannot model the
watermark they work around, so it would only count their cost): the measured guard, on the layer's own
counter, judges them.

Readmission by gap (``readmit_by_gap``): the caller loads a dropped chunk back into L1 at its second sight.
Whether that chunk is needed a third time depends on how long it was away: on the bundled trace 37 % of
the chunks back within 250 requests are used again, 8 % of those back after 300 or more.
:meth:`AdmissionCore.readmit_pays` asks :class:`~kvtier.policies.reuse_gap.ReuseByGap`, which learns that
rate per gap bin online, counting a third sight only if it came while the chunk would still be in L1: within
the simulated admission L1's eviction age (how long an untouched chunk stays there, followed online). In the
calibrated simulator it adds 2-6 points of L1 hits to probation 32 on the bundled trace and halves the
readmissions; on the synthetic workloads it moves them between -2.4 and +6.4 points.

Guard, two signals. (1) Simulated: every ``window`` observed chunk accesses the two simulated L1s' hit
counts are compared. When admission lost more than ``margin`` (relative to the default's hits, and at least
``min_gap`` chunks) the guard trips: the sidecar stops acting (shadow) while both simulations keep running;
it resumes after a window where admission won by the same margin. (2) Measured: the simulation is only a
model of the layer (it over-credited admission by ~10 points on the real stack), so the caller also feeds
the layer's own cumulative L1-hit counter (:meth:`AdmissionCore.measure`, chunks). Periods where the layer ran
its default calibrate ``k`` = real L1 hits / simulated default hits; in a period where the sidecar acted,
real L1 hits below ``k`` x simulated default hits by more than ``margin`` (and ``min_gap``) are measured
harm: the guard trips and holds shadow for a back-off of closed windows that doubles with each measured trip
(so a simulation that keeps saying "pays" cannot flap it straight back). Units: chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from kvtier.policies.chain_hazard import ChainHazard
from kvtier.policies.reuse_gap import ReuseByGap


class _Lru:
    """A bounded LRU set (capacity in chunks; a capacity change takes effect at the next insert). It also
    follows how long an entry stays untouched before it is evicted (``eviction_age``: an EWMA, in the
    caller's clock units, None before the first eviction)."""

    def __init__(self, capacity: int, age_alpha: float = 1 / 64) -> None:
        self.capacity = capacity
        self._d: OrderedDict[Hashable, int] = OrderedDict()  # key -> clock at its last touch
        self.age_alpha = age_alpha
        self.eviction_age: float | None = None

    def __contains__(self, k: Hashable) -> bool:
        return k in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Hashable]:
        """Oldest first (the next to go)."""
        return iter(self._d)

    def touch(self, k: Hashable, now: int = 0) -> None:
        self._d[k] = now
        self._d.move_to_end(k)
        while len(self._d) > max(self.capacity, 0):
            _, t = self._d.popitem(last=False)
            a = self.eviction_age
            self.eviction_age = float(now - t) if a is None else a + self.age_alpha * (now - t - a)

    def discard(self, k: Hashable) -> None:
        self._d.pop(k, None)


@dataclass(slots=True)
class GuardWindow:
    """One closed window: simulated L1 hits (chunks) of the default and of admission, and the verdict."""

    accesses: int
    default_hits: int
    admission_hits: int
    verdict: str  # "pays" | "harmful" | "neutral"


@dataclass
class AdmissionCore:
    """Second-sight admission + counterfactual guard (see module doc). ``capacity`` = L1 chunks."""

    capacity: int
    window: int = 512
    margin: float = 0.05
    min_gap: int = 8
    seen_max: int = 1 << 20
    probation: int = 0  # first-sight chunks that wait in L1 before the oldest unseen-again one is dropped
    cold_fill: float | None = None  # keep the modelled L1 under this share of capacity (cold chains go)
    readmit_by_gap: bool = False  # readmit a dropped chunk only if chunks back after its gap pay (see doc)
    cold_drops: int = 0  # chunks the cold-chain eviction chose (acting or not)
    acting: bool = True  # False while the guard holds the sidecar in shadow
    trips: int = 0
    resumes: int = 0
    windows_closed: int = 0
    windows: list[GuardWindow] = field(default_factory=list)
    _seen: OrderedDict[Hashable, tuple[int, int]] = field(default_factory=OrderedDict)  # last request, sights
    requests: int = 0  # requests observed (a prefill in pieces is one)
    last_gaps: dict[Hashable, int] = field(default_factory=dict)  # the latest call's second sights: gap
    _probation: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)  # first-sight, oldest first
    _default: _Lru = field(init=False)
    _admit: _Lru = field(init=False)
    _w_acc: int = 0
    _w_def: int = 0
    _w_adm: int = 0
    total_default_hits: int = 0
    total_admission_hits: int = 0
    # measured guard (see module doc): calibration factor k, back-off after a measured trip (windows)
    require_calibration: bool = False  # True: do not act before ``calib_periods`` measured default periods
    calib_periods: int = 2
    k_alpha: float = 0.5  # EWMA weight of the newest calibration period
    max_hold_windows: int = 64
    k: float | None = None
    calibrations: int = 0
    measured_trips: int = 0
    measured_periods: dict[str, int] = field(default_factory=dict)  # verdict -> periods
    last_period: dict[str, float | str] | None = None
    _hold: int = 0
    _backoff: int = 1
    _m_real: float | None = None  # cumulative real counter at the period start
    _m_def: int = 0  # cumulative simulated hits at the period start
    _m_adm: int = 0
    _m_acting: bool = True  # whether the sidecar acted at the period start
    _m_mixed: bool = False  # acting toggled inside the period

    def __post_init__(self) -> None:
        self._default = _Lru(self.capacity)
        self._admit = _Lru(self.capacity)
        self.hazard = ChainHazard() if self.cold_fill is not None else None
        self.reuse = ReuseByGap() if self.readmit_by_gap else None
        # cold-chain eviction's model of the layer's L1 (oldest first) and the chunks dropped from it
        self.l1_model: OrderedDict[Hashable, None] = OrderedDict()
        self.dropped_keys: OrderedDict[Hashable, None] = OrderedDict()
        self._occupancy: int | None = None  # the layer's L1 object count as last observed, then tracked
        if self.require_calibration:
            self.acting = False

    @property
    def on_probation(self) -> list[Hashable]:
        """First-sight chunks waiting out their probation, oldest first."""
        return list(self._probation)

    def set_occupancy(self, chunks: int) -> None:
        """The layer's L1 object count as just read (chunks). Cold-chain eviction then counts how far over
        its line L1 is from this reading, moved by the model's own additions and drops since, instead of from
        the model's size: the model cannot see what the layer evicted or never kept (a live stack's L1 ran
        30-50 chunks under the model), and each drop it makes on that error is a hit given away."""
        self._occupancy = max(0, int(chunks))

    def set_capacity(self, chunks: int) -> None:
        """The layer's L1 capacity as observed (chunks); both simulations follow it."""
        self.capacity = self._default.capacity = self._admit.capacity = max(1, int(chunks))

    def observe(
        self,
        keys: Iterable[Hashable],
        droppable: Container[Hashable] | None = None,
        *,
        continues: bool = False,
    ) -> list[Hashable]:
        """Chunks a request looked up and stored, root first -> the chunks to drop from L1 now (when acting):
        the first-sight ones (``probation`` 0), or those whose probation just ended unseen again; with
        ``cold_fill``, also the coldest admitted chunks while the modelled L1 is fuller than that.

        ``droppable``: the chunks this store wrote (default: all of ``keys``). A first-sight chunk outside
        it (a prefix the layer had before the sidecar saw it) is never dropped: both simulations admit it.
        ``continues``: ``keys`` are more of the previous call's prompt (its prefill in pieces), not a new
        request (the cold-chain ranking counts ages in requests)."""
        keys = list(keys)
        drop: list[Hashable] = []
        if not continues:
            self.requests += 1
        now = self.requests
        self.last_gaps = {}
        for k in keys:
            self._w_acc += 1
            if k in self._default:
                self._w_def += 1
                self.total_default_hits += 1
            if k in self._admit:
                self._w_adm += 1
                self.total_admission_hits += 1
            self._default.touch(k, now)
            prev = self._seen.get(k)
            first = prev is None
            if prev is not None and prev[1] == 1 and prev[0] < now:
                self.last_gaps[k] = now - prev[0]
                if self.reuse is not None:
                    self.reuse.observe_second_sight(now, k, now - prev[0])
            elif prev is not None and self.reuse is not None:
                self.reuse.observe_sight(now, k)
            if first and (droppable is None or k in droppable):
                if self.probation > 0:
                    self._admit.touch(k, now)  # in L1 while on probation
                    self._probation[k] = None
                else:
                    self._admit.discard(k)
                    drop.append(k)
            else:
                self._admit.touch(k, now)
                self._probation.pop(k, None)  # seen again while on probation: it stays
            self._seen[k] = (now, 1 if prev is None else prev[1] + (prev[0] < now))
            self._seen.move_to_end(k)
            if len(self._seen) > self.seen_max:
                self._seen.popitem(last=False)
            if self._w_acc >= self.window:
                self._close_window()
        if self.reuse is not None and self._admit.eviction_age is not None:
            # a reuse counts if it comes while the chunk would still be in L1: as long as chunks stay there
            self.reuse.horizon = max(1, round(self._admit.eviction_age))  # requests
        while len(self._probation) > self.probation:
            k, _ = self._probation.popitem(last=False)
            self._admit.discard(k)
            drop.append(k)
        if self.hazard is not None:
            drop += self._drop_cold(keys, droppable, drop, continues)
        return drop if self.acting else []

    @property
    def eviction_age(self) -> float | None:
        """How long a chunk stays untouched in the simulated admission L1 before it goes (requests, EWMA)."""
        return self._admit.eviction_age

    def readmit_pays(self, k: Hashable) -> bool:
        """Whether to load dropped chunk ``k`` back into L1 now that the latest :meth:`observe` saw it again
        (with ``readmit_by_gap``, only if chunks back after its gap are used again at least as often as the
        average second sight, :class:`~kvtier.policies.reuse_gap.ReuseByGap`; otherwise always)."""
        gap = self.last_gaps.get(k)
        if self.reuse is None or gap is None:
            return True
        return self.reuse.pays(self.requests, gap)

    def _drop_cold(
        self,
        keys: list[Hashable],
        droppable: Container[Hashable] | None,
        dropped: list[Hashable],
        continues: bool,
    ) -> list[Hashable]:
        """Cold-chain eviction: the layer's LRU drops the least recently used chunks when L1 passes its
        watermark; the chunks of a chain in its think-time peak are often among them. Keeping the modelled L1
        under ``cold_fill`` x capacity (just under LMCache's eviction watermark, 0.8) by dropping the chunks
        least likely needed next (:meth:`ChainHazard.coldest`) makes the ranking the sidecar's, not recency's.
        Chunks on probation and this request's are never chosen. Their L2 copies stay (the caller verifies).

        The model follows what the layer holds, not what admission would: a chunk this call stored is in
        L1; one seen before is in L1 only if it still was, or if the caller readmits it (a chunk the sidecar
        dropped comes back with the prefix through it); a chunk the layer's own LRU let go is served from L2
        without staying. ``dropped``: what this call already chose to drop."""
        assert self.hazard is not None and self.cold_fill is not None
        # the hazard's clock counts requests: a prompt's prefill in pieces is one
        self.hazard.observe(self.hazard.now + (0 if continues else 1), keys, continues=continues)
        l1, out = self.l1_model, self.dropped_keys
        before = len(l1)
        back = max((i for i, k in enumerate(keys) if k in out), default=-1)  # readmitted through here
        for i, k in reversed(list(enumerate(keys))):  # the layer's LRU order: a chain's tail least recent
            if i <= back or k in l1 or droppable is None or k in droppable:
                l1[k] = None
                l1.move_to_end(k)
                out.pop(k, None)
        for k in dropped:
            self._forget(k)
        while len(l1) > self.capacity:
            l1.popitem(last=False)
        if self._occupancy is not None:
            self._occupancy = max(0, self._occupancy + len(l1) - before)
        held = len(l1) if self._occupancy is None else self._occupancy
        over = held - int(self.cold_fill * self.capacity)
        if over <= 0:
            return []
        cold = self.hazard.coldest(l1, over, keep=self._probation)
        for k in cold:  # not taken out of the simulated admission L1: see the module doc
            self._forget(k)
        if self._occupancy is not None:
            self._occupancy = max(0, self._occupancy - len(cold))
        self.cold_drops += len(cold)
        return cold

    def _forget(self, k: Hashable) -> None:
        self.l1_model.pop(k, None)
        self.dropped_keys[k] = None
        if len(self.dropped_keys) > self.seen_max:
            self.dropped_keys.popitem(last=False)

    def _close_window(self) -> None:
        d, a = self._w_def, self._w_adm
        gap = max(self.min_gap, self.margin * d)
        verdict = "harmful" if a < d - gap else "pays" if a > d + gap else "neutral"
        self.windows.append(GuardWindow(self._w_acc, d, a, verdict))
        self.windows_closed += 1
        del self.windows[:-64]
        if self._hold > 0 and not self.acting:
            self._hold -= 1
        if self.acting and verdict == "harmful":
            self._set_acting(False)
            self.trips += 1
        elif not self.acting and verdict == "pays" and self._hold <= 0 and self._calibrated():
            self._set_acting(True)
            self.resumes += 1
        self._w_acc = self._w_def = self._w_adm = 0

    def _calibrated(self) -> bool:
        return not self.require_calibration or self.calibrations >= self.calib_periods

    def _set_acting(self, acting: bool) -> None:
        if acting != self.acting:
            self._m_mixed = True
        self.acting = acting

    def measure(self, real_l1_hit_chunks: float, layer_active: bool = True) -> str:
        """Close a measurement period at the layer's cumulative L1-hit counter (chunks) -> its verdict.

        ``layer_active``: whether the sidecar's mode let the keeper act during the period (mode ``active``).
        Verdicts: ``start`` (first reading), ``mixed`` (acting toggled: not judged), ``reset`` (the counter
        went back: layer restarted), ``too_few`` (fewer than ``min_gap`` simulated default hits),
        ``calibrated`` (a default period: ``k`` updated), ``uncalibrated`` (acted before any calibration),
        ``pays`` / ``neutral`` / ``harmful`` (acted: real hits against ``k`` x simulated default hits)."""
        acted = self._m_acting and self.acting and layer_active
        mixed = self._m_mixed or self._m_acting != (self.acting and layer_active)  # toggled in the period
        real0, d0, a0 = self._m_real, self._m_def, self._m_adm
        self._m_real, self._m_def, self._m_adm = (
            real_l1_hit_chunks,
            self.total_default_hits,
            self.total_admission_hits,
        )
        self._m_acting, self._m_mixed = self.acting and layer_active, False
        if real0 is None:
            return self._period("start", 0.0, 0, 0)
        real, sim_d, sim_a = (
            real_l1_hit_chunks - real0,
            self.total_default_hits - d0,
            self.total_admission_hits - a0,
        )
        if real < 0:
            return self._period("reset", 0.0, 0, 0)
        if mixed:
            return self._period("mixed", real, sim_d, sim_a)
        if sim_d < self.min_gap:
            return self._period("too_few", real, sim_d, sim_a)
        if not acted:
            ratio = real / sim_d
            self.k = ratio if self.k is None else (1 - self.k_alpha) * self.k + self.k_alpha * ratio
            self.calibrations += 1
            harmful = bool(self.windows) and self.windows[-1].verdict == "harmful"
            if self.require_calibration and self.calibrations == self.calib_periods and self._hold <= 0:
                # calibrated: start acting, unless the simulation's last window says admission loses here
                # (a trip: a simulated "pays" window resumes it)
                if not harmful:
                    self._set_acting(True)
                else:  # the guard's verdict, counted as its fall-back to shadow
                    self.trips += 1
                self._m_acting, self._m_mixed = self.acting and layer_active, False
            return self._period("calibrated", real, sim_d, sim_a)
        if self.k is None:
            return self._period("uncalibrated", real, sim_d, sim_a)
        expected = self.k * sim_d
        gap = max(self.min_gap, self.margin * expected)
        verdict = "harmful" if real < expected - gap else "pays" if real > expected + gap else "neutral"
        if verdict == "harmful":
            self._set_acting(False)
            self._m_acting, self._m_mixed = False, False
            self.trips += 1
            self.measured_trips += 1
            self._hold = self._backoff
            self._backoff = min(2 * self._backoff, self.max_hold_windows)
        elif verdict == "pays":
            self._backoff = 1
        return self._period(verdict, real, sim_d, sim_a, expected)

    def _period(
        self, verdict: str, real: float, sim_d: int, sim_a: int, expected: float | None = None
    ) -> str:
        self.measured_periods[verdict] = self.measured_periods.get(verdict, 0) + 1
        self.last_period = {"verdict": verdict, "real_l1_hit_chunks": real, "simulated_default_hits": sim_d,
                            "simulated_admission_hits": sim_a}  # fmt: skip
        if expected is not None:
            self.last_period["expected_default_l1_hit_chunks"] = expected
        return verdict

    def status(self) -> dict[str, object]:
        last = self.windows[-1] if self.windows else None
        return {
            "acting": self.acting,
            "capacity_chunks": self.capacity,
            "trips": self.trips,
            "resumes": self.resumes,
            "cold_fill": self.cold_fill,
            "cold_drops": self.cold_drops,
            "admission_l1_eviction_age_requests": self.eviction_age,
            "readmission_by_gap": None if self.reuse is None else self.reuse.status(),
            "l1_reported_chunks": self._occupancy,  # as last read, moved by the core's own stores and drops
            "simulated_l1_hits": {"default": self.total_default_hits, "admission": self.total_admission_hits},
            "measured": {
                "k_real_per_simulated_default": self.k,
                "calibrations": self.calibrations,
                "trips": self.measured_trips,
                "hold_windows": self._hold,
                "periods": dict(self.measured_periods),
                "last_period": self.last_period,
            },
            "last_window": None
            if last is None
            else {
                "accesses": last.accesses,
                "default_hits": last.default_hits,
                "admission_hits": last.admission_hits,
                "verdict": last.verdict,
            },  # fmt: skip
        }
