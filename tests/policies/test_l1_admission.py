"""Second-sight admission and its guard (pure): wins where most chunks are used once, trips where not."""

from __future__ import annotations

from kvtier.policies.l1_admission import AdmissionCore


def _scan_plus_hot(core: AdmissionCore, n: int) -> None:
    """Each request: 4 hot chunks (2 groups alternating: 8 hot in all) + 12 never-seen-again chunks."""
    u = 10_000
    for i in range(n):
        hot = [i % 2 * 4 + j for j in range(4)]
        scan = list(range(u, u + 12))
        u += 12
        core.observe(hot + scan)


def test_admission_beats_lru_when_most_chunks_are_used_once() -> None:
    c = AdmissionCore(24, window=256)
    _scan_plus_hot(c, 400)
    assert c.total_admission_hits > 1.5 * c.total_default_hits
    assert c.acting and c.trips == 0


def test_first_sight_chunks_are_dropped_second_sight_kept() -> None:
    c = AdmissionCore(10)
    assert c.observe(["a", "b"]) == ["a", "b"]
    assert c.observe(["a", "c"]) == ["c"]


def test_probation_drops_first_sight_chunks_only_after_n_newer_ones_and_keeps_those_seen_again() -> None:
    c = AdmissionCore(100, probation=2)
    assert c.observe(["a", "b"]) == []  # on probation: a, b
    assert c.observe(["a", "c", "d"]) == ["b"]  # a seen again (kept for good); c, d push b out
    assert c.observe(["e"]) == ["c"]
    assert c.observe(["a", "f", "g", "h"]) == ["d", "e", "f"]  # a never; the rest in arrival order
    assert "a" not in c.observe(list("ijklmn"))


def test_probation_drops_only_chunks_the_store_wrote() -> None:
    """A first-sight chunk outside ``droppable`` (a prefix the layer had before the sidecar saw it) is
    admitted in both simulations and never returned; with probation 0 droppable chunks go at once."""
    assert AdmissionCore(10).observe(["p", "x", "y"], droppable={"x", "y"}) == ["x", "y"]
    c = AdmissionCore(10, probation=1)
    assert c.observe(["p", "x", "y"], droppable={"x", "y"}) == ["x"]
    assert c.observe(["p", "z"], droppable={"z"}) == ["y"]
    assert c.total_admission_hits == c.total_default_hits == 1  # p hit in both simulated L1s


def test_probation_keeps_a_chunk_reused_soon_after_its_store_where_second_sight_loses_it() -> None:
    """Each prompt's chunks come back with the very next prompt, then never: dropping at first sight loses
    every one of those hits in the simulated admission L1, a probation longer than a prompt keeps them."""
    at_once, probation = AdmissionCore(64, window=10**6), AdmissionCore(64, window=10**6, probation=16)
    for i in range(100):
        prompt = list(range(i * 8, i * 8 + 8))
        for c in (at_once, probation):
            c.observe(prompt)
            c.observe(prompt)
    assert at_once.total_admission_hits == 0
    assert probation.total_admission_hits == probation.total_default_hits == 800


def test_guard_trips_when_every_chunk_comes_back_exactly_once_and_resumes() -> None:
    c = AdmissionCore(64, window=128)
    base = 0
    for i in range(200):  # prompt i, then prompt i-4 again: LRU hits all repeats, admission none
        c.observe(list(range(base + i * 8, base + i * 8 + 8)))
        if i >= 4:
            c.observe(list(range(base + (i - 4) * 8, base + (i - 4) * 8 + 8)))
    assert c.trips == 1 and not c.acting
    assert c.observe(list(range(10**6, 10**6 + 4))) == []  # held in shadow: nothing to drop
    assert "harmful" in [w.verdict for w in c.windows]
    c.set_capacity(24)
    _scan_plus_hot(c, 400)  # the workload changes: admission would pay again
    assert c.resumes >= 1 and c.acting


def test_capacity_follows_the_layer() -> None:
    c = AdmissionCore(100)
    c.set_capacity(3)
    c.observe([1, 2, 3, 4, 1, 2, 3, 4])
    assert c.total_default_hits == 0  # LRU of 3 over a cycle of 4 never hits


def _near_far(core: AdmissionCore, n: int, start: list[int] = [10**5]) -> None:  # noqa: B006 - a counter
    """Each request: 4 chunks of 2 alternating groups (LRU keeps them), 4 of 5 rotating groups (LRU at 36
    chunks loses them, admission keeps them) and 8 never-seen-again chunks: the default hits, admission
    hits twice as much."""
    for i in range(n):
        hot = [i % 2 * 4 + j for j in range(4)] + [100 + i % 5 * 4 + j for j in range(4)]
        core.observe(hot + list(range(start[0], start[0] + 8)))
        start[0] += 8


def _calibrated(k: float = 0.8) -> tuple[AdmissionCore, float]:
    """A core that needs calibration, calibrated over two default periods where the layer's real L1 hits
    were ``k`` x the simulated default's; returns it with the real counter so far (chunks)."""
    c = AdmissionCore(36, window=256, require_calibration=True)
    real = 0.0
    assert c.measure(real) == "start"
    for _ in range(2):
        assert c.observe(list(range(10**6, 10**6 + 4))) == []  # not acting while calibrating
        d0 = c.total_default_hits
        _near_far(c, 100)
        real += k * (c.total_default_hits - d0)
        assert c.measure(real) == "calibrated"
    assert c.acting and c.k is not None and abs(c.k - 0.8) < 1e-9 and c.calibrations == 2
    return c, real


def test_measured_guard_calibrates_on_default_periods_before_acting() -> None:
    c, _ = _calibrated()
    assert c.observe([10**7]) == [10**7]  # acting now: a first sight is dropped


def test_calibration_does_not_start_acting_where_the_simulation_says_admission_loses() -> None:
    """Every prompt comes back once, four prompts later (admission loses every hit): calibrated, the keeper
    stays in shadow; when the workload turns to one where admission pays, a simulated window resumes it."""
    c = AdmissionCore(128, window=128, require_calibration=True)
    real = 0.0
    assert c.measure(real) == "start"
    for period in range(2):
        d0 = c.total_default_hits
        for i in range(period * 60, period * 60 + 60):
            c.observe(list(range(i * 8, i * 8 + 8)))
            if i >= 4:
                c.observe(list(range((i - 4) * 8, (i - 4) * 8 + 8)))
        real += c.total_default_hits - d0
        assert c.measure(real) == "calibrated"
    assert c.windows[-1].verdict == "harmful"
    assert c.calibrations == 2 and not c.acting and c.trips == 1 and c.resumes == 0
    c.set_capacity(24)
    _scan_plus_hot(c, 400)
    assert c.acting and c.resumes >= 1


def test_measured_guard_keeps_acting_while_the_real_counter_pays() -> None:
    c, real = _calibrated()
    d0 = c.total_default_hits
    _near_far(c, 100)
    real += 1.3 * 0.8 * (c.total_default_hits - d0)  # 30 % more real L1 hits than the default would get
    assert c.measure(real) == "pays" and c.acting and c.trips == 0


def test_measured_harm_trips_even_when_the_simulation_says_pays_and_backs_off() -> None:
    c, real = _calibrated()
    holds = []
    for _ in range(2):
        d0 = c.total_default_hits
        _near_far(c, 100)  # the simulation credits admission (it pays in every window) ...
        assert c.windows[-1].verdict == "pays"
        real += 0.5 * 0.8 * (c.total_default_hits - d0)  # ... but the layer really lost half its L1 hits
        assert c.measure(real) == "harmful" and not c.acting
        holds.append(c.status()["measured"]["hold_windows"])  # type: ignore[index]
        closed = c.windows_closed
        while not c.acting:  # held: the simulated "pays" windows only resume after the back-off
            _near_far(c, 10)
        held = c.windows_closed - closed
        assert held == holds[-1], (held, holds)  # resumes at the window that ends the hold
        c.measure(real)  # the period of the resume is mixed: not judged
    assert holds == [1, 2] and c.measured_trips == 2 and c.resumes == 2


def test_measured_guard_skips_periods_it_cannot_judge() -> None:
    c, real = _calibrated()
    assert c.measure(real) == "too_few"  # nothing simulated since the last reading
    assert c.measure(real - 5) == "reset"  # the layer restarted: its counter went back
    _near_far(c, 100)
    assert c.measure(real + 1, layer_active=False) == "mixed"  # the mode left active within the period
    d0 = c.total_default_hits
    _near_far(c, 100)
    assert c.measure(real + 1 + 0.9 * (c.total_default_hits - d0), layer_active=False) == "calibrated"
    assert c.k is not None and abs(c.k - 0.85) < 1e-9 and c.trips == 0


def _conversations(i: int, sent: dict[int, list[int]]) -> list[int]:
    """Request ``i``: even -> a new conversation (3 chunks after a shared first one); odd -> its next turn,
    20 or 21 requests after the previous one (the user's think time): never sooner, never later."""
    if i % 2 == 0 or i < 21:
        return [0, *range(100 * i + 1, 100 * i + 4)]
    if i % 3 == 0 and i - 20 in sent:
        return [*sent[i - 20], 50_000 + i]  # a third turn, 20 requests after the second
    return [*sent[i - 21], 60_000 + i]  # a second turn, 21 requests after the first


def test_cold_fill_drops_the_chain_least_likely_continued_not_the_least_recent() -> None:
    """Conversations come back 20-21 requests later, never sooner: the learned rate is 0 at ages 0-15 and
    past 31. Over the fill line the core drops the chains past 31 and then the young ones, and keeps those
    aged 16-31 (about to be continued) -- which the layer's LRU, oldest first, would drop before the young."""
    c = AdmissionCore(10_000, probation=0, cold_fill=0.1, window=1 << 20)
    sent: dict[int, list[int]] = {}
    for i in range(160):  # learn (L1 large enough: nothing dropped cold)
        sent[i] = _conversations(i, sent)
        c.observe(sent[i])
    assert c.cold_drops == 0
    last_user = c.hazard.last_user if c.hazard else {}
    age = {k: 159 - last_user[k] for k in c.l1_model}
    old = [k for k, a in age.items() if a >= 32]
    peak = [k for k, a in age.items() if 16 <= a < 32]
    young = [k for k, a in age.items() if 0 < a < 16]
    assert old and peak and len(young) > 10
    nxt = _conversations(160, sent)
    over = len(old) + 10  # the LRU would take the old, then 10 of the peak
    c.set_capacity(10 * (len(c.l1_model) + len(nxt) - over))  # fill line (0.1 x) ``over`` lower
    drops = set(c.observe(nxt))
    assert drops >= set(old) and not drops & set(peak) and len(drops & set(young)) >= 5
    assert 0 not in drops  # the latest request's (its shared first chunk) stay


def test_cold_fill_never_drops_the_latest_request_nor_probation_and_counts_in_shadow() -> None:
    c = AdmissionCore(40, probation=8, cold_fill=0.25, require_calibration=True)
    assert not c.acting  # shadow until calibrated: nothing returned, the decisions still counted
    prev: list[str] = []
    for i in range(20):  # each request repeats the previous one's chunks (admitted) and adds 4
        chain = [*prev, *(f"r{i}.{j}" for j in range(4))]
        assert c.observe(chain) == []
        prev = chain[-4:]
    assert c.cold_drops > 0 and len(c.l1_model) <= 10 + 8
    c.acting = True
    chain = [*prev, "x0", "x1", "x2", "x3"]
    drops = c.observe(chain)
    assert drops and not set(drops) & set(chain) and not set(drops) & set(c.on_probation)


def test_cold_fill_models_readmission_of_a_dropped_chunk() -> None:
    c = AdmissionCore(4, probation=0, cold_fill=0.5)
    assert c.observe(["a", "b"]) == ["a", "b"]  # first sight: dropped (the model follows)
    assert "a" not in c.l1_model and "a" in c.dropped_keys
    c.observe(["a", "b", "c"])  # second sight of a dropped prefix: the caller readmits a, b
    assert "a" in c.l1_model and "b" in c.l1_model and "a" not in c.dropped_keys


def test_cold_fill_counts_from_the_layers_observed_occupancy_not_the_model() -> None:
    """The model holds every admitted chunk; the layer reported fewer (it evicted some the model cannot
    see): the core drops only what takes the reported count, moved by its own stores since, over the line."""
    c = AdmissionCore(100, probation=0, cold_fill=0.5)
    for i in range(40):  # 40 prompts of 2 chunks, each seen twice: 80 admitted chunks in the model
        chain = [f"p{i}.0", f"p{i}.1"]
        c.observe(chain)
        c.observe(chain)
    assert len(c.l1_model) == 50 and c.cold_drops == 30  # no reading yet: the model's size counts
    c.set_occupancy(40)  # the layer holds 40
    before = c.cold_drops
    for i in range(40, 45):  # 5 more prompts admitted: 10 chunks -> 50, on the line
        c.observe([f"p{i}.0", f"p{i}.1"])
        c.observe([f"p{i}.0", f"p{i}.1"])
    assert c.cold_drops == before  # the model's 60 would have dropped 10
    c.observe(["q.0", "q.1"])  # first sight (dropped at once with probation 0): L1 unchanged
    assert c.cold_drops == before
    c.observe(["p45.0", "p45.1", "p45.2", "p45.3"])
    c.observe(["p45.0", "p45.1", "p45.2", "p45.3"])  # 4 more: 4 over the line
    assert c.cold_drops == before + 4


def test_cold_fill_drops_a_chains_tail_before_its_head() -> None:
    """The layer credits L1 only with the leading run of a prompt it holds (LMCache MP's look-up counter):
    a chain cut at its head leaves its tail in L1 unused. So the model orders a chain as the layer's LRU
    does, tail least recent, and a partial cold drop takes the tail first."""
    c = AdmissionCore(100, probation=0, cold_fill=0.06)
    chain = [f"c.{j}" for j in range(6)]
    c.observe(chain)
    c.observe(chain)  # second sight: admitted, 6 chunks, on the line (0.06 x 100)
    assert c.cold_drops == 0
    c.observe(["d.0", "d.1"])
    assert c.observe(["d.0", "d.1"]) == ["c.5", "c.4"]  # 2 over the line: the older chain's tail


def test_readmission_by_gap_declines_chunks_back_after_gaps_that_are_not_used_again() -> None:
    """Chunks back 3 requests after their first sight are used a third time; chunks back after 300 are not.
    Once the core has seen that (labels matured over the horizon), it declines to readmit the long-gap kind
    and still readmits the short-gap kind; without ``readmit_by_gap`` it readmits every one."""
    on, off = AdmissionCore(64, probation=1, readmit_by_gap=True), AdmissionCore(64, probation=1)
    script: dict[int, list[str]] = {}
    for j in range(600):  # chunk s{j}: requests j, j+3, j+5; chunk l{j}: requests j, j+300
        for t, k in ((j, f"s{j}"), (j + 3, f"s{j}"), (j + 5, f"s{j}"), (j, f"l{j}"), (j + 300, f"l{j}")):
            script.setdefault(t, []).append(k)
    for t in range(max(script) + 1):
        for c in (on, off):
            c.observe(script.get(t, [f"pad{t}"]))
        if t == 302:  # long gaps seen, none matured yet: every one is readmitted
            assert on.last_gaps == {"s299": 3, "l2": 300} and on.readmit_pays("l2")
        if t == 602:
            assert on.last_gaps == {"s599": 3, "l302": 300}
            assert on.readmit_pays("s599") and not on.readmit_pays("l302")
            assert off.readmit_pays("s599") and off.readmit_pays("l302")
            assert on.reuse is not None and on.reuse.horizon == round(on.eviction_age or -1) < 300
    assert on.status()["readmission_by_gap"] is not None and off.status()["readmission_by_gap"] is None
