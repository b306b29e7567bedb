"""``kvtier shadow-replay``: the live loop in shadow mode over a trace; prints the counterfactual report."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def shadow_replay(
    trace: Path = typer.Option(
        None, "--trace", help="Mooncake-format JSONL(.gz) trace [bundled conversation]."
    ),
    requests: int = typer.Option(3000, "--requests", min=1, help="First N requests."),
    gpu_blocks: int = typer.Option(3000, "--gpu-blocks", min=1, help="Emulated GPU prefix cache, blocks."),
    tick_s: float = typer.Option(5.0, "--tick-s", min=0.01, help="Loop tick period on the trace clock, s."),
    horizon_s: float = typer.Option(120.0, "--horizon-s", min=0.01, help="Came-back window for scoring, s."),
    policy: str = typer.Option("learned", "--policy", help="Placement policy of the CPU tier, or none."),
) -> None:
    """Replay a trace through an emulated GPU cache; score every shadow decision counterfactually."""
    from kvtier.controller.shadow_replay import run_shadow_replay
    from kvtier.policies.registry import is_available, known_policies
    from kvtier.replay.trace import TraceError, bundled_trace_path, load_trace
    from kvtier.usage import fail

    if policy != "none" and not is_available(policy):
        fail(f"policy {policy!r} is not available; known: none, {', '.join(known_policies())}")
    try:
        reqs = load_trace(trace or bundled_trace_path(), max_requests=requests)
    except TraceError as exc:
        fail(f"malformed trace: {exc}")
    except OSError as exc:
        fail(f"cannot read trace '{trace}': {exc.strerror or exc}")
    if not reqs:
        fail(f"trace '{trace}' has no requests")
    out = run_shadow_replay(
        reqs, gpu_blocks=gpu_blocks, tick_s=tick_s, horizon_s=horizon_s,
        policy_name=None if policy == "none" else policy,
    )  # fmt: skip
    out.pop("loop")
    typer.echo(json.dumps(out, indent=2))


def register(app: typer.Typer) -> None:
    app.command("shadow-replay")(shadow_replay)
