"""The tick's fast paths give exactly what the straightforward code gave: the heuristic predictor (vs the
masked-store formula), the observe phase's block sizes, and the policy's P(reuse) overwrite (in place only
when the predictor hands over a new array)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.heuristic import _FREQ_TERM, HeuristicPredictor
from kvtier.policies.index import BlockIndex


def _reference(index: BlockIndex, n: int, now_ms: float, tau_ms: float) -> np.ndarray:
    p = _FREQ_TERM[np.minimum(index.freq[:n], len(_FREQ_TERM) - 1)]
    age = np.maximum(np.subtract(np.float64(now_ms), index.last_access[:n], dtype=np.float32), 0.0)
    tau = np.maximum(index.gap_ewma[:n] * np.float32(4.0), np.float32(4.0))
    tau[np.isnan(tau)] = np.float32(tau_ms)
    return p * np.exp(-(age / tau))


@pytest.mark.parametrize("tau_ms", [300_000.0, 12_345.678, 0.3, 1e30, float("inf")])
def test_heuristic_matches_the_reference_formula_exactly(tau_ms: float) -> None:
    rng = np.random.default_rng(7)
    n = 150_001  # > 2 chunks of the NaN fill, the last one partial
    idx = BlockIndex(initial_capacity=n)
    idx.freq[:n] = rng.integers(0, 100, n).astype(np.uint32)
    idx.last_access[:n] = rng.uniform(0, 4e6, n)
    g = rng.uniform(0, 2e5, n).astype(np.float32)
    g[rng.random(n) < 0.4] = np.nan  # never re-touched
    g[:5] = [0.0, np.inf, -np.inf, 1e-3, 3.0]
    idx.gap_ewma[:n] = g
    # (direct writes bypass the index's bookkeeping: its latest access time, which lets the predictor
    # skip the age clamp when no access is later than now; here some are, at 3.9e6)
    idx.last_access_max = float(idx.last_access[:n].max())
    pred = HeuristicPredictor(tau_ms=tau_ms)
    for now in (3.9e6, 4.2e6):
        want = _reference(idx, n, now, tau_ms)
        with_scratch = pred.predict(idx, n, now).copy()
        without = pred.predict_full(idx, n, now)
        assert with_scratch.dtype == np.float32
        assert np.array_equal(with_scratch.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(without.view(np.uint32), want.view(np.uint32))


def test_heuristic_incremental_rows_equal_the_full_formula_after_every_kind_of_change() -> None:
    """Between calls: touches (freq + gap change), a removed and re-stored slot, new rows (n grows), a
    request's chain, more touches than the index logs, a tau_ms change, another index object. Every call
    equals the reference bit for bit."""
    rng = np.random.default_rng(11)
    idx = BlockIndex(initial_capacity=1024)
    for b in range(1, 601):
        idx.store(b, b - 1 if b % 8 != 1 else None, 1, 65536, float(b))
    pred = HeuristicPredictor(tau_ms=300_000.0)
    now = 10_000.0

    def check(index: BlockIndex) -> None:
        n = index.n_rows
        got = pred.predict(index, n, now)
        want = _reference(index, n, now, pred.tau_ms)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))

    check(idx)
    idx.touch(5, now + 2_000.0)  # an access later than now: the ages must be clamped again
    check(idx)
    for _ in range(6):
        now += 1000.0
        for b in rng.integers(1, 601, 40).tolist():  # touches: freq and the gap EWMA move
            idx.touch(int(b), now - 500.0)
        check(idx)
    old = int(rng.integers(1, 601))
    idx.remove(old)  # frees the slot; a new block takes it over with freq 1 and no gap
    idx.store(10_001, None, 1, 65536, now)
    check(idx)
    for b in range(20_000, 20_400):  # new rows past the cached n
        idx.store(b, None, 2, 0, now)
    check(idx)
    idx.access_chain([1, 2, 3, 30_000, 30_001], now - 100.0)  # a request: touches and new blocks
    check(idx)
    for _ in range(70_000 // 600 + 1):  # more touches than the index's log holds: compare every row
        for b in range(1, 601):
            idx.touch(b, now)
        now += 1.0
    check(idx)
    pred.tau_ms = 12_345.0  # the NaN rows' tau changes
    check(idx)
    other = BlockIndex(initial_capacity=64)
    for b in range(1, 40):
        other.store(b, None, 1, 65536, float(b))
    check(other)
    check(idx)


def test_heuristic_reads_only_the_rows_the_index_logged_as_touched() -> None:
    """Between calls the predictor refreshes the rows in the index's touch log, not every row: a write
    to ``freq`` that bypasses the index's API is not seen until the row is touched."""
    idx = BlockIndex(initial_capacity=1024)
    for b in range(1, 501):
        idx.store(b, None, 1, 65536, float(b))
    pred = HeuristicPredictor(tau_ms=300_000.0)
    first = pred.predict(idx, 500, 1000.0).copy()
    idx.freq[7] = 50  # not through the index: no log entry
    idx.touch(int(idx.hash[9]), 900.0)
    got = pred.predict(idx, 500, 1000.0)
    assert got[7] == first[7] and got[9] != first[9]
    idx.touch(int(idx.hash[7]), 900.0)
    got = pred.predict(idx, 500, 1000.0)
    want = _reference(idx, 500, 1000.0, pred.tau_ms)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


class _Kept:
    """A predictor that keeps (and returns) one output array, like a cache of its last answer."""

    name = "kept"

    def __init__(self, n: int) -> None:
        self.out = np.full(n, 0.25, np.float32)

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> np.ndarray:
        return self.out[:n]

    def info(self) -> dict[str, object]:
        return {"name": self.name}


class _Fresh(_Kept):
    returns_new_array = True

    def predict(self, index: BlockIndex, n: int, now_ms: float) -> np.ndarray:
        return self.out[:n].copy()


def _loop_with_policy(predictor: _Kept):  # type: ignore[no-untyped-def]
    """A shadow loop whose cpu tier is placed by ``lru`` fed with requests over the index's blocks."""
    from prometheus_client import CollectorRegistry

    from kvtier.controller.loop import ReconcileLoop
    from kvtier.controller.metrics import ControllerMetrics
    from kvtier.controller.policy_doc import PolicyDoc
    from kvtier.controller.root import make_placement
    from kvtier.policies.base import Request
    from kvtier.policies.tiers import Tier, TierSpec

    idx = BlockIndex(initial_capacity=256)
    for b in range(1, 201):
        idx.store(b, b - 1 if b % 10 != 1 else None, 1 if b % 3 else 2, 65536, 1000.0 * b)
    doc = PolicyDoc(
        mode="shadow",
        tiers=[
            TierSpec(tier=Tier.CPU, capacity_blocks=50),
            TierSpec(tier=Tier.DISK, capacity_blocks=1000),
        ],
    )
    now = [500.0]
    metrics = ControllerMetrics(CollectorRegistry())
    loop = ReconcileLoop(idx, policy=doc, metrics=metrics, clock=lambda: now[0], predictor=predictor)
    loop.placement = pl = make_placement(loop, "learned", Tier.CPU, lambda: now[0])
    for i in range(40):
        chain = np.arange(1 + 10 * (i % 20), 11 + 10 * (i % 20), dtype=np.int64)
        pl.requests.submit(Request(1000.0 * i, 160, 0, chain, block_tokens=16))
        pl.feed(None)
    return loop


def test_the_tick_overwrites_policy_rows_in_a_copy_unless_the_predictor_returns_a_new_array() -> None:
    """The placement policy's P(reuse) replaces the fallback's on its rows: in a copy when the predictor
    may keep its output (its array stays untouched), in place when it returns a new array; same plan."""
    plans = []
    for cls in (_Kept, _Fresh):
        pred = cls(256)
        loop = _loop_with_policy(pred)
        rep = loop.tick()
        assert rep.predictor.startswith("policy:") and rep.outcome == "ok"
        assert (pred.out == np.float32(0.25)).all()  # never written through
        plans.append(sorted((m.action, m.block, m.value_s) for m in rep.plan.moves))
        assert loop.stages.predict.last_owned is (cls is _Fresh)
    assert plans[0] == plans[1] and plans[0]


def test_observe_fills_unknown_sizes_with_block_bytes_exactly() -> None:
    """Rows with size <= 0 get ``block_bytes``, the others keep theirs (over several 64k-row steps)."""
    from prometheus_client import CollectorRegistry

    from kvtier.controller.loop import ReconcileLoop
    from kvtier.controller.metrics import ControllerMetrics
    from kvtier.controller.policy_doc import PolicyDoc
    from kvtier.policies.tiers import Tier, TierSpec

    n = 140_000
    idx = BlockIndex(initial_capacity=n)
    for b in range(1, n + 1):  # every row is observed (only the size column matters here)
        idx.store(b, None, 1, 4096, 1000.0)
    assert idx.n_rows == n
    rng = np.random.default_rng(1)
    nb = rng.integers(1, 1 << 31, n)
    nb[rng.random(n) < 0.3] = 0
    nb[:4] = [-5, 0, 1, (1 << 31) - 1]
    idx.nbytes[:n] = nb
    # a default that fits int32 (the view stays int32), and one that does not (the view widens)
    for bb, dt in ((777, np.int32), (1 << 40, np.int64)):
        doc = PolicyDoc(mode="shadow", tiers=[TierSpec(tier=Tier.CPU, capacity_blocks=50)], block_bytes=bb)
        metrics = ControllerMetrics(CollectorRegistry())
        loop = ReconcileLoop(idx, policy=doc, metrics=metrics, clock=lambda: 1.0)
        view = loop.stages.observe.view(loop.index, loop.policy)
        m = len(view)
        assert m == n and view.nbytes.dtype == dt
        assert np.array_equal(view.nbytes, np.where(nb <= 0, bb, nb))


def test_index_rejects_a_block_size_beyond_int32_before_changing_anything() -> None:
    idx = BlockIndex(initial_capacity=16)
    with pytest.raises(ValueError, match="out of range"):
        idx.store(5, None, 1, 1 << 31, 1.0)
    assert idx.get(5) is None and len(idx) == 0
    idx.store(5, None, 1, (1 << 31) - 1, 1.0)
    st = idx.get(5)
    assert st is not None and st.nbytes == (1 << 31) - 1


def test_observed_sizes_refresh_incrementally_and_equal_a_full_fill_after_every_kind_of_change() -> None:
    """The view's sizes are kept across ticks and refreshed from the index's change log: stores with a
    size, a store that changes it, removals (the slot's size resets), new rows, a ``block_bytes`` change,
    more changes than the log holds. Each observe equals a loop that fills every row afresh."""
    from prometheus_client import CollectorRegistry

    from kvtier.controller.loop import ReconcileLoop
    from kvtier.controller.metrics import ControllerMetrics
    from kvtier.controller.policy_doc import PolicyDoc
    from kvtier.policies.tiers import Tier, TierSpec

    idx = BlockIndex(initial_capacity=1024)
    for b in range(1, 501):
        idx.store(b, None, 1, 4096 if b % 3 else 0, 1000.0)
    doc = PolicyDoc(mode="shadow", tiers=[TierSpec(tier=Tier.CPU, capacity_blocks=50)], block_bytes=777)
    loop = ReconcileLoop(idx, policy=doc, metrics=ControllerMetrics(CollectorRegistry()), clock=lambda: 1.0)

    def check() -> None:
        got = loop.stages.observe.view(loop.index, loop.policy).nbytes
        n = idx.n_rows
        want = np.where(idx.nbytes[:n] <= 0, loop.policy.block_bytes, idx.nbytes[:n])
        assert got.shape == (n,) and np.array_equal(got, want)

    check()
    idx.store(7, None, 2, 123_456, 2000.0)  # a size change on an existing block
    idx.store(9, None, 2, 0, 2000.0)  # no size: unchanged
    check()
    idx.remove(2)  # drops the block (its slot's size resets) ...
    idx.store(10_001, None, 1, 0, 3000.0)  # ... and a new unsized block takes the slot
    check()
    for b in range(20_000, 20_300):  # new rows past the last observe
        idx.store(b, None, 1, 55 if b % 2 else 0, 4000.0)
    check()
    loop.policy = loop.policy.model_copy(update={"block_bytes": 999})
    check()
    for b in range(1, 501):  # more size changes than the log remembers: a full refresh
        for k in range(140):
            idx.store(b, None, 1, 100 + k, 5000.0)
    assert idx.nbytes_changed_since(0) is None
    check()


def test_the_ingest_path_defers_its_bulk_apply_while_a_tick_reads_the_index() -> None:
    """The tick reads the block index from a worker thread while the event loop applies queued KV-event
    updates to it; a bulk apply under a running tick (slot-map rehash, array growth) made the tick's
    lookups fail. A flush that finds the tick holding the index returns at once (deferred, counted) with
    its operations still queued; the next flush applies them."""
    import threading

    from prometheus_client import CollectorRegistry

    from kvtier.collectors.kv_ingest import KvIngestor
    from kvtier.collectors.vllm_events import BlockStored
    from kvtier.controller.loop import ReconcileLoop
    from kvtier.controller.metrics import ControllerMetrics
    from kvtier.controller.policy_doc import PolicyDoc

    idx = BlockIndex(initial_capacity=256)
    for b in range(1, 41):
        idx.store(b, b - 1 if b > 1 else None, 1, 65536, 1000.0 * b)
    ing = KvIngestor(idx)
    ing.apply_events("e0", [BlockStored(block_hashes=[1000, 1001], block_size=16)], 50_000.0)
    flushed_during_tick: list[bool] = []

    class Probe:
        """A predictor that, mid-tick, has another thread try the ingest path's flush."""

        def predict(self, index: BlockIndex, n: int, now_ms: float) -> np.ndarray:
            t = threading.Thread(target=lambda: flushed_during_tick.append(ing.flush(wait=False)))
            t.start()
            t.join()
            return np.full(n, 0.5, np.float32)

    loop = ReconcileLoop(
        idx, policy=PolicyDoc(mode="shadow"), metrics=ControllerMetrics(CollectorRegistry()),
        clock=lambda: 100.0, predictor=Probe(),  # type: ignore[arg-type]
    )  # fmt: skip
    rep = loop.tick()
    assert rep.outcome == "ok"
    assert flushed_during_tick == [False] and ing.flush_deferred == 1
    assert idx.slot_of(1000) < 0  # still queued
    assert ing.flush(wait=False) is True
    assert idx.slot_of(1000) >= 0 and idx.slot_of(1001) >= 0
