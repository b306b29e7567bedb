"""``kvtier replay`` and ``kvtier compare``: what-if runs of placement policies over a trace."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer

from kvtier.usage import fail, require_module

_LONG_RUN_REQUESTS = 20_000  # show a progress bar when this many request-replays are ahead


@contextmanager
def _progress(total: int, label: str) -> Any:
    if total < _LONG_RUN_REQUESTS:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as prog:
        task = prog.add_task(label, total=total)
        yield lambda n: prog.update(task, completed=n)


def _fail(msg: str) -> NoReturn:
    fail(msg)


def _load(trace: str, max_requests: int | None, block_tokens: int) -> Any:
    from kvtier.replay.runner import load_workload
    from kvtier.replay.trace import TraceError

    try:
        return load_workload(trace, max_requests=max_requests, block_tokens=block_tokens)
    except TraceError as e:
        _fail(f"malformed trace: {e}")
    except OSError as e:
        _fail(f"cannot read trace {trace!r}: {e}")


def _check_policy(name: str) -> None:
    from kvtier.policies.registry import is_available, known_policies

    if not is_available(name):
        _fail(f"policy {name!r} is not available; known: {', '.join(known_policies())}")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def replay_cmd(
    trace: str = typer.Argument(..., help="Mooncake JSONL trace (.jsonl or .jsonl.gz), or 'bundled'."),
    policy: str = typer.Option("lru", "--policy", "-p", help="Policy name (see registry)."),
    capacity: float = typer.Option(
        None, "--capacity", help="Tier-0 capacity as a fraction of distinct blocks."
    ),
    capacity_blocks: int = typer.Option(None, "--capacity-blocks", help="Tier-0 capacity in blocks (wins)."),
    max_requests: int = typer.Option(None, "--max-requests", help="Replay only the first N requests."),
    per_request: Path = typer.Option(None, "--per-request", help="Write one JSON line per request here."),
    tiers: str = typer.Option(
        None, "--tiers", help="Tier config YAML/JSON, or a bundled name (llama3-8b, ...)."
    ),
    seed: int = typer.Option(0, "--seed"),
    block_tokens: int = typer.Option(512, "--block-tokens", help="Tokens per trace block."),
    fmt: str = typer.Option("table", "--format", help="json or table."),
) -> None:
    """Replay TRACE through one policy and print hit ratios (and TTFT/bytes per tier with --tiers)."""
    from kvtier.replay.runner import capacity_for, resolve_tiers, run_one

    if fmt not in ("json", "table"):
        _fail("--format must be json or table")
    if max_requests is not None and max_requests < 0:
        _fail("--max-requests must be >= 0")
    _check_policy(policy)
    wl = _load(trace, max_requests, block_tokens)
    tier_cfg = None
    if tiers is not None:
        try:
            tier_cfg = resolve_tiers(tiers)
        except (OSError, ValueError) as e:
            _fail(f"bad tier config: {e}")
    try:
        cap = capacity_for(capacity, capacity_blocks, wl.distinct_blocks)
    except ValueError as e:
        _fail(str(e))
    if cap is None and tier_cfg is None:
        _fail("give --capacity FRACTION or --capacity-blocks N (or --tiers FILE)")
    try:
        fh = open(per_request, "w") if per_request is not None else None  # noqa: SIM115
    except OSError as e:
        _fail(f"cannot write --per-request file: {e}")
    try:
        with _progress(len(wl.requests), f"{policy}") as prog:
            stats = run_one(wl, policy, cap, seed=seed, tiers=tier_cfg, per_request=fh, progress=prog)
    except ValueError as e:
        _fail(str(e))
    finally:
        if fh is not None:
            fh.close()
    d = stats.to_dict()
    if fmt == "json":
        typer.echo(json.dumps(d, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvtier replay: {policy} on {wl.path.name}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("policy", "capacity_blocks", "distinct_blocks", "requests", "block_accesses"):
        t.add_row(k, str(d[k]))
    t.add_row("block hit %", _pct(stats.block_hit_ratio))
    t.add_row("prefix hit % (token-weighted)", _pct(stats.prefix_hit_ratio))
    t.add_row("block accesses/s", str(d["block_accesses_per_s"]))
    if stats.ttft is not None:
        for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms", "no_cache_mean_ms"):
            t.add_row(f"TTFT {k}", f"{stats.ttft[k]:.1f}")
        for link, nb in stats.ttft["bytes_per_link"].items():
            t.add_row(f"bytes {link}", f"{nb / 2**30:.1f} GiB")
    con = Console()
    con.print(t)
    if stats.tiers is not None:
        tt = Table(title="per tier")
        cols = {
            "tier": "tier",
            "policy": "policy",
            "capacity_blocks": "blocks",
            "hit_blocks": "hits",
            "prefix_hit_tokens": "prefix tokens",
            "evictions": "evicted",
            "write_utilization": "write util",
        }
        for label in cols.values():
            tt.add_column(label, no_wrap=True)
        for row in stats.tiers:
            tt.add_row(*(str(row[c]) for c in cols))
        con.print(tt)


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fail("--plot needs matplotlib: pip install 'kvtier[plot]'")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = result["capacities"]
    for p in result["policies"]:
        ys = [100 * r["prefix_hit_ratio"] for r in result["results"] if r["policy"] == p]
        style: dict[str, Any] = {"linestyle": "--", "color": "black"} if p == "belady" else {}
        ax.plot(
            [100 * c for c in caps], ys, marker="o", label=p + (" (bound)" if p == "belady" else ""), **style
        )
    ax.set_xscale("log")
    ax.set_xticks([100 * c for c in caps if c > 0], [f"{100 * c:g}" for c in caps if c > 0])
    ax.minorticks_off()
    ax.set_xlabel("capacity, % of distinct blocks")
    ax.set_ylabel("token-weighted prefix hit, %")
    ax.set_title(Path(result["trace"]).name)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare_cmd(
    trace: str = typer.Argument(..., help="Mooncake JSONL trace (.jsonl or .jsonl.gz), or 'bundled'."),
    policies: str = typer.Option(
        "lru,fifo,lfu,lfuda,s3fifo,arc,leaf-lru,belady", "--policies", help="Comma-separated policy names."
    ),
    capacities: str = typer.Option(
        "0.01,0.02,0.05,0.1,0.2,0.4", "--capacities", help="Comma-separated fractions."
    ),
    max_requests: int = typer.Option(None, "--max-requests"),
    seed: int = typer.Option(0, "--seed"),
    block_tokens: int = typer.Option(512, "--block-tokens"),
    fmt: str = typer.Option("table", "--format", help="json or table."),
    plot: Path = typer.Option(None, "--plot", help="Also write hit ratio vs capacity to this PNG."),
) -> None:
    """Run several policies at several capacities; table of prefix/block hit and LRU->Belady gap closed."""
    from kvtier.replay.runner import compare

    if fmt not in ("json", "table"):
        _fail("--format must be json or table")
    if plot is not None:  # before minutes of work, not after
        require_module("matplotlib", "plot", "--plot")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    for extra in ("lru", "belady"):  # the gap needs both ends
        if extra not in names:
            names.append(extra)
    for n in names:
        _check_policy(n)
    try:
        fracs = [float(c) for c in capacities.split(",") if c.strip()]
    except ValueError:
        _fail(f"--capacities must be comma-separated fractions, got {capacities!r}")
    if not fracs or any(not 0 <= f <= 1 for f in fracs):
        _fail("--capacities must be fractions in [0, 1]")
    wl = _load(trace, max_requests, block_tokens)
    with _progress(len(wl.requests) * len(names) * len(fracs), "compare") as prog:
        result = compare(wl, names, fracs, seed=seed, progress=prog)
    if plot is not None:
        _plot(result, plot)
    if fmt == "json":
        typer.echo(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    cells = {(r["policy"], r["capacity"]): r for r in result["results"]}
    head = [f"{100 * f:g}% ({cells[(names[0], f)]['capacity_blocks']})" for f in fracs]
    for metric, title in (
        ("prefix_hit_ratio", "token-weighted prefix hit, %"),
        ("block_hit_ratio", "block hit, %"),
        ("gap_closed", "gap closed on prefix hit, (policy-LRU)/(Belady-LRU)"),
    ):
        t = Table(title=f"{wl.path.name}: {title}")
        # the names never shrink (at 80 columns, e.g. piped, six capacities used to squeeze them to
        # nothing); a capacity header wraps onto two lines instead
        t.add_column("policy", no_wrap=True, min_width=max(len(p) for p in names))
        for h in head:
            t.add_column(h, justify="right")
        for p in names:
            vals = [cells[(p, f)].get(metric) for f in fracs]
            if metric == "gap_closed":
                t.add_row(p, *("n/a" if v is None else f"{v:+.2f}" for v in vals))
            else:
                t.add_row(p, *(f"{100 * v:.1f}" for v in vals))
        con.print(t)
    if plot is not None:
        print(f"plot written to {plot}", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay_cmd)
    app.command("compare")(compare_cmd)
