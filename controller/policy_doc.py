"""The operator-facing policy document (``GET/PUT/PATCH /v1/policy``): validated, persisted, hot-swapped.

Units are in the field names. :meth:`PolicyDoc.planner_config` turns it into the pure planner's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from kvtier.policies.planner import LinkBudget, PlannerConfig
from kvtier.policies.tiers import NOT_IN_POLICY_DOC, Tier, TierSpec

Mode = Literal["off", "shadow", "active"]  # the one operating-mode vocabulary (settings, API, loop)
LINK_PATTERN = r"^(gpu|cpu|disk|remote|none)->(gpu|cpu|disk|remote|none)$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# the pure planner's dataclasses hold the defaults; the documents here only add bounds and descriptions
_PC: dict[str, Any] = {f.name: f.default for f in fields(PlannerConfig)}
_LB: dict[str, Any] = {f.name: f.default for f in fields(LinkBudget)}


def _doc_keys_only(v: Any) -> Any:
    """A tier of the document carries the planner's fields only (the hardware-only ones stay out)."""
    if isinstance(v, Mapping):
        unknown = [k for k in v if k not in _TIER_DOC_FIELDS]
        if unknown:
            raise PydanticCustomError(
                "unknown_tier_key",
                "unknown key '{key}'; a tier takes " + ", ".join(_TIER_DOC_FIELDS),
                {"key": str(unknown[0])},
            )
    return v


class _PlannerTierSchema:
    """JSON schema of a document tier: :class:`~kvtier.policies.tiers.TierSpec` without the hardware-only
    fields (they are not accepted, see :func:`_doc_keys_only`, nor returned: their metadata excludes them)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        # a copy of the dataclass' schema under the document's own name (the JSON schema's $defs key)
        schema = dict(handler.resolve_ref_schema(handler(source)))
        schema["ref"] = f"{__name__}.TierConfig"
        return cast(CoreSchema, schema)

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        ref = handler(schema)
        out = handler.resolve_ref_schema(ref)  # the definition itself: edited in place, referenced by ``ref``
        for k in NOT_IN_POLICY_DOC:
            out.get("properties", {}).pop(k, None)
        out.pop("description", None)  # the dataclass docstring is for Python readers
        out.update(title="TierConfig", additionalProperties=False)
        return ref


_TIER_DOC_FIELDS = tuple(f.name for f in fields(TierSpec) if f.name not in NOT_IN_POLICY_DOC)
# one tier of the document: the one tier model, validated by pydantic (bounds and descriptions come from
# the dataclass fields' metadata; its __post_init__ checks the watermark order)
DocTier = Annotated[TierSpec, _PlannerTierSchema, BeforeValidator(_doc_keys_only)]


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

    tiers: list[DocTier] = Field(
        default_factory=lambda: [
            TierSpec(
                tier=Tier.GPU,
                capacity_blocks=48,
                high_watermark=0.95,
                low_watermark=0.85,
                load_bandwidth_bytes_s=1e12,
            ),
            TierSpec(tier=Tier.CPU, capacity_blocks=100_000, load_bandwidth_bytes_s=2e10),
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
            tiers=tuple(self.tiers),
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
