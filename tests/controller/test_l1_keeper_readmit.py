"""The L1 keeper's readmission by gap: a dropped chunk seen again after a gap whose bin the core learned is
rarely used again is not loaded back into L1 (counted ``readmit_declined``); one back after a short gap is.

The layer is the real HTTP object service stand-in of ``test_l1_keeper_locked`` (DELETE as LMCache MP
answers it, prefetches refused and counted): the subject is what the keeper sends, not LMCache's L1. The
real layer's readmission path is covered by tests/cachelayers/test_lmcache_mp_live.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvtier.controller.actuators.lmcache_keys import object_keys
from kvtier.controller.actuators.lmcache_mp import FsL2Verifier, LMCacheMPActuator
from kvtier.controller.actuators.resilience import HttpCaller
from kvtier.controller.l1_keeper import L1Keeper
from kvtier.policies.reuse_gap import ReuseByGap
from tests.controller.test_l1_keeper_locked import FakeL1, l1_handler
from tests.peers.http_server import serving


def _prompt(i: int) -> tuple[int, ...]:
    return tuple(range(i * 128, i * 128 + 128))  # 2 chunks of 64 tokens, distinct per prompt


def _run(tmp_path: Path, by_gap: bool) -> tuple[L1Keeper, Counter[str]]:
    """Prompt 0, then 299 other prompts, prompt 0 again (gap 300), prompt 298 again (gap 2)."""
    prompts = {i: _prompt(i) for i in range(300)}
    l1, now, recorded = FakeL1(), [0.0], Counter[str]()
    for toks in prompts.values():
        for k in object_keys("tiny", toks, 64):
            (tmp_path / k.fs_filename()).write_bytes(b"kv")  # L2 holds every chunk
            l1.held.add(k.chunk_hash_hex)  # and so does L1, after the store
    with serving(l1_handler(l1)) as url:
        act = LMCacheMPActuator(HttpCaller(url, timeout_s=5.0), chunk_size=64, model_name="tiny",
                                l2_verifier=FsL2Verifier(tmp_path), discover_verifier=False)  # fmt: skip
        keeper = L1Keeper(act, chain_tokens=lambda h: prompts[h], is_active=lambda: True,
                          registry=CollectorRegistry(), record=lambda what, n: recorded.update({what: n}),
                          probation_chunks=0, delay_s=0.0, readmit_by_gap=by_gap, clock=lambda: now[0],
                          measure_every_s=1e9, status_every_s=1e9)  # fmt: skip
        keeper.core.require_calibration = False
        keeper.core.acting = True  # the guards are not this test's subject
        if keeper.core.reuse is not None:  # learned before: gaps of 256-511 never come back, 2-3 always
            r = keeper.core.reuse = ReuseByGap(horizon=8, min_samples=4)
            for i in range(4):
                r.observe_second_sight(-20, ("long", i), 300)
                r.observe_second_sight(-20, ("short", i), 2)
                r.observe_sight(-19, ("short", i))
        for h in [*range(300), 0, 298]:
            keeper.on_block_stored(None, h, 8, 16)  # a new prompt: 2 chunks
            keeper.run_due()  # drops applied (delay 0), readmissions sent (refused by the stand-in)
    return keeper, recorded


def test_a_chunk_back_after_a_gap_that_does_not_pay_is_not_readmitted(tmp_path: Path) -> None:
    keeper, recorded = _run(tmp_path, True)
    assert keeper.counts["applied"] == 600  # every first-sight chunk dropped (probation 0)
    assert keeper.counts["readmit_declined"] == 2  # prompt 0's two chunks, back after 300 prompts
    assert keeper.counts["readmit_failed"] == 1  # prompt 298's prefix, back after 2: sent (and refused here)
    assert recorded["l1_readmit:readmit_declined"] == 2 and recorded["l1_admission:applied"] == 600
    gap = keeper.status()["guard"]["readmission_by_gap"]
    assert gap["bins"]["gap<512"] == [4, 0] and gap["bins"]["gap<4"][0] >= 4


def test_without_readmission_by_gap_every_dropped_chunk_seen_again_is_readmitted(tmp_path: Path) -> None:
    keeper, recorded = _run(tmp_path, False)
    assert keeper.counts["applied"] == 600
    assert keeper.counts["readmit_declined"] == 0 and keeper.counts["readmit_failed"] == 2
    assert keeper.status()["guard"]["readmission_by_gap"] is None
    assert "l1_readmit:readmit_declined" not in recorded
