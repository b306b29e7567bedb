"""The one token bucket: move budgets per tier link (planner), warm-up budgets (vllm-warmup).

Two resources refill together: an ``amount`` (bytes moved, prompt tokens sent) and ``ops`` (moves,
requests), each at its own rate, each at most ``burst_s`` seconds of its rate deep. A spend takes one op and
``amount`` of the other. Pure: the caller passes the clock (seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """Remaining ``amount`` and ``ops`` as of ``at_s`` (seconds)."""

    amount: float
    ops: float
    at_s: float

    @classmethod
    def full(cls, amount_per_s: float, ops_per_s: float, burst_s: float, now_s: float) -> TokenBucket:
        return cls(amount_per_s * burst_s, ops_per_s * burst_s, now_s)

    def refill(self, now_s: float, amount_per_s: float, ops_per_s: float, burst_s: float) -> None:
        """Add what the rates earned since ``at_s`` (a clock step back earns nothing), up to the depth."""
        dt = max(0.0, now_s - self.at_s)
        self.amount = min(amount_per_s * burst_s, self.amount + dt * amount_per_s)
        self.ops = min(ops_per_s * burst_s, self.ops + dt * ops_per_s)
        self.at_s = now_s

    def take(self, amount: float) -> bool:
        """Spend one op and ``amount`` if both are there; else spend nothing and return False."""
        if self.ops < 1.0 or self.amount < amount:
            return False
        self.ops -= 1.0
        self.amount -= amount
        return True
