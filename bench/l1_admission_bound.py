"""How much L1-hit room is there for an admission policy on a workload? The calibrated simulator's answer.

The L1 keeper (``--actuator lmcache-l1``) can only do two things to LMCache MP's L1: drop a chunk right after
the engine stored it (its L2 copy stays) and load a chunk's prefix back from L2. This bench runs those two
levers in the simulator's LMCache model (``scenarios/cpu-tiny.yaml``: whole-prompt L1 touch, tail-first LRU,
L2 hits only temporarily in L1, the 1 s watermark eviction loop; its default-policy L1 counts match the real
stack's, docs/perf/calibration.md) over ``bench.live_ab``'s workload, and prints LMCache's L1 lookup-hit
tokens per policy against the layer's default:

- ``second-sight``: the keeper with ``probation_chunks: 0`` -- drop a chunk at its first sighting, load the
  prefix through it back into L1 when a lookup next finds it in L2 (drops decided by :class:`AdmissionCore`);
- ``probation N``: what the keeper does with ``probation_chunks: N`` -- a first-sight chunk stays in L1 until
  N newer first-sight chunks arrived, then is dropped unless it was seen again (the small FIFO of S3-FIFO),
  same readmission (:class:`AdmissionCore` with ``probation``, called as the keeper calls it);
- ``probation N + cold F`` (with ``--cold-fill``): what the keeper does with ``cold_fill: F`` -- probation
  admission plus cold-chain eviction: the modelled L1 is kept under F x capacity by dropping the chunks of
  the chains least likely continued next (:class:`ChainHazard`), instead of leaving the choice to the
  layer's LRU at its watermark;
- ``oracle``: bypass exactly the chunks that are never used again (future knowledge): the ceiling of
  admission on this workload (no readmission needed);
- ``hazard B`` (with ``--prefetch-budgets``): probation 32 plus L2 -> L1 prefetch *ahead of* predicted
  reuse. An online, causal estimate of the chance that a request's chain is continued (a later prompt
  extends it) by the chain's age in requests (:class:`ChainHazard`) ranks the live chains; the best ones, up
  to B chunks, are kept loaded in L1 and those that fall out are dropped again. Not a keeper option: it is
  here to measure whether the prefetch lever pays on a workload (docs/perf/live_ab_lmcache_l1.md);
  ``oracle-prefetch`` (printed with it) is its ceiling: probation 32 plus each prompt's chunks loaded from
  L2 just before the prompt comes (future knowledge).

It also prints what the oracle knows that a causal policy would need: the reuse rate of first-sight chunks
by the features the layer sees at store time (position in the prompt, prefix hit depth). Flat rates mean
no store-time feature separates reused from single-use chunks. Requests are paced ``--pace`` s apart (the
live bench's closed loop runs at about one request per 0.2-0.3 s here). For the first ``--hold-s`` seconds
the policies decide but do not act, as the keeper sits in shadow until its measured guard is calibrated
(2 x 10 s): acting from a cold start empties L1 while nothing is reused yet, which cost the simulator
about 5 points of probation's live gain before it modelled the hold.
Record: docs/perf/live_ab_lmcache_l1.md.

    python -m bench.l1_admission_bound --requests 1000          # ~20 s
    python -m bench.l1_admission_bound --workload multiturn:7 --requests 500
    python -m bench.l1_admission_bound --pace 0.05 --prefetch-budgets 150,350   # + hazard prefetch, ~1 min
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from bench.calibrate_sim import sim_requests
from bench.live_ab import load_workload
from kvtier.policies.base import Request
from kvtier.policies.chain_hazard import ChainHazard
from kvtier.policies.l1_admission import AdmissionCore
from kvtier.policies.tiers import Tier
from kvtier.replay.sim.run import make_layer
from kvtier.replay.sim.scenario import Scenario, load_scenario

NEVER = 1 << 62  # next-use index of a chunk that is not used again


@dataclass(frozen=True)
class BoundRow:
    """One policy's result: LMCache L1 / L2 lookup-hit tokens, chunks dropped from and reloaded into L1."""

    policy: str
    l1_hit_tokens: int
    l2_hit_tokens: int
    drops: int
    readmits: int


def next_use(chains: Sequence[Sequence[int]]) -> list[dict[int, int]]:
    """Per request, each chunk's index of the next request that uses it (``NEVER`` if none)."""
    out: list[dict[int, int]] = [{} for _ in chains]
    last: dict[int, int] = {}
    for i in range(len(chains) - 1, -1, -1):
        out[i] = {b: last.get(b, NEVER) for b in chains[i]}
        for b in chains[i]:
            last[b] = i
    return out


def simulate(
    sc: Scenario,
    reqs: Sequence[Request],
    policy: str,
    *,
    probation: int = 0,
    cold_fill: float | None = None,
    status_every_s: float = 2.0,
    pace_s: float = 0.25,
    prefetch_budget: int = 0,
    by_turn: bool = False,
    hold_s: float = 0.0,
    readmit_by_gap: bool = False,
) -> BoundRow:
    """``policy`` in ``default``, ``second-sight``, ``probation``, ``oracle``, ``hazard``,
    ``oracle-prefetch`` (see the module doc). ``hold_s``: simulated seconds from the start in which the
    policy decides but does not act (the keeper's calibration in shadow). ``readmit_by_gap``: the keeper's
    ``readmit_by_gap`` (False: every dropped chunk seen again is readmitted)."""
    layer = make_layer(sc, offload=True)
    chains = [[int(x) for x in r.hash_ids] for r in reqs]
    nxt = next_use(chains) if policy == "oracle" else []
    if policy in ("hazard", "oracle-prefetch"):
        probation = 32
    core = AdmissionCore(
        capacity=sc.tiers[1].capacity_blocks,
        probation=probation,
        cold_fill=cold_fill,
        readmit_by_gap=readmit_by_gap,
    )
    hazard = ChainHazard(by_turn=by_turn)
    held: set[int] = set()
    dropped: set[int] = set()
    drops = readmits = 0
    next_status = 0.0
    for i, (r, chain) in enumerate(zip(reqs, chains, strict=True)):
        layer.now = i * pace_s
        if policy == "oracle-prefetch":  # future knowledge: this prompt's chunks, loaded just before it
            readmits += sum(layer.promote(b, Tier.CPU) == "" for b in chain)
        if cold_fill is not None and layer.now >= next_status:  # the keeper's /status read
            core.set_occupancy(layer.resident(Tier.CPU))
            next_status = layer.now + status_every_s
        found = layer.lookup(chain, r.input_length, r.block_tokens)
        layer.store(chain, found.hit_blocks)
        new = chain[found.hit_blocks :]
        if policy == "second-sight":
            victims = [int(str(k)) for k in core.observe(new)]
        elif policy in ("probation", "hazard", "oracle-prefetch"):  # the keeper's call; this store droppable
            victims = [int(str(k)) for k in core.observe(chain, droppable=set(new))]
        elif policy == "oracle":
            victims = [b for b in new if nxt[i][b] == NEVER]
        else:
            victims = []
        # second sight of a dropped chunk, found in L2: the keeper reloads the prefix through the last one
        # worth it, after the store (it learns of the look-up from the store's KV event)
        back = [k for k, b in enumerate(chain) if b in dropped and found.tiers[k] is Tier.DISK]
        dropped.difference_update(chain[k] for k in back)
        back = [k for k in back if core.readmit_pays(chain[k])]
        if back:
            readmits += sum(layer.promote(a, Tier.CPU) == "" for a in chain[: back[-1] + 1])
        if layer.now < hold_s:  # the keeper's calibration: decisions made, none acted
            victims = []
        if policy == "hazard":
            hazard.observe(i, chain)
            target = {int(str(b)) for b in hazard.hold(i, prefetch_budget)}
            recent = set(chain)
            victims = [b for b in victims if b not in target]
            victims += [b for b in held - target if b not in recent]  # fell out of the held set
            readmits += sum(layer.promote(b, Tier.CPU) == "" for b in sorted(target - set(victims)))
            held = target
        for b in victims:
            if layer.evict(b, Tier.CPU) == "":
                dropped.add(b)
                drops += 1
    look = layer.layer_lookup_tokens
    name = {"probation": f"probation {probation}", "hazard": f"hazard {prefetch_budget}"}.get(policy, policy)
    if cold_fill is not None:
        name += f" + cold {cold_fill:g}"
    if readmit_by_gap:
        name += " + gap"
    return BoundRow(name, look.get("cpu", 0), look.get("disk", 0), drops, readmits)


def store_time_reuse(reqs: Sequence[Request]) -> dict[str, dict[str, tuple[int, float]]]:
    """Reuse rate of first-sight chunks by store-time feature -> {feature: {value: (chunks, rate)}}."""
    chains = [[int(x) for x in r.hash_ids] for r in reqs]
    nxt = next_use(chains)
    seen: set[int] = set()
    n: dict[str, Counter[str]] = {}
    reused: dict[str, Counter[str]] = {}
    for i, chain in enumerate(chains):
        hit = next((k for k, b in enumerate(chain) if b not in seen), len(chain))
        for k, b in enumerate(chain):
            if b in seen:
                continue
            feats = {"chunks from the prompt's end": min(len(chain) - 1 - k, 3), "prefix hit depth (chunks)":
                     min(hit, 4), "position in the prompt (chunk)": min(k, 8)}  # fmt: skip
            for f, v in feats.items():
                n.setdefault(f, Counter())[str(v)] += 1
                reused.setdefault(f, Counter())[str(v)] += nxt[i][b] != NEVER
        seen.update(chain)
    return {f: {v: (c, reused[f][v] / c) for v, c in sorted(n[f].items())} for f in n}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload", default="bundled", help="as bench.live_ab: bundled, a JSONL, multiturn:SEED"
    )
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--pace", type=float, default=0.25, help="seconds between requests (closed loop)")
    ap.add_argument("--probation", default="16,32,92", help="comma-separated probation lengths (chunks)")
    ap.add_argument(
        "--cold-fill",
        default="0.75",
        help="comma-separated cold_fill shares ('' = none)",
    )
    ap.add_argument(
        "--prefetch-budgets", default="", help="comma-separated L1 budgets (chunks) of hazard prefetch rows"
    )
    ap.add_argument(
        "--hold-s",
        type=float,
        default=20.0,
        help="seconds the policies do not act at the start: the keeper's calibration in shadow (2 x 10 s)",
    )
    ap.add_argument(
        "--readmit-by-gap", action="store_true", help="add probation rows with readmission by gap"
    )
    a = ap.parse_args(argv)
    sc = load_scenario("cpu-tiny")
    reqs = sim_requests(load_workload(a.workload, a.requests))
    run = partial(simulate, sc, reqs, pace_s=a.pace, hold_s=a.hold_s)
    rows = [run("default"), run("second-sight")]
    rows += [run("probation", probation=int(p)) for p in a.probation.split(",")]
    rows += [
        run("probation", probation=int(p), cold_fill=float(f))
        for p in a.probation.split(",")
        for f in a.cold_fill.split(",")
        if f
    ]
    if a.readmit_by_gap:
        rows += [run("probation", probation=int(p), readmit_by_gap=True) for p in a.probation.split(",")]
    budgets = [int(b) for b in a.prefetch_budgets.split(",") if b]
    rows += [run("hazard", prefetch_budget=b) for b in budgets]
    if budgets:
        rows.append(run("oracle-prefetch"))
    rows.append(run("oracle"))
    base = max(1, rows[0].l1_hit_tokens)
    print(f"{a.workload}, {len(reqs)} requests, L1 {sc.tiers[1].capacity_blocks} chunks, pace {a.pace} s")
    print(f"{'policy':24s} {'L1-hit tokens':>14s} {'vs default':>10s} {'L2-hit tokens':>14s} {'drops':>7s} "
          f"{'readmits':>8s}")  # fmt: skip
    for r in rows:
        gain = r.l1_hit_tokens / base - 1
        print(f"{r.policy:24s} {r.l1_hit_tokens:14,d} {gain:+10.1%} {r.l2_hit_tokens:14,d} {r.drops:7d} "
              f"{r.readmits:8d}")  # fmt: skip
    uses = Counter(Counter(int(x) for r in reqs for x in r.hash_ids).values())
    print("chunks by uses:", ", ".join(f"{k}x: {uses[k]}" for k in sorted(uses)[:6]))
    for f, vals in store_time_reuse(reqs).items():
        print(
            f"reuse of first-sight chunks by {f}: "
            + ", ".join(f"{v}: {r:.2f} (n={c})" for v, (c, r) in vals.items())
        )


if __name__ == "__main__":
    main()
