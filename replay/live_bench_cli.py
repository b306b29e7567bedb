"""``kvtier bench``: the command line of :mod:`kvtier.replay.live_bench` (flags -> plan -> table, JSON)."""

from __future__ import annotations

import shlex
from pathlib import Path

import httpx
import typer


def bench(
    trace: str = typer.Argument("bundled", help="Mooncake-format JSONL(.gz) trace, or 'bundled'."),
    engine_url: str = typer.Option(..., "--engine-url", help="OpenAI-compatible engine (vLLM) base URL."),
    lmcache_url: str = typer.Option(None, "--lmcache-url", help="LMCache MP HTTP URL (L1/L2 hit counters)."),
    model: str = typer.Option(..., "--model", help="Served model name for /v1/completions."),
    requests: int = typer.Option(1000, "--requests", min=1, help="First N requests of the trace."),
    chunk_tokens: int = typer.Option(64, "--chunk-tokens", min=1, help="Tokens per hash_id (= layer chunk)."),
    max_prompt_tokens: int = typer.Option(1024, "--max-prompt-tokens", min=1, help="Prompt cap, tokens."),
    vocab: int = typer.Option(512, "--vocab", min=16, help="Token ids are drawn below this."),
    max_tokens: int = typer.Option(2, "--max-tokens", min=1, help="Output tokens per request (cap)."),
    concurrency: int = typer.Option(1, "--concurrency", min=0, help="In-flight requests; 0 = trace clock."),
    time_scale: float = typer.Option(1.0, "--time-scale", min=1e-6, help="Trace clock speed-up (0 conc.)."),
    arms: str = typer.Option(
        "baseline,active", "--arms", help="Comma list of baseline, shadow, active, or variants MODE/NAME."
    ),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Interleaved repetitions per arm."),
    sidecar_args: str = typer.Option(
        "", "--sidecar-args", help="Flags for the `kvtier serve` the bench starts per shadow/active run."
    ),
    arm_args: list[str] = typer.Option(  # noqa: B008 - typer reads its options from defaults
        [], "--arm-args", help="LABEL=FLAGS: more `kvtier serve` flags for one arm only (repeatable)."
    ),
    sidecar_url: str = typer.Option(None, "--sidecar-url", help="Use this running sidecar instead."),
    reset_cmd: str = typer.Option(None, "--reset-cmd", help="Shell command run before each run."),
    seed: int = typer.Option(0, "--seed", help="Token generator seed."),
    json_out: Path = typer.Option(None, "--json", help="Write {'arms': {...}} here."),
    workdir: Path = typer.Option(Path(".kvtier-bench"), "--workdir", help="Sidecar logs go here."),
) -> None:
    """Live A/B: replay a trace against a real engine, per arm TTFT, throughput and hit tokens by source."""
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier.replay.live_bench import (
        BenchPlan,
        Target,
        build_requests,
        engine_max_len,
        parse_arms,
        prompt_cap,
        render_table,
        run_bench,
        table_console,
        to_json,
    )
    from kvtier.replay.trace import TraceError, bundled_trace_path, load_trace

    try:
        arm_list, per_arm = parse_arms(arms, arm_args)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--arms / --arm-args") from e
    if per_arm and sidecar_url:
        raise typer.BadParameter("per-arm flags need sidecars the bench starts", param_hint="--arm-args")
    path = bundled_trace_path() if trace == "bundled" else Path(trace)
    try:
        tr = load_trace(path, max_requests=requests)
    except (TraceError, OSError) as e:
        typer.echo(f"kvtier bench: cannot read trace {path}: {e}", err=True)
        raise typer.Exit(2) from e
    from kvtier.usage import describe, fail

    try:  # before any arm starts: an unreachable engine is one line now, not a sidecar timeout later
        httpx.get(engine_url.rstrip("/") + "/v1/models", timeout=10.0).raise_for_status()
    except (httpx.HTTPError, ValueError) as e:
        fail(f"cannot reach the engine at {engine_url}: {describe(e)}")
    cap = prompt_cap(max_prompt_tokens, engine_max_len(engine_url), max_tokens)
    reqs = build_requests(tr, chunk=chunk_tokens, vocab=vocab, max_prompt_tokens=cap,
                          max_tokens=max_tokens, time_scale=time_scale, seed=seed)  # fmt: skip
    plan = BenchPlan(
        target=Target(engine_url, lmcache_url, model),
        reqs=reqs,
        arms=arm_list,
        repeat=repeat,
        concurrency=concurrency or None,
        sidecar_args=shlex.split(sidecar_args),
        sidecar_url=sidecar_url,
        arm_args=per_arm,
        reset_cmd=reset_cmd,
        workdir=workdir,
        sidecar_exe=[sys.executable, "-m", "kvtier"],
    )
    console = Console(stderr=True)
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*cols, console=console, transient=True) as prog:
            result = run_bench(plan, prog)
    except (RuntimeError, OSError, httpx.HTTPError) as e:  # a peer went away, a sidecar did not start
        fail(describe(e))
    table_console().print(render_table(result["arms"]))
    if json_out:
        json_out.write_text(to_json(result))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
