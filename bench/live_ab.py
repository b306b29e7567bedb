"""Live A/B on a managed real stack: a fresh LMCache MP + vLLM CPU per run, arms of `kvtier bench`.

Each run starts a fresh LMCache MP server and a fresh vLLM (LMCacheMPConnector, KV events) under a temporary
directory, replays the workload with :mod:`kvtier.replay.live_bench`, and stops both; the shadow/active
arms start ``kvtier serve --actuator lmcache-l1`` against them. Prints the bench table (ratios to baseline
measured in the same invocation, arms interleaved) and writes ``--json``.

Workloads: ``bundled`` (the Mooncake conversation trace), a Mooncake JSONL file, ``multiturn:SEED`` /
``docs:SEED`` (seeded generators of :mod:`kvtier.replay.synthetic`, traces the project does not ship) and
``once-again`` (every prompt comes back exactly once, eight prompts later: built so that second-sight
admission loses; the guard must put the sidecar back in shadow).

    . /work/main/.peers/env.sh   # KVTIER_LMCACHE_PYTHON, KVTIER_VLLM_PYTHON, KVTIER_TINY_MODEL
    python -m bench.live_ab --workload bundled --requests 1000 --repeat 3 --json ab.json

``--model DIR`` serves another local model (e.g. ``scripts/make_tiny_model.py DIR --hidden 512 --layers 8``,
whose prefill costs ~0.15 ms per token here against ~0.02 for the default): with it, size L1 in chunks
(``--l1-chunks 458``), which converts through the model's KV bytes per chunk, so the cache holds the same
share of the workload whatever the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.policies.base import Request
from kvtier.replay.live_bench import (
    BenchPlan,
    Target,
    build_requests,
    distinct_chunks,
    parse_arms,
    render_table,
    run_bench,
    table_console,
    to_json,
)

CHUNK = 64
MAX_PROMPT = 1024 - 64  # whole chunks below the managed vLLM's --max-model-len 1024 (2 output tokens)


def once_again_trace(n: int, *, chunks: int = 8, gap: int = 8, seed: int = 7) -> list[Request]:
    """Prompts P0, P1, ... each sent again ``gap`` prompts later, exactly once (one request per second)."""
    rng = np.random.default_rng(seed)
    base = int(rng.integers(1 << 40, 1 << 50))
    order: list[int] = []
    i = 0
    while len(order) < n:
        order.append(i)
        if i >= gap:
            order.append(i - gap)
        i += 1
    out = []
    for t, p in enumerate(order[:n]):
        ids = np.arange(base + p * chunks, base + (p + 1) * chunks, dtype=np.int64)
        out.append(Request(float(t * 1000), chunks * CHUNK, 2, ids, CHUNK))
    return out


def load_workload(spec: str, n: int) -> list[Request]:
    from kvtier.replay import synthetic
    from kvtier.replay.trace import bundled_trace_path, load_trace

    if spec == "bundled":
        return load_trace(bundled_trace_path(), max_requests=n)
    if spec == "once-again":
        return once_again_trace(n)
    kind, _, seed = spec.partition(":")
    if kind == "multiturn" and seed:
        return synthetic.multiturn_trace(n, seed=int(seed))[:n]
    if kind == "docs" and seed:
        return synthetic.shared_document_trace(n, seed=int(seed))[:n]
    return load_trace(Path(spec), max_requests=n)


class ManagedStack:
    """Fresh LMCache MP + vLLM per run (tests/peers recipes), torn down after it."""

    def __init__(self, root: Path, l1_gb: float, gpu_blocks: int, model: str | None = None) -> None:
        self.root, self.l1_gb, self.gpu_blocks, self.model = root, l1_gb, gpu_blocks, model
        self.lmc: Any = None
        self.vllm: Any = None
        self.target: Target | None = None

    def up(self, arm: str, i: int) -> Target:
        from tests.peers import vllm as vllm_peer
        from tests.peers.lmcache import LMCacheMPServer

        wd = self.root / f"run{i}_{arm}"
        self.lmc = LMCacheMPServer(wd, chunk_size=CHUNK, l1_gb=self.l1_gb).start()
        kvt = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.lmc.zmq_port,
                "lmcache.mp.mq_timeout": 30,
            },
        }
        self.vllm = vllm_peer.start(
            self.model,
            extra_args=["--kv-transfer-config", json.dumps(kvt)],
            num_gpu_blocks=self.gpu_blocks,
            workdir=wd / "vllm",
            replay_endpoint=None,
        )
        self.target = Target(self.vllm.url, self.lmc.url, vllm_peer.SERVED_MODEL)
        return self.target

    def down(self, arm: str, i: int) -> None:
        if self.vllm is not None:
            self.vllm.stop()
            self.vllm = None
        if self.lmc is not None:
            self.lmc.stop()
            shutil.rmtree(self.lmc.l2_dir, ignore_errors=True)
            self.lmc = None


def keeper_sidecar_args(t: Target, state_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """``kvtier serve`` flags of the bench's sidecar on stack ``t``: the L1 keeper, no placement policy."""
    return ["--engine-url", t.engine_url, "--lmcache-url", str(t.lmcache_url), "--actuator", "lmcache-l1",
            "--policy", "none", "--state-dir", str(state_dir), *extra]  # fmt: skip


def run_ab(
    workload: str,
    n: int,
    *,
    arms: Sequence[str] = ("baseline", "active"),
    repeat: int = 1,
    l1_gb: float = 0.028,
    gpu_blocks: int = 96,
    concurrency: int = 1,
    model: str | None = None,
    root: Path | None = None,
    progress: Any = None,
    sidecar_extra: Sequence[str] = (),
    arm_args: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """One interleaved A/B on fresh stacks -> the bench result (``{"arms": ...}``) + the workload facts."""
    trace = load_workload(workload, n)
    reqs = build_requests(trace, chunk=CHUNK, vocab=512, max_prompt_tokens=MAX_PROMPT, max_tokens=2)
    owns = root is None
    tmp = Path(root or tempfile.mkdtemp(prefix="kvtier-ab-"))
    stack = ManagedStack(tmp, l1_gb, gpu_blocks, model)
    holder: dict[str, Target] = {}

    holder_i: dict[str, int] = {}

    def before(arm: str, i: int) -> Target:
        holder["t"], holder_i["i"] = stack.up(arm, i), i
        return holder["t"]

    def args_for() -> list[str]:  # per run: the URLs change with every fresh stack
        return keeper_sidecar_args(holder["t"], tmp / f"state{holder_i['i']}", sidecar_extra)

    plan = BenchPlan(
        target=Target("", None, "tiny"),
        reqs=reqs,
        arms=list(arms),
        repeat=repeat,
        concurrency=concurrency or None,
        sidecar_args=args_for,
        workdir=tmp,
        sidecar_exe=[sys.executable, "-m", "kvtier"],
        arm_args=arm_args or {},
        before_run=before,
        after_run=stack.down,
    )
    try:
        out = run_bench(plan, progress)
    finally:
        stack.down("", -1)
        if owns:
            shutil.rmtree(tmp, ignore_errors=True)
    out["workload"] = {
        "spec": workload,
        "requests": len(reqs),
        "distinct_chunks": distinct_chunks(trace, chunk=CHUNK, max_prompt_tokens=MAX_PROMPT),
        "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "l1_gb": l1_gb,
        "gpu_blocks": gpu_blocks,
        "model": model or "default",
    }
    return out


def kv_bytes_per_chunk(model_dir: str | Path, chunk_tokens: int = CHUNK, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for one chunk of a Llama-style model (its ``config.json``), as LMCache stores it."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes * chunk_tokens


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="bundled")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--arms", default="baseline,active")
    ap.add_argument("--l1-gb", type=float, default=0.028, help="LMCache L1 size (GiB)")
    ap.add_argument("--l1-chunks", type=int, default=None,
                    help="LMCache L1 size in chunks of the served model (overrides --l1-gb)")  # fmt: skip
    ap.add_argument("--model", default=None, help="local model directory (default: KVTIER_TINY_MODEL)")
    ap.add_argument("--gpu-blocks", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sidecar-arg", action="append", default=[],
                    help="one more argument for every sidecar arm's `kvtier serve` (repeatable), "
                         "e.g. --sidecar-arg=--config --sidecar-arg=keeper.yaml")  # fmt: skip
    ap.add_argument("--arm-args", action="append", default=[],
                    help="LABEL=FLAGS: more `kvtier serve` flags for one arm only (repeatable), e.g. --arms "
                         "baseline,shadow,shadow/slow --arm-args 'shadow/slow=--config s.yaml'")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        arms, per_arm = parse_arms(a.arms, a.arm_args)
    except ValueError as e:
        ap.error(str(e))
    if a.l1_chunks is not None:
        from tests.peers.vllm import tiny_model

        a.l1_gb = round(a.l1_chunks * kv_bytes_per_chunk(a.model or tiny_model()) / 2**30, 4)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as prog:
        out = run_ab(a.workload, a.requests, arms=arms, repeat=a.repeat, l1_gb=a.l1_gb,
                     gpu_blocks=a.gpu_blocks, concurrency=a.concurrency, model=a.model, progress=prog,
                     sidecar_extra=a.sidecar_arg, arm_args=per_arm)  # fmt: skip
    table_console().print(render_table(out["arms"]))
    print(json.dumps(out["workload"]))
    if a.json:
        a.json.write_text(to_json(out))


if __name__ == "__main__":
    main()
