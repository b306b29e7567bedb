"""kvtier's client-side LMCache MP keys equal LMCache's own (TokenHasher + ipc_key_to_object_keys), computed
by the real LMCache 0.5.6 in KVTIER_LMCACHE_PYTHON. (The live test also matches them to real L2 files.)"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvtier.controller.actuators.lmcache_keys import kv_rank, object_keys
from tests.peers.procs import PEER_ENV, require_env

pytestmark = pytest.mark.lmcache

SCRIPT = r"""
import json, sys
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.distributed.api import ipc_key_to_object_keys
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename as fname
out = []
for model, toks, chunk, salt, ws, wid in json.loads(sys.stdin.read()):
    h = TokenHasher(chunk_size=chunk, hash_algorithm="blake3").compute_chunk_hashes(toks)
    ik = IPCCacheServerKey.from_token_ids(model, ws, wid, toks, 0, len(toks), cache_salt=salt)
    ks = ipc_key_to_object_keys(ik, h, [0])[0]
    out.append([[k.chunk_hash.hex(), k.kv_rank, k.cache_salt, fname(k)] for k in ks])
print(json.dumps(out))
"""


def test_keys_match_lmcache() -> None:
    py = require_env("KVTIER_LMCACHE_PYTHON")
    cases = [
        ("tiny", list(range(1, 257)), 64, "", 1, 0),
        ("/work/peers/tiny-llama", [7] * 200, 64, "tenantA", 1, 0),
        ("m/x", list(range(1000, 1600)), 256, "", 2, 1),
        ("tiny", list(range(10)), 64, "", 1, 0),
    ]
    import os

    env = dict(os.environ, **PEER_ENV)
    r = subprocess.run(
        [py, "-c", SCRIPT], input=json.dumps(cases), capture_output=True, text=True, timeout=300, env=env
    )
    if r.returncode != 0 and "_object_key_to_filename" in r.stderr:
        pytest.fail("LMCache fs adapter helper moved: " + r.stderr[-500:])
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    for (model, toks, chunk, salt, ws, wid), ref in zip(cases, theirs, strict=True):
        ours = object_keys(model, toks, chunk, cache_salt=salt, world_size=ws, ranks=[wid])
        assert [[k.chunk_hash_hex, k.kv_rank, k.cache_salt, k.fs_filename()] for k in ours] == ref
    assert kv_rank(1, 0) == 0x01000100
