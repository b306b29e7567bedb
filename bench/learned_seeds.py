"""Robustness of ``learned`` across policy seeds and held-out trace variants: learned - best classic (pt).

    python -m bench.learned_seeds [--variants bench|heldout|all|NAME,...] [--capacities 0.05,0.1,0.2,0.4]
        [--seeds 0,1,2,3,4] [--kw '{"switch_z": 0.5}' | --kw '[{}, {"handoff_gate": 0}]'] [--cache FILE]
        [--out FILE]

The bench's variants (``bench.learned_vs_classic``) were used to choose the defaults; the ``heldout``
ones come from the same generators with generator seeds never used while tuning (21-27). Every cell is
(variant, capacity, policy seed); the classic policies do not depend on the policy seed and are cached in
``--cache`` (JSON, keyed by variant and capacity). Prints one row per variant and seed, then the worst
margin per seed and overall. ``--kw`` may be a list of configurations: each cell is run with each of
them in turn (same process, same classic results), and the summary is printed per configuration.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.learned_vs_classic import VARIANTS, _requests
from kvtier.policies.base import Request
from kvtier.policies.learned import LearnedPolicy
from kvtier.policies.registry import CLASSIC, get_policy
from kvtier.replay.engine import replay
from kvtier.replay.runner import load_workload
from kvtier.replay.synthetic import (
    long_document_trace,
    multiturn_trace,
    shared_document_trace,
    subsample_sessions,
    time_stretch,
)
from kvtier.replay.trace import distinct_blocks

HELDOUT = (
    "ho-subsample25-s21",
    "ho-subsample50-s22",
    "ho-multiturn-s23",
    "ho-shared-doc-s24",
    "ho-longdoc-s25",
    "ho-longdoc2-s26",
    "ho-sub25-stretch2-s27",
)


def heldout_requests(name: str) -> list[Request]:
    """A held-out variant: the bench's generators with seeds not used for tuning."""
    if name == "ho-multiturn-s23":
        return multiturn_trace(6000, seed=23)
    if name == "ho-shared-doc-s24":
        return shared_document_trace(4000, seed=24)
    if name == "ho-longdoc-s25":
        return long_document_trace(3993, seed=25)
    if name == "ho-longdoc2-s26":
        return long_document_trace(3993, seed=26, n_docs=2500, p_follow=0.3, zipf_a=0.9, doc_log_mean=2.8)
    base = load_workload("bundled").requests
    if name == "ho-subsample25-s21":
        return subsample_sessions(base, 0.25, seed=21)
    if name == "ho-subsample50-s22":
        return subsample_sessions(base, 0.5, seed=22)
    if name == "ho-sub25-stretch2-s27":
        return time_stretch(subsample_sessions(base, 0.25, seed=27), 2.0)
    raise KeyError(name)


def _variant(name: str) -> list[Request]:
    return heldout_requests(name) if name.startswith("ho-") else _requests(name)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="all")
    ap.add_argument("--capacities", default="0.01,0.02,0.05,0.1,0.2,0.4")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--kw", default="{}", help="LearnedPolicy keyword arguments (JSON object or list)")
    ap.add_argument("--cache", default="", help="JSON file caching the classic policies' results")
    ap.add_argument("--out", default="", help="write every cell's margin here (JSON)")
    a = ap.parse_args(argv)
    if a.variants in ("bench", "heldout", "all"):
        names = {"bench": list(VARIANTS), "heldout": list(HELDOUT), "all": [*VARIANTS, *HELDOUT]}[a.variants]
    else:
        names = a.variants.split(",")
    fracs = [float(x) for x in a.capacities.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    kws = json.loads(a.kw)
    if isinstance(kws, dict):
        kws = [kws]
    cache: dict[str, list[object]] = {}
    if a.cache and Path(a.cache).exists():
        cache = json.loads(Path(a.cache).read_text())
    cells: list[dict[str, object]] = []
    cfgs = "; ".join(f"[{i}] {k}" for i, k in enumerate(kws))
    print(f"learned - best classic (pt); configurations: {cfgs}")
    print(f"{'variant':<22}{'cfg':>4}{'seed':>5}" + "".join(f"{f * 100:>9g}%" for f in fracs))
    t_start = time.perf_counter()
    for v in names:
        reqs = _variant(v)
        distinct = distinct_blocks(reqs)
        best: list[tuple[str, float]] = []
        for f in fracs:
            cap = round(f * distinct)
            key = f"{v}@{cap}"
            if key not in cache:
                c = {n: 100 * replay(reqs, get_policy(n, cap, 0)).prefix_hit_ratio for n in CLASSIC}
                b = max(CLASSIC, key=lambda n: c[n])
                cache[key] = [b, c[b]]
                if a.cache:
                    Path(a.cache).write_text(json.dumps(cache))
            best.append((str(cache[key][0]), float(cache[key][1])))  # type: ignore[arg-type]
        for s in seeds:
            for ci, kw in enumerate(kws):
                row = []
                for f, (bn, bv) in zip(fracs, best, strict=True):
                    cap = round(f * distinct)
                    lv = 100 * replay(reqs, LearnedPolicy(cap, seed=s, **kw)).prefix_hit_ratio
                    d = lv - bv
                    row.append(d)
                    cells.append(
                        {"variant": v, "cfg": ci, "cap": f, "seed": s, "margin": d, "learned": lv, "best": bn}
                    )
                print(f"{v:<22}{ci:>4}{s:>5}" + "".join(f"{d:>+10.2f}" for d in row), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps({"kw": kws, "cells": cells}))
    print(f"\n({time.perf_counter() - t_start:.0f} s)")
    for ci, kw in enumerate(kws):
        print(f"\nconfiguration [{ci}] {kw}")
        mine = [c for c in cells if c["cfg"] == ci]
        for s in seeds:
            cs = [c for c in mine if c["seed"] == s]
            w = min(cs, key=lambda c: float(c["margin"]))  # type: ignore[arg-type]
            print(f"seed {s}: worst {w['margin']:+.2f} ({w['variant']} at {100 * float(w['cap']):g} %)")  # type: ignore[arg-type]
        for v in names:
            cs = [c for c in mine if c["variant"] == v]
            print(f"{v:<22} worst {min(float(c['margin']) for c in cs):+.2f}")  # type: ignore[arg-type]
        worst = min(float(c["margin"]) for c in mine)  # type: ignore[arg-type]
        n_bad = sum(float(c["margin"]) < -0.3 for c in mine)  # type: ignore[arg-type]
        print(f"worst over {len(mine)} cells {worst:+.2f} pt; cells below -0.3 pt: {n_bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
