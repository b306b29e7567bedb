"""The one token bucket: refill at each rate up to ``burst_s`` of it, a spend takes one op and the amount or
nothing; the warm-up budget is that bucket on its clock."""

from __future__ import annotations

from kvtier.controller.actuators.vllm_warmup import WarmupBudget
from kvtier.policies.budget import TokenBucket


def test_refill_spend_and_depth() -> None:
    b = TokenBucket.full(100.0, 2.0, 1.0, now_s=0.0)
    assert b.take(60) and not b.take(60)  # 40 left: a 60 spend is refused and takes nothing
    assert (b.amount, b.ops) == (40.0, 1.0)
    b.refill(0.5, 100.0, 2.0, 1.0)
    assert (b.amount, b.ops) == (90.0, 2.0)  # ops capped at the depth (2 x 1 s)
    b.refill(0.25, 100.0, 2.0, 1.0)  # a clock step back earns nothing
    assert (b.amount, b.ops) == (90.0, 2.0)
    assert b.take(90) and b.take(0) and not b.take(0)  # out of ops


def test_warmup_budget_runs_on_its_clock() -> None:
    now = [0.0]
    wb = WarmupBudget(tokens_per_s=100, requests_per_s=1, burst_s=2.0, clock=lambda: now[0])
    assert wb.take(150) and not wb.take(100)  # 50 tokens left
    now[0] = 1.0
    assert wb.take(100) and wb.take(50) and not wb.take(0)  # 150 tokens, 2 requests (the depth); then none
