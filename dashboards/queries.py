"""Every PromQL expression the kvtier dashboards use, in one place.

Grafana variables used here: ``$model`` and ``$engine`` (vLLM's ``model_name`` / ``engine`` labels), ``$tier``
(kvtier's ``tier`` label), ``$kv_engine`` (kvtier's ``engine`` label: the engine the sidecar watches) and
``$__rate_interval``. Multi-value variables are matched with ``=~`` (Grafana sends ``a|b``, All is ``.*``).

Metric names: vLLM's own are those the vLLM CPU 0.32 build really emits (checked against a running server);
LMCache MP server names are from ``feasibility_cachelayers.md`` §1.5; kvtier's own are the contract in
``dashboards/METRICS.md``.
"""

from __future__ import annotations

RI = "$__rate_interval"

# --- selectors --------------------------------------------------------------------------------------------
VLLM = 'model_name=~"$model", engine=~"$engine"'
TIER = 'tier=~"$tier"'
KV_ENGINE = 'engine=~"$kv_engine"'


def rate(metric: str, sel: str = "", by: str = "", window: str = RI) -> str:
    """``sum by (by) (rate(metric{sel}[window]))`` (no ``by`` = one total series)."""
    inner = f"rate({metric}{{{sel}}}[{window}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q: float, hist: str, sel: str, by: str = "model_name") -> str:
    """``histogram_quantile`` over a classic histogram's ``_bucket`` series, per ``by``."""
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({hist}_bucket{{{sel}}}[{RI}])))"


def ratio(num: str, den: str, match: str = "") -> str:
    """``num / [match] den``; an idle window (den = 0) yields NaN, which Grafana shows as no value.

    ``match`` is a vector-matching clause such as ``ignoring(tier) group_left``.
    """
    if match:  # no parentheses after group_left: they would be read as its label list
        return f"({num})\n/ {match}\n{den}"
    return f"({num})\n/\n({den})"


# --- KV tiering overview (vLLM's own metrics) -------------------------------------------------------------
TTFT_P50 = quantile(0.5, "vllm:time_to_first_token_seconds", VLLM)
TTFT_P99 = quantile(0.99, "vllm:time_to_first_token_seconds", VLLM)
ITL_P50 = quantile(0.5, "vllm:inter_token_latency_seconds", VLLM)
ITL_P99 = quantile(0.99, "vllm:inter_token_latency_seconds", VLLM)
E2E_P50 = quantile(0.5, "vllm:e2e_request_latency_seconds", VLLM)
E2E_P99 = quantile(0.99, "vllm:e2e_request_latency_seconds", VLLM)
QUEUE_P99 = quantile(0.99, "vllm:request_queue_time_seconds", VLLM)
PREFILL_P99 = quantile(0.99, "vllm:request_prefill_time_seconds", VLLM)
PROMPT_TPS = rate("vllm:prompt_tokens_total", VLLM, "model_name")
GEN_TPS = rate("vllm:generation_tokens_total", VLLM, "model_name")
REQ_PS = rate("vllm:request_success_total", VLLM, "finished_reason")
PREFIX_HIT_LOCAL = ratio(
    rate("vllm:prefix_cache_hits_total", VLLM, "model_name"),
    rate("vllm:prefix_cache_queries_total", VLLM, "model_name"),
)
PREFIX_HIT_EXTERNAL = ratio(
    rate("vllm:external_prefix_cache_hits_total", VLLM, "model_name"),
    rate("vllm:external_prefix_cache_queries_total", VLLM, "model_name"),
)
CACHED_BY_SOURCE = rate("vllm:prompt_tokens_cached_by_source_total", VLLM, "source")
PROMPT_BY_SOURCE = rate("vllm:prompt_tokens_by_source_total", VLLM, "source")
CACHED_SHARE = ratio(
    rate("vllm:prompt_tokens_cached_total", VLLM, "model_name"),
    rate("vllm:prompt_tokens_total", VLLM, "model_name"),
)
KV_USAGE = f"max by (model_name, engine) (vllm:kv_cache_usage_perc{{{VLLM}}})"
RUNNING = f"sum by (model_name) (vllm:num_requests_running{{{VLLM}}})"
WAITING = f"sum by (model_name) (vllm:num_requests_waiting{{{VLLM}}})"
WAITING_BY_REASON = f"sum by (reason) (vllm:num_requests_waiting_by_reason{{{VLLM}}})"
PREEMPTIONS = rate("vllm:num_preemptions_total", VLLM, "model_name")

# --- Tiers and storage ------------------------------------------------------------------------------------
BLOCKS_TRACKED = f"sum by (tier) (kvtier_blocks_tracked{{{TIER}}})"
TIER_USAGE = ratio(
    f"sum by (tier) (kvtier_tier_used_bytes{{{TIER}}})",
    f"sum by (tier) (kvtier_tier_capacity_bytes{{{TIER}}})",
)
TIER_USED_BYTES = f"sum by (tier) (kvtier_tier_used_bytes{{{TIER}}})"
TIER_HIT_RATIO = ratio(
    rate("kvtier_tier_hit_tokens_total", TIER, "tier"),
    rate("kvtier_lookup_tokens_total"),
    "ignoring(tier) group_left",
)
MOVED_BYTES = rate("kvtier_tier_moved_bytes_total", "", "src_tier, dst_tier")
VLLM_HIT_SHARE_BY_SOURCE = ratio(
    rate("vllm:prompt_tokens_cached_by_source_total", VLLM, "source"),
    rate("vllm:prompt_tokens_total", VLLM),
    "ignoring(source) group_left",
)
LMC_L1_BYTES = "sum by (instance) (lmcache_mp_l1_memory_usage_bytes)"
LMC_L2_BYTES = "sum by (instance, l2_name) (lmcache_mp_l2_usage_bytes)"
LMC_L1_RATIO = "max by (instance) (lmcache_mp_l1_usage_ratio)"
LMC_HIT_L1 = rate("lmcache_mp_lookup_hit_l1_tokens_total", "", "instance")
LMC_HIT_L2 = rate("lmcache_mp_lookup_hit_l2_tokens_total", "", "instance")
LMC_REQUESTED = rate("lmcache_mp_lookup_requested_tokens_total", "", "instance")
LMC_HIT_RATIO = ratio(rate("lmcache_mp_lookup_hit_tokens_total", "", "instance"), LMC_REQUESTED)
LMC_L1_WRITES = rate("lmcache_mp_l1_write_chunks_total", "", "instance")
LMC_L1_EVICTIONS = rate("lmcache_mp_l1_evicted_chunks_total", "", "instance")
LMC_L2_STORES = rate("lmcache_mp_l2_store_completed_objects_chunks_total", "", "instance")
LMC_L2_LOADS = rate("lmcache_mp_l2_prefetch_load_completed_chunks_total", "", "instance")
DEV_READ_BPS = rate("kvtier_storage_device_read_bytes_total", "", "device")
DEV_WRITE_BPS = rate("kvtier_storage_device_write_bytes_total", "", "device")
# window figures the storage collector computes from /proc/diskstats (gauges, per device)
DEV_READ_IOPS = "sum by (device) (kvtier_storage_device_read_iops)"
DEV_WRITE_IOPS = "sum by (device) (kvtier_storage_device_write_iops)"
DEV_READ_LAT = "max by (device) (kvtier_storage_device_read_latency_milliseconds)"
DEV_WRITE_LAT = "max by (device) (kvtier_storage_device_write_latency_milliseconds)"
DEV_UTIL = "max by (device) (kvtier_storage_device_utilization_ratio)"
DEV_QUEUE = "sum by (device) (kvtier_storage_device_queue_depth)"
PATH_USAGE = ratio(
    f'sum by (tier, path) (kvtier_storage_path_bytes{{kind="used", {TIER}}})',
    f'sum by (tier, path) (kvtier_storage_path_bytes{{kind="total", {TIER}}})',
)
NVME_PATHS = "sum by (state) (kvtier_storage_nvme_paths)"

# --- Controller and predictor -----------------------------------------------------------------------------
SIDECAR_UP = 'up{job="kvtier"}'
DECISIONS = rate("kvtier_decisions_total", TIER, "action, tier")
ACTUATIONS = rate("kvtier_actuations_total", "", "layer, outcome")
# failed / attempted; a window without attempts (shadow mode: every outcome is "shadow") reads 0, not NaN --
# the denominator's floor is far below one attempt per window, so real ratios are unchanged
ATTEMPTS = rate("kvtier_actuations_total", 'outcome=~"applied|failed"', "layer")
ACTUATION_FAILURE_RATIO = ratio(
    rate("kvtier_actuations_total", 'outcome="failed"', "layer"), f"clamp_min({ATTEMPTS}, 1e-9)"
)
CIRCUIT_OPEN = "max by (layer) (kvtier_actuator_circuit_open)"
TICK_P50 = f"histogram_quantile(0.5, sum by (le) (rate(kvtier_loop_tick_seconds_bucket[{RI}])))"
TICK_P99 = f"histogram_quantile(0.99, sum by (le) (rate(kvtier_loop_tick_seconds_bucket[{RI}])))"
TICKS_BY_OUTCOME = rate("kvtier_loop_ticks_total", "", "outcome")
KV_EVENTS = rate("kvtier_kv_events_total", KV_ENGINE, "type")
KV_EVENTS_LOST = rate("kvtier_kv_events_lost_total", KV_ENGINE, "engine")
COLLECTOR_ERRORS = rate("kvtier_collector_errors_total", "", "collector")
PREDICTOR_AUC = "max(kvtier_predictor_auc)"
PREDICTOR_ECE = "max(kvtier_predictor_calibration_error)"
PREDICTOR_BRIER = "max(kvtier_predictor_brier_score)"
SHADOW_HIT_RATE = ratio(
    rate("kvtier_shadow_hits_total", TIER, "action"),
    rate("kvtier_shadow_scored_total", TIER, "action"),
)
SHADOW_HITS = rate("kvtier_shadow_hits_total", TIER, "action, tier")

# --- template variable queries (Grafana ``label_values``) -------------------------------------------------
VAR_MODEL = "label_values(vllm:num_requests_running, model_name)"
VAR_ENGINE = 'label_values(vllm:num_requests_running{model_name=~"$model"}, engine)'
VAR_TIER = "label_values(kvtier_blocks_tracked, tier)"
VAR_KV_ENGINE = "label_values(kvtier_kv_events_total, engine)"
