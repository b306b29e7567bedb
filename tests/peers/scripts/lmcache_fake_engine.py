"""A CPU "fake engine" for a real LMCache MP server: LMCache's own ``LMCacheMPWorkerAdapter`` (the class
vLLM's LMCacheMPConnector uses), seeded random bf16 KV, STORE of ``--tokens`` tokens, then it stays
registered (heartbeating) until killed, writing ``{"token_ids": [...], "store_ok": bool}`` to ``--out``.
Runs under KVTIER_LMCACHE_PYTHON. Adapted from reference/cachelayers/mp_client.py.
"""

import argparse
import json
import os
import threading
import time

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402
import zmq  # noqa: E402
from lmcache.integration.vllm.vllm_multi_process_adapter import (  # noqa: E402
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)

LAYERS, NB, BS, NH, HS = 2, 64, 32, 2, 64

ap = argparse.ArgumentParser()
ap.add_argument("--url", required=True)
ap.add_argument("--model", default="tiny")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--sequences", type=int, default=1, help="seeded sequences to store: seed, seed+1, ...")
ap.add_argument("--pace-s", type=float, default=0.0, help="seconds between sequences (request arrival rate)")
ap.add_argument("--out", required=True)
a = ap.parse_args()
ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1)
w = LMCacheMPWorkerAdapter(
    a.url,
    zmq.Context(),
    a.model,
    BS,
    ps,
    extra_config={"lmcache.mp.mp_transfer_mode": "engine_driven", "lmcache.mp.mq_timeout": 30},
)
kv = {
    f"model.layers.{i}.self_attn.attn": torch.zeros(2, NB, BS, NH, HS, dtype=torch.bfloat16)
    for i in range(LAYERS)
}
w.register_kv_caches(kv, layout_hints={"kv_layout": "NHD"})
all_toks = []
ok = True
for i in range(a.sequences):
    g = torch.Generator().manual_seed(a.seed + i)
    toks = torch.randint(1, 500, (a.tokens,), generator=g).tolist()
    blocks = list(range(1, 1 + a.tokens // BS))
    for t in kv.values():
        for b in blocks:
            t[:, b] = torch.randn(2, BS, NH, HS, generator=g).to(torch.bfloat16)
    rid = f"store-{i}"
    w.submit_store_request(rid, LoadStoreOp(token_ids=toks, block_ids=[blocks], start=0, end=a.tokens), None)
    ok = bool(w.store_futures[rid].result(timeout=60)) and ok
    all_toks.append(toks)
    if a.pace_s and i + 1 < a.sequences:
        time.sleep(a.pace_s)  # traffic arrives over time, so LMCache's periodic L1 eviction can keep up
tmp = a.out + ".tmp"
with open(tmp, "w") as f:
    json.dump({"token_ids": all_toks[0], "all_token_ids": all_toks, "store_ok": ok}, f)
os.replace(tmp, a.out)
threading.Event().wait()  # hold the registration until SIGTERM
