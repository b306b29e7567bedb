"""Generate kvtier's Grafana dashboards (``dashboards/*.json``) from :mod:`kvtier.dashboards.queries`.

python -m kvtier.dashboards.generate          # rewrite the JSON files
python -m kvtier.dashboards.generate --check  # exit 1 if a checked-in file differs from the output
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.dashboards import queries as q
from kvtier.dashboards.grafana import Dashboard, Target, datasource_var, query_var, stat, table, ts

HERE = Path(__file__).resolve().parent
T = Target


def overview() -> Dashboard:
    d = Dashboard(
        uid="kvtier-overview",
        title="kvtier / KV tiering overview",
        description="Latency, throughput, prefix-cache hits by source and KV usage, from vLLM /metrics.",
        variables=[
            datasource_var(),
            query_var("model", "Model", q.VAR_MODEL),
            query_var("engine", "Engine (DP rank)", q.VAR_ENGINE),
        ],
    )
    d.row("At a glance").add(
        stat(
            "TTFT p99",
            T(q.TTFT_P99, "{{model_name}}"),
            unit="s",
            thresholds=((None, "green"), (0.5, "orange"), (2.0, "red")),
        ),
        stat(
            "Prefix-cache hit ratio (local)",
            T(q.PREFIX_HIT_LOCAL, "{{model_name}}"),
            unit="percentunit",
            min=0,
            max=1,
        ),
        stat(
            "KV cache usage",
            T(q.KV_USAGE, "{{model_name}} / {{engine}}"),
            unit="percentunit",
            min=0,
            max=1,
            thresholds=((None, "green"), (0.8, "orange"), (0.95, "red")),
        ),
        stat("Requests running / waiting", T(q.RUNNING, "running"), T(q.WAITING, "waiting")),
    )
    d.row("Latency").add(
        ts(
            "Time to first token",
            T(q.TTFT_P50, "p50 {{model_name}}"),
            T(q.TTFT_P99, "p99 {{model_name}}"),
            unit="s",
            width=8,
            description="histogram_quantile over vllm:time_to_first_token_seconds.",
        ),
        ts(
            "Inter-token latency",
            T(q.ITL_P50, "p50 {{model_name}}"),
            T(q.ITL_P99, "p99 {{model_name}}"),
            unit="s",
            width=8,
        ),
        ts(
            "End-to-end request latency",
            T(q.E2E_P50, "p50 {{model_name}}"),
            T(q.E2E_P99, "p99 {{model_name}}"),
            unit="s",
            width=8,
        ),
        ts(
            "Queue and prefill time p99",
            T(q.QUEUE_P99, "queue {{model_name}}"),
            T(q.PREFILL_P99, "prefill {{model_name}}"),
            unit="s",
            width=12,
        ),
        ts(
            "Tokens per second",
            T(q.PROMPT_TPS, "prompt {{model_name}}"),
            T(q.GEN_TPS, "generation {{model_name}}"),
            unit="short",
            width=12,
            description="Prefill (prompt) and decode (generation) tokens/s.",
        ),
    )
    d.row("Prefix cache").add(
        ts(
            "Prefix-cache hit ratio",
            T(q.PREFIX_HIT_LOCAL, "local (GPU) {{model_name}}"),
            T(q.PREFIX_HIT_EXTERNAL, "external (KV connector) {{model_name}}"),
            unit="percentunit",
            min=0,
            max=1,
            width=8,
            description="hits / queries in tokens; external = served through the KV connector "
            "(e.g. LMCache). No value while there are no queries.",
        ),
        ts(
            "Cached prompt tokens by source",
            T(q.CACHED_BY_SOURCE, "{{source}}"),
            unit="short",
            stack=True,
            width=8,
            description="vllm:prompt_tokens_cached_by_source: device = GPU, host = CPU DRAM, disk, "
            "p2p, external_unspecified (KV connector).",
        ),
        ts(
            "Prompt tokens by source",
            T(q.PROMPT_BY_SOURCE, "{{source}}"),
            unit="short",
            stack=True,
            width=8,
            description="local_compute vs local_cache_hit vs external_kv_transfer.",
        ),
        ts(
            "Share of prompt tokens served from cache",
            T(q.CACHED_SHARE, "{{model_name}}"),
            unit="percentunit",
            min=0,
            max=1,
            width=12,
        ),
        ts("Preemptions per second", T(q.PREEMPTIONS, "{{model_name}}"), unit="short", width=12),
    )
    d.row("KV usage and queue").add(
        ts("KV cache usage", T(q.KV_USAGE, "{{model_name}} / {{engine}}"), unit="percentunit", min=0, max=1),
        ts(
            "Queue depth",
            T(q.RUNNING, "running {{model_name}}"),
            T(q.WAITING, "waiting {{model_name}}"),
            T(q.WAITING_BY_REASON, "waiting: {{reason}}"),
            unit="short",
        ),
        ts(
            "Finished requests per second",
            T(q.REQ_PS, "{{finished_reason}}"),
            unit="reqps",
            stack=True,
            width=24,
            height=6,
        ),
    )
    return d


def tiers() -> Dashboard:
    d = Dashboard(
        uid="kvtier-tiers",
        title="kvtier / Tiers and storage",
        description="Per-tier residency, usage and hit ratio, bytes moved between tiers, the LMCache MP "
        "server's L1/L2, and the storage devices behind the disk tier.",
        variables=[
            datasource_var(),
            query_var("model", "Model", q.VAR_MODEL),
            query_var("engine", "Engine (DP rank)", q.VAR_ENGINE),
            query_var("tier", "Tier", q.VAR_TIER),
        ],
    )
    d.row("Tiers (kvtier's view)").add(
        ts(
            "Blocks tracked per tier",
            T(q.BLOCKS_TRACKED, "{{tier}}"),
            unit="short",
            width=8,
            description="Blocks the sidecar believes resident in each tier (from KV events).",
        ),
        ts("Tier usage", T(q.TIER_USAGE, "{{tier}}"), unit="percentunit", min=0, max=1, width=8),
        ts(
            "Tier hit ratio",
            T(q.TIER_HIT_RATIO, "{{tier}}"),
            unit="percentunit",
            min=0,
            max=1,
            width=8,
            description="Prefix tokens served from each tier / prefix tokens looked up.",
        ),
        ts("Bytes used per tier", T(q.TIER_USED_BYTES, "{{tier}}"), unit="bytes", width=12),
        ts(
            "Bytes moved per tier link",
            T(q.MOVED_BYTES, "{{src_tier}} → {{dst_tier}}"),
            unit="Bps",
            width=12,
            description="Moves kvtier applied (promote, demote, prefetch), bytes/s per source → destination.",
        ),
    )
    d.row("Hits by source (vLLM)").add(
        ts(
            "Share of prompt tokens cached, by source",
            T(q.VLLM_HIT_SHARE_BY_SOURCE, "{{source}}"),
            unit="percentunit",
            min=0,
            max=1,
            stack=True,
            width=24,
            height=7,
            description="vLLM's per-tier hit signal: device (GPU), host (CPU), disk, p2p, external.",
        ),
    )
    d.row("LMCache MP server (L1 DRAM / L2)").add(
        ts(
            "L1 / L2 bytes used",
            T(q.LMC_L1_BYTES, "L1 {{instance}}"),
            T(q.LMC_L2_BYTES, "L2 {{l2_name}}"),
            unit="bytes",
            width=8,
        ),
        ts("L1 usage ratio", T(q.LMC_L1_RATIO, "{{instance}}"), unit="percentunit", min=0, max=1, width=8),
        ts("Lookup hit ratio", T(q.LMC_HIT_RATIO, "{{instance}}"), unit="percentunit", min=0, max=1, width=8),
        ts(
            "Lookup tokens: hit in L1 / L2 / requested",
            T(q.LMC_HIT_L1, "L1 hit"),
            T(q.LMC_HIT_L2, "L2 hit"),
            T(q.LMC_REQUESTED, "requested"),
            unit="short",
            width=12,
        ),
        ts(
            "Chunks written / evicted / stored / loaded",
            T(q.LMC_L1_WRITES, "L1 writes"),
            T(q.LMC_L1_EVICTIONS, "L1 evictions"),
            T(q.LMC_L2_STORES, "L2 stores"),
            T(q.LMC_L2_LOADS, "L2 prefetch loads"),
            unit="short",
            width=12,
        ),
    )
    d.row("Storage devices").add(
        ts(
            "Read / write bandwidth",
            T(q.DEV_READ_BPS, "read {{device}}"),
            T(q.DEV_WRITE_BPS, "write {{device}}"),
            unit="Bps",
            width=8,
        ),
        ts(
            "IOPS",
            T(q.DEV_READ_IOPS, "read {{device}}"),
            T(q.DEV_WRITE_IOPS, "write {{device}}"),
            unit="iops",
            width=8,
        ),
        ts(
            "Average I/O latency",
            T(q.DEV_READ_LAT, "read {{device}}"),
            T(q.DEV_WRITE_LAT, "write {{device}}"),
            unit="ms",
            width=8,
        ),
        ts("Utilisation (busy time)", T(q.DEV_UTIL, "{{device}}"), unit="percentunit", min=0, max=1, width=8),
        ts("Queue depth (I/Os in flight)", T(q.DEV_QUEUE, "{{device}}"), unit="short", width=8),
        ts(
            "Tier path usage", T(q.PATH_USAGE, "{{tier}} {{path}}"), unit="percentunit", min=0, max=1, width=8
        ),
        table(
            "NVMe / NVMe-oF paths by state",
            T(q.NVME_PATHS, "{{state}}"),
            width=24,
            height=5,
            description="Controller paths per state (live, connecting, resetting, deleting, dead) from "
            "/sys/class/nvme*.",
        ),
    )
    return d


def controller() -> Dashboard:
    d = Dashboard(
        uid="kvtier-controller",
        title="kvtier / Controller and predictor",
        description="The reconcile loop, its decisions and actuations, KV-event intake and the reuse "
        "predictor's quality.",
        variables=[
            datasource_var(),
            query_var("kv_engine", "Engine (as kvtier names it)", q.VAR_KV_ENGINE),
            query_var("tier", "Tier", q.VAR_TIER),
        ],
    )
    d.row("Health").add(
        stat("Sidecar up", T(q.SIDECAR_UP, "{{instance}}"), thresholds=((None, "red"), (1, "green"))),
        stat(
            "Predictor AUC",
            T(q.PREDICTOR_AUC, "AUC"),
            min=0,
            max=1,
            thresholds=((None, "red"), (0.6, "orange"), (0.75, "green")),
        ),
        stat("Tick p99", T(q.TICK_P99, "p99"), unit="s", thresholds=((None, "green"), (0.05, "red"))),
        stat(
            "Actuation failure ratio",
            T(q.ACTUATION_FAILURE_RATIO, "{{layer}}"),
            unit="percentunit",
            thresholds=((None, "green"), (0.05, "red")),
        ),
    )
    d.row("Decisions and actuations").add(
        ts("Decisions per second", T(q.DECISIONS, "{{action}} → {{tier}}"), unit="short", stack=True),
        ts("Actuations by outcome", T(q.ACTUATIONS, "{{layer}} {{outcome}}"), unit="short", stack=True),
        ts(
            "Actuation failure ratio",
            T(q.ACTUATION_FAILURE_RATIO, "{{layer}}"),
            unit="percentunit",
            min=0,
            max=1,
            width=8,
        ),
        ts("Circuit breaker open", T(q.CIRCUIT_OPEN, "{{layer}}"), unit="bool", min=0, max=1, width=8),
        ts("Ticks by outcome", T(q.TICKS_BY_OUTCOME, "{{outcome}}"), unit="short", stack=True, width=8),
        ts("Tick latency", T(q.TICK_P50, "p50"), T(q.TICK_P99, "p99"), unit="s", width=24, height=6),
    )
    d.row("KV events and collectors").add(
        ts("KV events received by type", T(q.KV_EVENTS, "{{type}}"), unit="short", stack=True, width=8),
        ts(
            "KV events lost",
            T(q.KV_EVENTS_LOST, "{{engine}}"),
            unit="short",
            width=8,
            description="Sequence gaps not recovered from the replay endpoint.",
        ),
        ts("Collector errors", T(q.COLLECTOR_ERRORS, "{{collector}}"), unit="short", width=8),
    )
    d.row("Predictor and shadow scoring").add(
        ts("Predictor AUC", T(q.PREDICTOR_AUC, "AUC"), unit="short", min=0, max=1, width=8),
        ts(
            "Predictor calibration",
            T(q.PREDICTOR_ECE, "expected calibration error"),
            T(q.PREDICTOR_BRIER, "Brier score"),
            unit="short",
            min=0,
            width=8,
        ),
        ts(
            "Shadow counterfactual hit rate",
            T(q.SHADOW_HIT_RATE, "{{action}}"),
            unit="percentunit",
            min=0,
            max=1,
            width=8,
            description="Scored shadow decisions whose move would have produced a hit.",
        ),
        ts(
            "Shadow counterfactual hits per second",
            T(q.SHADOW_HITS, "{{action}} → {{tier}}"),
            unit="short",
            stack=True,
            width=24,
            height=6,
        ),
    )
    return d


DASHBOARDS = {
    "kvtier-overview.json": overview,
    "kvtier-tiers.json": tiers,
    "kvtier-controller.json": controller,
}


def render() -> dict[str, str]:
    """File name → JSON text (sorted keys, 2-space indent, trailing newline)."""
    out = {}
    for name, build in DASHBOARDS.items():
        doc: dict[str, Any] = build().to_json()
        out[name] = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ap.add_argument("--out", type=Path, default=HERE)
    a = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = a.out / name
        if a.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python -m kvtier.dashboards.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
