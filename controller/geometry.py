"""The engine's KV-cache geometry, read from vLLM's own ``vllm:cache_config_info`` (an info gauge on its
``/metrics``: ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``, ``cache_dtype``, ...).

The policy's GPU tier must match the engine it plans for: a planner sized for 48 blocks of 32 tokens
against an engine with 20,000 blocks of 16 tokens decides nonsense. Unless the operator set the policy
(``PUT``/``PATCH /v1/policy``, persisted), the sidecar sizes the policy from this at start-up; the source is
shown in ``/v1/status`` (``policy_source``) and logged.

:func:`parse_cache_config` is pure (exposition text -> :class:`EngineGeometry`); :func:`fetch_geometry` does
the I/O; :func:`apply_geometry` is pure (policy document + geometry -> policy document).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.controller.policy_doc import PolicyDoc
from kvtier.policies.tiers import Tier, TierSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """One engine's KV-cache layout: block size in tokens, block counts per pool."""

    block_size_tokens: int
    num_gpu_blocks: int
    num_cpu_blocks: int | None = None
    cache_dtype: str | None = None
    block_bytes: int | None = None  # KV bytes per block: kv_cache_memory_bytes / num_gpu_blocks

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v not in (None, "", "None") else None
    except ValueError:
        return None


def parse_cache_config(text: str) -> EngineGeometry | None:
    """``vllm:cache_config_info`` of a vLLM ``/metrics`` text -> geometry; None when absent or incomplete."""
    for fam in text_string_to_metric_families(text):
        if fam.name.removesuffix("_info") != "vllm:cache_config":
            continue
        for s in fam.samples:
            bs, gpu = _int(s.labels.get("block_size")), _int(s.labels.get("num_gpu_blocks"))
            if bs and gpu:
                mem = _int(s.labels.get("kv_cache_memory_bytes"))
                return EngineGeometry(
                    bs,
                    gpu,
                    _int(s.labels.get("num_cpu_blocks")),
                    s.labels.get("cache_dtype"),
                    mem // gpu if mem else None,
                )
    return None


async def fetch_geometry(
    client: httpx.AsyncClient, engine_url: str, timeout_s: float = 5.0
) -> EngineGeometry | None:
    """GET ``{engine_url}/metrics`` and parse it; None when the engine does not answer (yet) or lacks it."""
    try:
        r = await client.get(engine_url.rstrip("/") + "/metrics", timeout=timeout_s)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    try:
        return parse_cache_config(r.text)
    except ValueError as exc:  # malformed exposition text
        log.warning("%s/metrics: cannot read vllm:cache_config_info: %s", engine_url, exc)
        return None


def apply_geometry(doc: PolicyDoc, geo: EngineGeometry) -> PolicyDoc:
    """``doc`` with the engine's block size and its GPU tier's capacity set to the engine's GPU blocks."""
    tiers = list(doc.tiers)
    gpu = next((i for i, t in enumerate(tiers) if t.tier is Tier.GPU), None)
    if gpu is None:
        tiers.insert(0, TierSpec(tier=Tier.GPU, capacity_blocks=geo.num_gpu_blocks))
    else:
        tiers[gpu] = replace(tiers[gpu], capacity_blocks=geo.num_gpu_blocks)
    update: dict[str, Any] = {"tiers": tiers, "block_size_tokens": geo.block_size_tokens}
    if geo.block_bytes:
        update["block_bytes"] = geo.block_bytes
    return doc.model_copy(update=update)
