"""``kvtier demo``: the full sidecar over the bundled real trace driving an emulated tiered cache.

No engine needed. The same :class:`ControlledSidecar` as ``kvtier serve`` (collectors, reconcile loop in
shadow mode, policy API, ``/metrics``, status page at ``/``) watches an emulated HBM -> DRAM -> NVMe ->
remote cache (:mod:`kvtier.controller.emulated`, bandwidths and KV geometry of ``--model`` from
``replay/configs``) whose HBM is run by kvtier's learned policy; the cache layer's default, LRU, runs the
same trace side by side. The trace is replayed at ``--speed`` x its own pace; the loop's clock is the
trace's. Ends with a comparison: prefix hit per tier, bytes moved, estimated TTFT p50/p99, throughput.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

DEFAULT_SPEED = 60.0


@dataclass
class DemoOptions:
    model: str = "llama3-8b"
    speed: float = DEFAULT_SPEED  # trace seconds per wall second
    duration_s: float | None = None  # wall seconds; None = until the trace ends
    listen: str = "127.0.0.1:8787"
    max_requests: int | None = None
    state_dir: str | None = None
    seed: int = 0
    batch: int = 64  # most requests served per step (the loop and API run between steps)


def _locked(lock: threading.Lock, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **kw: Any) -> Any:
        with lock:
            return fn(*a, **kw)

    return run


class Demo:
    """Builds the sidecar, the two emulated caches and the trace pacing (no I/O until :meth:`run`)."""

    def __init__(self, opts: DemoOptions) -> None:
        from kvtier.controller.control_sidecar import ControlledSidecar, create_controlled_app
        from kvtier.controller.emulated import EmulatedCache, EmulatedIngestor, with_lower_policy
        from kvtier.controller.policy_doc import PolicyDoc, PredictorSettings, TierConfig
        from kvtier.controller.settings import Settings
        from kvtier.controller.status_page import install_status_page
        from kvtier.controller.tier_metrics import TierMetrics
        from kvtier.policies.tiers import normalize_tier
        from kvtier.replay.runner import load_workload, resolve_tiers
        from kvtier.replay.tiers import TierStack

        if opts.speed <= 0:
            raise ValueError("--speed must be > 0")
        self.opts = opts
        tc = with_lower_policy(resolve_tiers(opts.model), "lru")
        self.tier_config = tc
        self.workload = load_workload("bundled", max_requests=opts.max_requests, block_tokens=tc.block_tokens)
        reqs = self.workload.requests
        self.t0_ms = reqs[0].timestamp_ms if reqs else 0.0
        self.now_s = self.t0_ms / 1e3
        self._tmp = None if opts.state_dir else tempfile.TemporaryDirectory(prefix="kvtier-demo-")
        state_dir = opts.state_dir or (self._tmp.name if self._tmp else ".")
        settings = Settings(
            engine_urls=[],
            listen=opts.listen,
            mode="shadow",
            actuators=["shadow"],
            state_dir=state_dir,
            log_level="WARNING",
        )
        self.sidecar = ControlledSidecar(settings, ingestor=EmulatedIngestor())
        self.sidecar.emulated_engine = True
        plane = self.sidecar.plane
        self.lock = threading.Lock()
        loop = plane.loop
        loop.clock = self.clock  # the loop, its scoring and its models run on the trace's clock
        plane.ctx.clock = self.clock
        loop.tick = _locked(self.lock, loop.tick)  # type: ignore[method-assign]
        plane.ctx.models.retrain = _locked(self.lock, plane.ctx.models.retrain)  # type: ignore[method-assign]
        distinct = self.workload.distinct_blocks
        bb = tc.block_bytes
        learned = TierStack.build(tc, "learned", distinct, seed=opts.seed)
        baseline = TierStack.build(tc, "lru", distinct, seed=opts.seed)
        self.tier_metrics = TierMetrics(self.sidecar.registry)
        self.learned = EmulatedCache(learned, index=self.sidecar.ingestor.index, metrics=self.tier_metrics)
        self.lru = EmulatedCache(baseline)
        doc = PolicyDoc(
            mode="shadow",
            tiers=[
                TierConfig(
                    tier=normalize_tier(s.name),
                    capacity_blocks=st.policy.capacity_blocks,
                    load_bandwidth_bytes_s=max(s.read_gbps, 1e-3) * 1e9 if k else 2e12,
                )
                for k, (s, st) in enumerate(zip(tc.tiers, learned._t, strict=True))
            ],
            block_size_tokens=tc.block_tokens,
            block_bytes=bb,
            prefill_s_per_token=1.0 / tc.model.prefill_tokens_per_s,
            tick_interval_s=0.5,
            shadow_horizon_s=300.0,
            hysteresis_s=300.0,
            predictor=PredictorSettings(
                kind="learned", retrain_interval_s=5.0, horizon_s=300.0, seed=opts.seed
            ),
        )
        loop.set_policy(doc)
        loop._commit_policy()
        self.app = create_controlled_app(self.sidecar)
        self.history = install_status_page(self.app, self.sidecar.registry)
        self.served = 0
        self.started_wall = 0.0
        self.finished = False
        self._snapshotted = False

    def clock(self) -> float:
        """Trace time (s) of the request being replayed."""
        return self.now_s

    def step(self, wall_elapsed_s: float) -> int:
        """Serve the requests due by ``wall_elapsed_s`` (at most ``batch``); returns how many."""
        reqs = self.workload.requests
        due_ms = self.t0_ms + wall_elapsed_s * self.opts.speed * 1e3
        n = 0
        with self.lock:
            while (
                self.served < len(reqs) and n < self.opts.batch and reqs[self.served].timestamp_ms <= due_ms
            ):
                r = reqs[self.served]
                self.now_s = r.timestamp_ms / 1e3
                self.learned.serve(r)
                self.lru.serve(r)
                if (pl := self.sidecar.plane.loop.placement) is not None:
                    pl.requests.submit(r)  # the loop's own policy object sees the same request stream
                    pl.feed()  # served as it arrives (bounded, skipped while a tick holds the policy)
                self.served += 1
                n += 1
            self.learned.publish()
            if not self._snapshotted and self.served >= 150:  # the model's first T0: a populated index
                self.sidecar.plane.ctx.models.snapshot()
                self._snapshotted = True
        self.finished = self.served >= len(reqs)
        return n

    def comparison(self) -> dict[str, Any]:
        tc = self.tier_config
        return {
            "model": tc.model.name,
            "tiers": [t.name for t in tc.tiers],
            "requests": self.served,
            "trace_requests": len(self.workload.requests),
            "trace_seconds": round(self.now_s - self.t0_ms / 1e3, 1),
            "lru": self.lru.report(),
            "learned": self.learned.report(),
            "controller": {
                "ticks": self.sidecar.plane.loop.tick_no,
                "decisions": self.sidecar.plane.loop.decisions.total,
                "shadow": self.sidecar.plane.loop.decisions.report.to_dict(),
                "model": {
                    k: v for k, v in self.sidecar.plane.ctx.models.info().items() if k != "calibration"
                },
            },
        }

    async def run(self, progress: Callable[[Demo], None], on_ready: Callable[[str], None]) -> dict[str, Any]:
        import uvicorn

        host, port = self.sidecar.settings.listen_host_port
        server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning"))
        serve_task = asyncio.create_task(server.serve())
        while not server.started:
            if serve_task.done():
                serve_task.result()
                raise RuntimeError(f"could not serve on {host}:{port}")
            await asyncio.sleep(0.05)
        sock = server.servers[0].sockets[0].getsockname()
        on_ready(f"http://{sock[0]}:{sock[1]}")
        self.started_wall = time.monotonic()
        last_progress = 0.0
        try:
            while True:
                el = time.monotonic() - self.started_wall
                if self.opts.duration_s is not None and el >= self.opts.duration_s:
                    break
                if serve_task.done():  # the server stopped (SIGINT / SIGTERM)
                    break
                n = await asyncio.to_thread(self.step, el)
                if self.finished:
                    break
                if el - last_progress >= 0.5:
                    progress(self)
                    last_progress = el
                if n < self.opts.batch:  # caught up with the accelerated clock: let the loop and API run
                    await asyncio.sleep(0.05)
            progress(self)
            return self.comparison()
        finally:
            server.should_exit = True
            await serve_task
            if self._tmp is not None:
                self._tmp.cleanup()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def comparison_table(res: dict[str, Any]) -> Any:
    """A rich table: LRU vs learned, per tier prefix hit, bytes moved, TTFT p50/p99, throughput."""
    from rich.table import Table

    a, b = res["lru"], res["learned"]
    t = Table(
        title=f"kvtier demo — {res['model']}, {res['requests']} requests "
        f"({res['trace_seconds']:.0f} s of trace): cache layer LRU vs kvtier learned"
    )
    t.add_column("metric")
    t.add_column("LRU (default)", justify="right")
    t.add_column("kvtier learned", justify="right")
    t.add_column("change", justify="right")

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    t.add_row(
        "prefix hit (all tiers)",
        pct(a["prefix_hit"]),
        pct(b["prefix_hit"]),
        f"{100 * (b['prefix_hit'] - a['prefix_hit']):+.1f} pt",
    )
    for tier in res["tiers"]:
        x, y = a["prefix_hit_by_tier"].get(tier, 0.0), b["prefix_hit_by_tier"].get(tier, 0.0)
        t.add_row(f"  prefix hit from {tier}", pct(x), pct(y), f"{100 * (y - x):+.1f} pt")
    ta, tb = a["bytes_moved_total"], b["bytes_moved_total"]
    t.add_row(
        "bytes moved (all links)",
        _fmt_bytes(ta),
        _fmt_bytes(tb),
        f"{(tb / ta - 1) * 100:+.0f}%" if ta else "",
    )
    for link in sorted(set(a["bytes_moved"]) | set(b["bytes_moved"])):
        x, y = a["bytes_moved"].get(link, 0), b["bytes_moved"].get(link, 0)
        t.add_row(f"  {link}", _fmt_bytes(x), _fmt_bytes(y), f"{(y / x - 1) * 100:+.0f}%" if x else "")
    for key, label in (("ttft_p50_ms", "TTFT p50 (est.)"), ("ttft_p99_ms", "TTFT p99 (est.)")):
        x, y = a[key], b[key]
        t.add_row(label, f"{x:.0f} ms", f"{y:.0f} ms", f"{(y / x - 1) * 100:+.1f}%" if x else "")
    x, y = a["throughput_tokens_s"], b["throughput_tokens_s"]
    t.add_row(
        "throughput (prefill-bound)",
        f"{x:,.0f} tok/s",
        f"{y:,.0f} tok/s",
        f"{(y / x - 1) * 100:+.1f}%" if x else "",
    )
    x, y = a["throughput_req_s"], b["throughput_req_s"]
    t.add_row("  requests/s", f"{x:.2f}", f"{y:.2f}", f"{(y / x - 1) * 100:+.1f}%" if x else "")
    return t


def _round(x: float | None, digits: int = 3) -> str:
    """A figure for the console: ``n/a`` until it exists, else ``digits`` decimals."""
    return "n/a" if x is None else f"{x:.{digits}f}"


def demo(
    model: str = typer.Option(
        "llama3-8b", "--model", help="Model tier config (replay/configs) or a YAML path."
    ),
    speed: float = typer.Option(DEFAULT_SPEED, "--speed", help="Trace seconds replayed per wall second."),
    duration: float = typer.Option(None, "--duration", help="Stop after S wall seconds [end of trace]."),
    listen: str = typer.Option("127.0.0.1:8787", "--listen", help="HOST:PORT for /, /metrics and the API."),
    max_requests: int = typer.Option(None, "--max-requests", help="Replay only the first N requests."),
    state_dir: Path = typer.Option(None, "--state-dir", help="Keep policy/model here [a temporary dir]."),
    json_out: Path = typer.Option(None, "--json", help="Also write the final comparison as JSON here."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Run the full sidecar over the bundled real trace on an emulated HBM->DRAM->NVMe->remote cache;
    compare kvtier's learned policy with the cache layer's LRU (prefix hit per tier, bytes moved, TTFT)."""
    from rich.console import Console

    from kvtier.controller.logs import configure_logging
    from kvtier.usage import check_listen, describe, fail

    configure_logging("WARNING")
    console = Console()
    try:
        from kvtier.controller.settings import Settings

        host, port = Settings(listen=listen).listen_host_port
    except ValueError as exc:
        fail(describe(exc))
    check_listen(host, port)  # before the replay is loaded, not after
    try:
        d = Demo(
            DemoOptions(
                model=model,
                speed=speed,
                duration_s=duration,
                listen=listen,
                max_requests=max_requests,
                state_dir=str(state_dir) if state_dir else None,
                seed=seed,
            )
        )
    except (ValueError, OSError) as exc:
        fail(describe(exc))
    n = len(d.workload.requests)
    tc = d.tier_config
    console.print(
        f"[bold]kvtier demo[/]: {n} requests of the bundled conversation trace at {speed:g}x, "
        f"model {tc.model.name} ({tc.block_bytes / 2**20:.0f} MiB per {tc.block_tokens}-token block), "
        f"tiers {' -> '.join(t.name for t in tc.tiers)}"
    )
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    live = sys.stdout.isatty()
    bar = Progress(
        TextColumn("[bold]replay"),
        BarColumn(bar_width=16),  # the whole line fits in 120 columns with the figures below
        TextColumn("{task.completed}/{task.total} req"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not live,
    )
    task = bar.add_task("replay", total=n, info="")
    last_line = [0.0]

    def progress(x: Demo) -> None:
        a, b = x.lru.report(), x.learned.report()
        info = (
            f"trace {x.now_s - x.t0_ms / 1e3:.0f}s | hit LRU {100 * a['prefix_hit']:.1f}% "
            f"learned {100 * b['prefix_hit']:.1f}% | "
            f"TTFT p50 {a['ttft_p50_ms']:.0f}/{b['ttft_p50_ms']:.0f} ms"
            f" | {x.sidecar.plane.loop.decisions.total} decisions"
        )
        bar.update(task, completed=x.served, info=info)
        now = time.monotonic()
        if not live and now - last_line[0] >= 5.0:
            last_line[0] = now
            print(f"progress: {x.served}/{n} requests | {info}", flush=True)

    def ready(url: str) -> None:
        console.print(f"status page: [link={url}/]{url}/[/link]   metrics: {url}/metrics   API: {url}/docs")

    try:
        with bar:
            res = asyncio.run(d.run(progress, ready))
    except (RuntimeError, OSError, SystemExit) as exc:
        fail(describe(exc))
    console.print(comparison_table(res))
    c = res["controller"]
    console.print(
        f"controller: {c['ticks']} ticks, {c['decisions']} shadow decisions, "
        f"shadow precision {_round(c['shadow'].get('precision'))}, "
        f"predictor AUC {_round(c['model'].get('auc'))}"
    )
    if json_out:
        json_out.write_text(json.dumps(res, indent=2, default=str))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
