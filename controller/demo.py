"""``kvtier demo``: three arms over the same trace on the simulator (:mod:`kvtier.replay.sim`).

- ``no_offload``: vLLM's HBM prefix cache only (what tiering is worth);
- ``default``: the cache layer's own default tiering (LMCache-like L1 LRU written through to L2);
- ``kvtier``: the same layer, driven by the real, unchanged sidecar (``build_sidecar``) in active mode
  through the ``memory`` actuator, on the simulation's clock (injected: the sidecar reads simulated time).
  Its index is fed by the layer's residency reports, its placement policy by the arriving requests, and its
  ticks run every ``tick_interval_s`` of simulated time; ``/``, ``/metrics`` and the API are served while it
  runs. The layer applies exactly the moves the sidecar counts as ``applied``.

Per arm: TTFT p50/p99 and output throughput with 95% confidence intervals (batch means), hit tokens per tier,
bytes per link. ``--speed`` paces the kvtier arm (simulated seconds per wall second; 0 = as fast as it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from kvtier.controller.policy_doc import (
    BudgetLimits,
    LinkBudgetConfig,
    PolicyDoc,
    PredictorSettings,
)
from kvtier.policies.base import Request
from kvtier.replay.sim.scenario import Scenario

ARMS = ("no_offload", "default", "kvtier")
RETRAIN_EVERY_S = 120.0  # simulated seconds between retrains of the sidecar's fallback reuse model
_SUMMARY_KEYS = ("ttft_p50_s", "ttft_p99_s", "throughput_tokens_per_s", "hit_ratio", "requests")


@dataclass
class DemoOptions:
    scenario: str = "demo-8b"
    max_requests: int | None = None
    concurrency: int | None = None
    speed: float = 0.0  # simulated seconds per wall second for the kvtier arm (0 = unpaced)
    duration_s: float | None = None  # wall seconds: stop the kvtier arm then (and serve until then)
    listen: str = "127.0.0.1:8787"
    state_dir: str | None = None
    seed: int = 0
    batches: int = 10


def policy_doc(sc: Scenario, reqs: list[Request], seed: int = 0) -> PolicyDoc:
    """The planner's tiers, budgets and recompute price, derived from the scenario's tier hardware and
    compute model (the same numbers the simulator runs)."""
    from kvtier.policies.tiers import HBM_BYTES_S, Tier, TierSpec

    bb = sc.block_bytes
    cpu = sc.tier(Tier.CPU)
    tiers = []
    for h in sc.tiers:
        if h.tier is Tier.GPU:
            bw = 1e15
        elif h.tier is Tier.CPU or cpu is None:
            bw = h.load_bandwidth_bytes_s
        else:  # loaded through L1: both links in series
            bw = 1.0 / (1.0 / h.load_bandwidth_bytes_s + 1.0 / cpu.load_bandwidth_bytes_s)
        # the planner's view of the tier: its capacity and the bandwidth a load from it into the engine gets
        tiers.append(TierSpec(h.tier, h.capacity_blocks, load_bandwidth_bytes_s=min(bw, HBM_BYTES_S)))
    budgets = []
    for h in sc.tiers[2:]:  # moves between the layer's tiers may use half of each link
        for link, bps in (
            (f"{h.tier.value}->cpu", h.load_bandwidth_bytes_s),
            (f"cpu->{h.tier.value}", h.write_bytes_s),
        ):
            budgets.append(
                LinkBudgetConfig(
                    link=link, bytes_per_s=bps / 2, ops_per_s=bps / 2 / bb, burst_s=sc.tick_interval_s
                )
            )
    mean_pos = sum(r.input_length for r in reqs) / max(1, len(reqs)) / 2
    return PolicyDoc(
        mode="active",
        tiers=tiers,
        budgets=budgets,
        default_budget=BudgetLimits(bytes_per_s=1e13, ops_per_s=1e6, burst_s=sc.tick_interval_s),
        block_size_tokens=sc.block_tokens,
        block_bytes=bb,
        prefill_s_per_token=sc.compute.mean_s_per_token(mean_pos),
        tick_interval_s=sc.tick_interval_s,
        shadow_horizon_s=300.0,
        hysteresis_s=4 * sc.tick_interval_s,
        predictor=PredictorSettings(kind="learned", retrain_interval_s=0.0, horizon_s=300.0, seed=seed),
    )


class KvtierArm:
    """The real sidecar wired to the simulator: memory actuator, residency reports, injected clock."""

    def __init__(self, sc: Scenario, reqs: list[Request], opts: DemoOptions) -> None:
        from prometheus_client import Gauge

        from kvtier.controller.app import create_app
        from kvtier.controller.root import build_sidecar
        from kvtier.controller.settings import Settings
        from kvtier.controller.status_page import install_status_page
        from kvtier.controller.store import StateStore
        from kvtier.controller.tier_metrics import PerTierMetrics
        from kvtier.replay.sim.actuator import MemoryActuator
        from kvtier.replay.sim.report import IndexReporter
        from kvtier.replay.sim.run import make_layer
        from kvtier.replay.sim.serving import ServingModel

        self.sc, self.reqs, self.opts = sc, reqs, opts
        self.t0_s = reqs[0].timestamp_ms / 1e3 if reqs else 0.0
        self.layer = make_layer(sc, offload=True)
        self.model = ServingModel(sc, self.layer, on_arrival=self._arrive, ticker=self._tick)
        self._tmp = None if opts.state_dir else tempfile.TemporaryDirectory(prefix="kvtier-demo-")
        state_dir = opts.state_dir or (self._tmp.name if self._tmp else ".")
        store = StateStore(state_dir)  # the policy document, persisted as `PUT /v1/policy` would
        try:
            store.put_json("policy", policy_doc(sc, reqs, opts.seed).model_dump(mode="json"))
        finally:
            store.close()
        settings = Settings.model_validate(
            {
                "serve": {
                    "listen": opts.listen,
                    "mode": "active",
                    "state_dir": state_dir,
                    "log_level": "WARNING",
                },
                "loop": {"policy": "learned", "policy_tier": "cpu"},
                "actuators": [{"kind": "memory", "layer": self.layer}],
            }
        )
        ingestor = _sim_ingestor(settings.collectors.index_max_blocks)
        # no engine URL: the simulator is the engine
        self.sidecar = build_sidecar(settings, ingestor=ingestor, clock=self.clock, emulated_engine=True)
        self.layer.observer = IndexReporter(self.sidecar.ingestor.index, sc.block_bytes, self.t0_s)
        self.loop = self.sidecar.plane.loop
        act = self.loop.actuators[0]
        assert isinstance(act, MemoryActuator)
        self.actuator = act
        self.app = create_app(self.sidecar)  # its start leaves the loop to the simulation (emulated_engine)
        self.history = install_status_page(self.app, self.sidecar.registry)
        self.baselines: dict[str, dict[str, Any]] = {}  # the other arms' figures, set before run()
        self.baseline_records: dict[str, list[Any]] = {}
        self.running = False
        self.app.add_api_route("/v1/demo", self.state, methods=["GET"], summary="The demo's arms so far")
        self.tier_metrics = PerTierMetrics(self.sidecar.registry)
        for h in sc.tiers:
            self.tier_metrics.capacity.labels(tier=h.tier.value).set(h.capacity_blocks * sc.block_bytes)
        reg = self.sidecar.registry
        so_far = "over the requests the kvtier arm has served so far"
        self.g_ttft = Gauge(
            "kvtier_demo_ttft_seconds",
            f"TTFT quantile per demo arm {so_far}, seconds.",
            ["arm", "quantile"],
            registry=reg,
        )
        self.g_tput = Gauge(
            "kvtier_demo_throughput_tokens_per_second",
            f"Output tokens/s per demo arm {so_far}.",
            ["arm"],
            registry=reg,
        )
        self._seen_hits: dict[str, int] = {}
        self._seen_links: dict[str, int] = {}
        self._seen_lookup = 0
        self.arrived = 0
        self._next_retrain = RETRAIN_EVERY_S
        self.stop = threading.Event()
        self.wall0 = 0.0

    def clock(self) -> float:
        """The sidecar's clock: trace seconds of the simulation's present."""
        return self.t0_s + self.model.clock()

    def _arrive(self, r: Request, now: float) -> None:
        self.arrived += 1
        pl = self.loop.placement
        if pl is not None:  # the placement policy sees the request stream (live: inferred from KV events)
            pl.requests.submit(r)
            pl.feed(None)

    def _tick(self, now: float) -> None:
        self.loop.tick()
        self.publish()
        if now >= self._next_retrain:  # as `POST /v1/model/retrain` (the plane task would run on wall time)
            self._next_retrain = now + RETRAIN_EVERY_S
            with contextlib.suppress(self.sidecar.plane.ctx.models.NotTrainable):
                self.sidecar.plane.ctx.models.retrain()
        if self.stop.is_set() or (
            self.opts.duration_s is not None and time.monotonic() - self.wall0 >= self.opts.duration_s
        ):
            raise _Stopped
        if self.opts.speed > 0:  # pace simulated time against the wall clock
            ahead = now / self.opts.speed - (time.monotonic() - self.wall0)
            if ahead > 0:
                self.stop.wait(ahead)

    def publish(self) -> None:
        """``kvtier_tier_*`` from the layer's own accounting (what the real layer's metrics would say)."""
        m, lay = self.tier_metrics, self.layer
        for t in lay.order:
            m.used.labels(tier=t.value).set(lay.resident(t) * lay.block_bytes)
        for name, n in lay.hit_tokens.items():
            if n > self._seen_hits.get(name, 0):
                m.hit_tokens.labels(tier=name).inc(n - self._seen_hits.get(name, 0))
                self._seen_hits[name] = n
        if lay.lookup_tokens > self._seen_lookup:
            m.lookup_tokens.inc(lay.lookup_tokens - self._seen_lookup)
            self._seen_lookup = lay.lookup_tokens
        links = lay.bytes_by_link()
        m.add_moved({k: v - self._seen_links.get(k, 0) for k, v in links.items()})
        self._seen_links = links
        if self.loop.tick_no % 10 == 0 or not self.running:
            _, figs = self.so_far()
            for arm, f in figs.items():
                self.g_ttft.labels(arm=arm, quantile="0.5").set(f["ttft_p50_s"])
                self.g_ttft.labels(arm=arm, quantile="0.99").set(f["ttft_p99_s"])
                self.g_tput.labels(arm=arm).set(f["throughput_tokens_per_s"])

    def applied_metric(self) -> float:
        """``kvtier_actuations_total{layer="memory", outcome="applied"}`` summed over actions."""
        total = 0.0
        for fam in self.sidecar.registry.collect():
            for s in fam.samples:
                if (s.name == "kvtier_actuations_total" and s.labels.get("layer") == "memory"
                        and s.labels.get("outcome") == "applied"):  # fmt: skip
                    total += s.value
        return total

    def so_far(self) -> tuple[int, dict[str, dict[str, float]]]:
        """Requests the kvtier arm has served (first token) and each arm's figures over as many requests."""
        from kvtier.replay.sim.stats import batch_stats

        recs = [r for r in list(self.model.result.records) if r.first_token_s >= 0]
        if not recs:
            return 0, {}
        out = {a: batch_stats(per[: len(recs)]) for a, per in self.baseline_records.items()}
        out["kvtier"] = batch_stats(recs)
        return len(recs), out

    def state(self) -> dict[str, Any]:
        """``GET /v1/demo``: the baseline arms and the kvtier arm so far (requests with a first token)."""
        n, figs = self.so_far()
        live = figs.get("kvtier", {})
        arms = {a: {k: rep[k] for k in _SUMMARY_KEYS if k in rep} for a, rep in self.baselines.items()}
        for a in arms:  # as many requests of the baselines, for a like-for-like line on the status page
            if a in figs:
                arms[a]["so_far"] = figs[a]
        return {
            "scenario": self.sc.name,
            "running": self.running,
            "requests": len(self.reqs),
            "arrived": self.arrived,
            "kvtier": {
                **live,
                "requests_done": n,
                "moves_applied": sum(self.actuator.applied.values()),
            },
            "arms": arms,
        }

    def run(self) -> dict[str, Any]:
        from kvtier.replay.sim.run import arm_report

        self.wall0 = time.monotonic()
        self.running = True
        try:
            self.model.run(self.reqs)
        except _Stopped:  # keep the leading requests that have their first token (the baselines re-run them)
            recs = self.model.result.records
            k = next((i for i, r in enumerate(recs) if r.first_token_s < 0), len(recs))
            del recs[k:]
            self.model.result.end_s = self.model.clock()
        finally:
            self.running = False
        self.publish()
        rep = arm_report(self.layer, self.model.result, self.opts.batches)
        rep["actuations_applied"] = dict(self.actuator.applied)
        rep["actuations_applied_total"] = sum(self.actuator.applied.values())
        rep["kvtier_actuations_applied_metric"] = self.applied_metric()
        rep["ticks"] = self.loop.tick_no
        rep["decisions"] = self.loop.decisions.total
        pl = self.loop.placement
        rep["placement"] = {
            k: v for k, v in (pl.info() if pl else {}).items() if k in ("name", "capacity_blocks")
        }
        return rep

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def _sim_ingestor(max_blocks: int | None) -> Any:
    """A :class:`KvIngestor` whose blocks tracked per tier (``kvtier_blocks_tracked``, the status page) are
    counted from the index: no KV events in the simulation, the layer's residency reports fill it."""
    from kvtier.collectors.kv_ingest import KvIngestor
    from kvtier.policies.index import BlockIndex

    class SimIngestor(KvIngestor):
        def blocks_tracked(self) -> dict[str, int]:
            return {t.value: int(n) for t, n in self.index.count_by_tier().items()}

    return SimIngestor(BlockIndex(max_blocks=max_blocks))


class _Stopped(Exception):
    """The kvtier arm was stopped (``--duration`` or the server shutting down)."""


def run_baseline(sc: Scenario, reqs: list[Request], arm: str, batches: int) -> tuple[dict[str, Any], Any]:
    from kvtier.replay.sim.run import make_layer, run_arm

    return run_arm(sc, reqs, make_layer(sc, offload=arm != "no_offload"), batches=batches)


def compare(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Paired per-batch differences kvtier - default and default - no_offload (mean, 95% half-width)."""
    from kvtier.replay.sim.stats import paired_diff

    out = {}
    if "kvtier" in arms and "default" in arms:
        out["kvtier_minus_default"] = paired_diff(arms["default"], arms["kvtier"])
    if "default" in arms and "no_offload" in arms:
        out["default_minus_no_offload"] = paired_diff(arms["no_offload"], arms["default"])
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _ci(v: float, hw: float, fmt: str, sign: str = "") -> str:
    return f"{format(v, sign + fmt)} ± {format(hw, fmt)}" if math.isfinite(hw) else format(v, sign + fmt)


def comparison_table(res: dict[str, Any]) -> Any:
    """A rich table: the three arms side by side, with 95% CIs and the kvtier - default difference."""
    from rich.table import Table

    arms = res["arms"]
    t = Table(title=f"kvtier demo — {res['scenario']}: {res['requests']} requests, "
                    f"concurrency {res['concurrency']} (95% CI, batch means)")  # fmt: skip
    t.add_column("metric")
    heads = {
        "no_offload": "no offload (HBM only)",
        "default": "layer default (LRU)",
        "kvtier": "kvtier (active)",
    }
    for a in ARMS:
        t.add_column(heads[a], justify="right")
    t.add_column("kvtier − default", justify="right")
    d = res["comparison"].get("kvtier_minus_default", {})
    for key, label, fmt in (("ttft_p50_s", "TTFT p50 (s)", ".2f"), ("ttft_p99_s", "TTFT p99 (s)", ".2f"),
                            ("throughput_tokens_per_s", "throughput (output tok/s)", ".1f")):  # fmt: skip
        diff = d.get(key)
        t.add_row(label, *(_ci(arms[a][key], arms[a][f"{key}_ci95"], fmt) for a in ARMS),
                  _ci(diff["mean"], diff["ci95"], fmt, "+") if diff else "")  # fmt: skip
    t.add_row("prefix hit (all tiers)", *(f"{100 * arms[a]['hit_ratio']:.1f}%" for a in ARMS), "")
    tiers = list(arms["default"]["hit_tokens_by_tier"])
    for tier in tiers:
        t.add_row(
            f"  hit tokens from {tier}",
            *(f"{arms[a]['hit_tokens_by_tier'].get(tier, 0):,}" for a in ARMS),
            "",
        )
    links = sorted({k for a in ARMS for k in arms[a]["bytes_by_link"]})
    for link in links:
        t.add_row(f"  bytes {link}", *(_fmt_bytes(arms[a]["bytes_by_link"].get(link, 0)) for a in ARMS), "")
    k = arms["kvtier"]
    t.add_row("sidecar moves applied", "", "", f"{k['actuations_applied_total']:,}", "")
    return t


def _round(x: float | None, digits: int = 3) -> str:
    """A figure for the console: ``n/a`` until it exists, else ``digits`` decimals."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def demo(
    scenario: str = typer.Option(
        "demo-8b", "--scenario", help="Bundled scenario (demo-8b, seed-480b) or a YAML."
    ),
    max_requests: int = typer.Option(None, "--max-requests", help="Replay only the first N requests."),
    concurrency: int = typer.Option(
        None, "--concurrency", min=1, help="Override the scenario's concurrency."
    ),
    speed: float = typer.Option(
        0.0, "--speed", help="Pace the kvtier arm: simulated s per wall s (0 = unpaced)."
    ),
    duration: float = typer.Option(None, "--duration", help="Stop the kvtier arm after S wall seconds."),
    listen: str = typer.Option("127.0.0.1:8787", "--listen", help="HOST:PORT for /, /metrics and the API."),
    state_dir: Path = typer.Option(None, "--state-dir", help="Keep policy/model here [a temporary dir]."),
    json_out: Path = typer.Option(None, "--json", help="Also write the three arms as JSON here."),
    seed: int = typer.Option(0, "--seed"),
    batches: int = typer.Option(10, "--batches", help="Batches for the confidence intervals."),
) -> None:
    """Three arms over the bundled trace on the simulator: no offload, the cache layer's default tiering,
    and the real sidecar driving the layer (TTFT p50/p99, throughput with 95% CIs, hits per tier, bytes)."""
    from rich.console import Console

    from kvtier.controller.logs import configure_logging
    from kvtier.usage import check_listen, describe, fail

    configure_logging("WARNING")
    console = Console() if sys.stdout.isatty() else Console(width=132)
    opts = DemoOptions(scenario, max_requests, concurrency, speed, duration, listen,
                       str(state_dir) if state_dir else None, seed, batches)  # fmt: skip
    try:
        from kvtier.controller.settings import ServeSettings

        host, port = ServeSettings(listen=listen).listen_host_port
    except ValueError as exc:
        fail(describe(exc))
    check_listen(host, port)  # before the arms run, not after
    try:
        res = run_demo(opts, console)
    except (ValueError, OSError, RuntimeError) as exc:
        fail(describe(exc))
    console.print(comparison_table(res))
    k = res["arms"]["kvtier"]
    console.print(
        f"sidecar: {k['ticks']} ticks, {k['decisions']} decisions, {k['actuations_applied_total']} moves "
        'applied by the layer = kvtier_actuations_total{outcome="applied"} '
        f"{k['kvtier_actuations_applied_metric']:.0f}"
    )
    if json_out:
        json_out.write_text(json.dumps(res, indent=2, default=str))


def run_demo(opts: DemoOptions, console: Any = None) -> dict[str, Any]:
    from kvtier.replay.sim.run import load_requests
    from kvtier.replay.sim.scenario import load_scenario

    sc = load_scenario(opts.scenario)
    if opts.concurrency is not None:
        sc = sc.with_serving(concurrency=opts.concurrency)
    reqs = load_requests(sc, max_requests=opts.max_requests)
    if not reqs:
        raise ValueError("no requests in the scenario's slice of the trace")
    say: Callable[[str], None] = console.print if console is not None else (lambda s: None)
    say(f"[bold]kvtier demo[/]: scenario {sc.name} — {sc.description}; {len(reqs)} requests, "
        f"concurrency {sc.serving.concurrency}, tiers "
        + " -> ".join(f"{h.tier.value} {h.capacity_blocks} blocks" for h in sc.tiers))  # fmt: skip
    arms: dict[str, dict[str, Any]] = {}
    records: dict[str, list[Any]] = {}
    for a in ("no_offload", "default"):
        t = time.monotonic()
        arms[a], res = run_baseline(sc, reqs, a, opts.batches)
        records[a] = res.records
        say(f"arm {a}: {time.monotonic() - t:.1f} s")
    arm = KvtierArm(sc, reqs, opts)
    arm.baselines, arm.baseline_records = dict(arms), records
    try:
        arms["kvtier"] = asyncio.run(_serve_while(arm, say))
    finally:
        arm.close()
    n = min(r["requests"] for r in arms.values())
    if n < len(reqs):  # the kvtier arm was stopped early: compare the same requests
        arms = {a: _truncate(sc, reqs[:n], a, opts, arms) for a in arms}
    return {
        "scenario": sc.name,
        "description": sc.description,
        "requests": n,
        "concurrency": sc.serving.concurrency,
        "arms": arms,
        "comparison": compare(arms),
    }


def _truncate(sc: Scenario, reqs: list[Request], a: str, opts: DemoOptions, arms: dict[str, Any]) -> Any:
    if a == "kvtier":
        return arms[a]
    return run_baseline(sc, reqs, a, opts.batches)[0]


async def _serve_while(arm: KvtierArm, say: Callable[[str], None]) -> dict[str, Any]:
    """Serve the sidecar's app while the kvtier arm runs in a worker thread (progress line every 5 s)."""
    import uvicorn

    host, port = arm.sidecar.settings.serve.listen_host_port
    server = uvicorn.Server(uvicorn.Config(arm.app, host=host, port=port, log_level="warning"))
    serve_task = asyncio.create_task(server.serve())
    while not server.started:
        if serve_task.done():
            serve_task.result()
            raise RuntimeError(f"could not serve on {host}:{port}")
        await asyncio.sleep(0.05)
    sock = server.servers[0].sockets[0].getsockname()
    url = f"http://{sock[0]}:{sock[1]}"
    say(f"status page: {url}/   metrics: {url}/metrics   API: {url}/docs")
    work = asyncio.create_task(asyncio.to_thread(arm.run))
    n = len(arm.reqs)
    try:
        while not work.done():
            done, _ = await asyncio.wait({work, serve_task}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            if serve_task in done and not work.done():  # the server stopped (SIGINT / SIGTERM)
                arm.stop.set()
                break
            print(
                f"progress: {arm.arrived}/{n} requests | simulated {arm.model.clock():.0f} s | "
                f"ticks {arm.loop.tick_no} | moves applied {sum(arm.actuator.applied.values())}",
                flush=True,
            )
        rep = await work
        if arm.opts.duration_s is not None:  # keep serving /, /metrics and the API until --duration
            left = arm.opts.duration_s - (time.monotonic() - arm.wall0)
            if left > 0 and not serve_task.done():
                await asyncio.wait({serve_task}, timeout=left)
        return rep
    finally:
        arm.stop.set()
        server.should_exit = True
        await serve_task
        sys.stdout.flush()


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
