"""The operator-facing policy document (``GET/PUT/PATCH /v1/policy``): validated, persisted, hot-swapped.

Units are in the field names. :meth:`PolicyDoc.planner_config` turns it into the pure planner's config.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.policies.planner import LinkBudget, PlannerConfig, TierSpec
from kvtier.policies.tiers import Tier, TierHardware

Mode = Literal["off", "shadow", "active"]  # the one operating-mode vocabulary (settings, API, loop)
LINK_PATTERN = r"^(gpu|cpu|disk|remote|none)->(gpu|cpu|disk|remote|none)$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# the pure planner's dataclasses hold the defaults; the documents here only add bounds and descriptions
_PC: dict[str, Any] = {f.name: f.default for f in fields(PlannerConfig)}
_LB: dict[str, Any] = {f.name: f.default for f in fields(LinkBudget)}


class TierConfig(_Strict):
    tier: Tier = Field(description="kvtier tier name: gpu, cpu, disk or remote")
    capacity_blocks: int = Field(ge=0, le=10**10, description="blocks the planner may place in this tier")
    high_watermark: float = Field(
        default=0.95, ge=0.0, le=1.0, description="fraction of capacity that triggers shedding"
    )
    low_watermark: float = Field(default=0.85, ge=0.0, le=1.0, description="fraction shedding stops at")
    load_bandwidth_bytes_s: float = Field(
        default=1e10, gt=0, le=1e15, description="measured load bandwidth into the engine, bytes/s"
    )

    @classmethod
    def from_hardware(cls, hw: TierHardware, load_bandwidth_bytes_s: float | None = None) -> TierConfig:
        """The planner's view of one tier of the tier model: its capacity and the bandwidth a load from it
        into the engine gets (default: the tier's read bandwidth)."""
        return cls(tier=hw.tier, capacity_blocks=hw.capacity_blocks,
                   load_bandwidth_bytes_s=min(load_bandwidth_bytes_s or hw.read_bytes_s, 1e15))  # fmt: skip

    @model_validator(mode="after")
    def _marks(self) -> TierConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"tier {self.tier.value}: low_watermark ({self.low_watermark}) must be <= "
                f"high_watermark ({self.high_watermark})"
            )
        return self


class BudgetLimits(_Strict):
    bytes_per_s: float = Field(default=_LB["bytes_per_s"], ge=0, le=1e15, description="bytes per second")
    ops_per_s: float = Field(default=_LB["ops_per_s"], ge=0, le=1e7, description="moves per second")
    burst_s: float = Field(
        default=_LB["burst_s"], gt=0, le=3600, description="bucket depth in seconds of rate"
    )


class LinkBudgetConfig(BudgetLimits):
    link: str = Field(pattern=LINK_PATTERN, description="'src->dst', tiers or 'none' (e.g. 'cpu->gpu')")


class PredictorSettings(_Strict):
    kind: Literal["heuristic", "learned"] = Field(
        default="learned", description="learned falls back to heuristic until a model is trained"
    )
    tau_s: float = Field(default=300.0, gt=0, le=86400 * 30, description="heuristic recency scale, seconds")
    retrain_interval_s: float = Field(
        default=0.0, ge=0, le=86400 * 7, description="0 = retrain only on request; else at least 1 s"
    )

    horizon_s: float = Field(default=300.0, gt=0, le=86400, description="reuse label horizon, seconds")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="seed of training samples and the policy")

    @field_validator("retrain_interval_s")
    @classmethod
    def _retrain_floor(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("retrain_interval_s must be 0 (on request only) or at least 1 second")
        return v


class PlannerKnobs(_Strict):
    """The planner's part of the policy document (the ``planner`` settings section)."""

    tiers: list[TierConfig] = Field(
        default_factory=lambda: [
            TierConfig(
                tier=Tier.GPU,
                capacity_blocks=48,
                high_watermark=0.95,
                low_watermark=0.85,
                load_bandwidth_bytes_s=1e12,
            ),
            TierConfig(tier=Tier.CPU, capacity_blocks=100_000, load_bandwidth_bytes_s=2e10),
        ],
        max_length=4,
        description="managed tiers with capacity, watermarks and load bandwidth",
    )
    budgets: list[LinkBudgetConfig] = Field(
        default_factory=list, max_length=32, description="per-link move budgets ('src->dst')"
    )
    default_budget: BudgetLimits = Field(
        default_factory=BudgetLimits, description="budget of every link not listed in budgets"
    )
    hysteresis_s: float = Field(
        default=_PC["hysteresis_s"], ge=0, le=86400, description="no second move of a block within this, s"
    )
    pin_retry_s: float = Field(
        default=_PC["pin_retry_s"], ge=0, le=86400, description="re-attempt an unmet pin after this, s"
    )
    min_gain_s: float = Field(
        default=_PC["min_gain_s"], ge=0, le=3600, description="a promotion must gain more than this, s"
    )
    reuse_threshold: float = Field(
        default=_PC["reuse_threshold"], ge=0, le=1, description="promote/admit only when P(reuse) >= this"
    )
    prefill_s_per_token: float = Field(
        default=_PC["prefill_s_per_token"], gt=0, le=10, description="engine prefill cost, seconds/token"
    )
    block_size_tokens: int = Field(default=32, ge=1, le=65536, description="engine block size, tokens")
    block_bytes: int = Field(
        default=65536, ge=1, le=2**40, description="KV bytes per block when the index has none"
    )

    @model_validator(mode="after")
    def _unique(self) -> PlannerKnobs:
        seen = [t.tier for t in self.tiers]
        if len(set(seen)) != len(seen):
            raise ValueError(f"tiers must be unique, got {[t.value for t in seen]}")
        links = [b.link for b in self.budgets]
        if len(set(links)) != len(links):
            raise ValueError(f"budget links must be unique, got {links}")
        return self


class LoopKnobs(_Strict):
    """The reconcile loop's part of the policy document (in the ``loop`` settings section)."""

    # lower bounds: a typo (1e-300) must not make every tick "time out" or the loop spin
    tick_interval_s: float = Field(default=1.0, ge=0.01, le=3600, description="period of reconcile ticks, s")
    tick_timeout_s: float = Field(
        default=5.0, ge=0.01, le=3600, description="a tick longer than this fails, s"
    )
    shadow_horizon_s: float = Field(
        default=300.0, gt=0, le=86400, description="came-back window for scoring, s"
    )


class PolicyDoc(PlannerKnobs, LoopKnobs):
    """The operator's policy: mode, planner and loop knobs, predictor (``/v1/policy``)."""

    mode: Mode = Field(
        default="shadow", description="off: observe only; shadow: decide and score; active: also act"
    )
    predictor: PredictorSettings = Field(default_factory=PredictorSettings, description="reuse predictor")

    def planner_config(self) -> PlannerConfig:
        d = self.default_budget
        return PlannerConfig(
            tiers=tuple(
                TierSpec(
                    t.tier, t.capacity_blocks, t.high_watermark, t.low_watermark, t.load_bandwidth_bytes_s
                )
                for t in self.tiers
            ),
            budgets={b.link: LinkBudget(b.bytes_per_s, b.ops_per_s, b.burst_s) for b in self.budgets},
            default_budget=LinkBudget(d.bytes_per_s, d.ops_per_s, d.burst_s),
            prefill_s_per_token=self.prefill_s_per_token,
            hysteresis_s=self.hysteresis_s,
            pin_retry_s=self.pin_retry_s,
            min_gain_s=self.min_gain_s,
            reuse_threshold=self.reuse_threshold,
        )

    def merged(self, patch: dict[str, Any]) -> PolicyDoc:
        """A new validated doc with ``patch`` merged in (objects merge, lists and scalars replace)."""
        return PolicyDoc.model_validate(_merge(self.model_dump(mode="json"), patch))


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
