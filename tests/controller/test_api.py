"""REST policy API in-process (ASGI, real FastAPI app, real SQLite state dir): validation, auth, restarts"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from kvtier.controller.plane import ControlPlane
from kvtier.policies.index import BlockIndex
from kvtier.policies.prefix_hash import block_hashes
from kvtier.policies.tiers import Tier
from tests.controller import built

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Clock:
    def __init__(self) -> None:
        self.t = 10_000.0

    def __call__(self) -> float:
        return self.t


def plane(
    tmp: Path,
    token: str | None = TOKEN,
    index: BlockIndex | None = None,
    clock: Clock | None = None,
    placement_policy: str | None = "learned",
    allow_active: bool = True,
) -> tuple[ControlPlane, TestClient]:
    """The production composition (settings -> build_sidecar -> create_app) over ``index``."""
    sc = built.sidecar(tmp, index=index or BlockIndex(), clock=clock or Clock(), api_token=token,
                       policy=placement_policy or "none", allow_active=allow_active)  # fmt: skip
    return sc.plane, built.client(sc)


def test_policy_get_put_patch_and_422_messages(tmp_path: Path) -> None:
    p, c = plane(tmp_path)
    doc = c.get("/v1/policy").json()
    assert doc["mode"] == "shadow" and {t["tier"] for t in doc["tiers"]} == {"gpu", "cpu"}
    r = c.patch("/v1/policy", json={"mode": "active", "predictor": {"tau_s": 60}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["mode"] == "active" and r.json()["predictor"]["tau_s"] == 60
    assert r.json()["predictor"]["kind"] == "learned"  # nested objects merge
    p.loop.tick()
    assert p.loop.policy.mode == "active"  # swapped at the tick boundary
    bad = c.patch("/v1/policy", json={"mode": "turbo"}, headers=AUTH)
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["mode"] and "off" in bad.json()["detail"][0]["msg"]
    bad = c.patch(
        "/v1/policy",
        json={"tiers": [{"tier": "gpu", "capacity_blocks": 10, "high_watermark": 0.5, "low_watermark": 0.9}]},
        headers=AUTH,
    )
    assert bad.status_code == 422 and "low_watermark" in str(bad.json()["detail"])
    bad = c.put("/v1/policy", json={**doc, "budgets": [{"link": "gpu=>cpu"}]}, headers=AUTH)
    assert bad.status_code == 422 and "link" in str(bad.json()["detail"])
    bad = c.put("/v1/policy", json={**doc, "surprise": 1}, headers=AUTH)
    assert bad.status_code == 422 and "surprise" in str(bad.json()["detail"])
    bad = c.put("/v1/policy", json={**doc, "tiers": [doc["tiers"][0], doc["tiers"][0]]}, headers=AUTH)
    assert bad.status_code == 422 and "unique" in str(bad.json()["detail"])


def test_mutations_need_bearer_token(tmp_path: Path) -> None:
    _, c = plane(tmp_path)
    assert c.patch("/v1/policy", json={"mode": "off"}).status_code == 401
    assert (
        c.patch("/v1/policy", json={"mode": "off"}, headers={"Authorization": "Basic x"}).status_code == 401
    )
    assert (
        c.patch("/v1/policy", json={"mode": "off"}, headers={"Authorization": "Bearer nope"}).status_code
        == 403
    )
    assert c.post("/v1/pins", json={"block_hash": "00000000000000ff"}).status_code == 401
    assert c.delete("/v1/pins/abc").status_code == 401
    assert c.post("/v1/model/retrain").status_code == 401
    assert c.get("/v1/policy").status_code == 200  # reads are open
    _, open_c = plane(tmp_path / "open", token=None)
    assert open_c.patch("/v1/policy", json={"mode": "off"}).status_code == 200


def test_pins_by_tokens_and_hash_and_bad_payloads(tmp_path: Path) -> None:
    p, c = plane(tmp_path)
    toks = list(range(1, 71))  # 2 full blocks of 32 + a partial tail
    r = c.post("/v1/pins", json={"token_ids": toks, "tier": "gpu", "ttl_s": 60}, headers=AUTH)
    assert r.status_code == 201, r.text
    pin = r.json()
    expected = [f"{h:016x}" for h in block_hashes(toks, 32)]
    assert pin["block_hashes"] == expected and pin["num_tokens"] == 64 and pin["tier"] == "gpu"
    r = c.post("/v1/pins", json={"block_hash": "0x00000000000000ff", "tier": "cpu"}, headers=AUTH)
    assert r.status_code == 201 and r.json()["block_hashes"] == ["00000000000000ff"]
    assert len(c.get("/v1/pins").json()["pins"]) == 2
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tier": "gpu"}, "exactly one"),
        ({"token_ids": [1, 2], "block_hash": "ff", "tier": "gpu"}, "exactly one"),
        ({"token_ids": [1, 2, 3]}, "less than one block"),
        ({"token_ids": [-1] * 40}, "greater than or equal"),
        ({"block_hash": "xyz"}, "neither 16 hex"),
        ({"block_hash": "0x1" + "0" * 20}, "64 bits"),
        ({"token_ids": toks, "tier": "l9"}, "tier"),
        ({"token_ids": toks, "ttl_s": 0}, "greater than 0"),
        ({"prompt": "hello " * 40}, "need an engine"),
    ]
    for body, msg in cases:
        r = c.post("/v1/pins", json=body, headers=AUTH)
        assert r.status_code == 422, (body, r.text)
        assert msg in str(r.json()["detail"]), (body, r.json())
    assert c.delete(f"/v1/pins/{pin['id']}", headers=AUTH).status_code == 204
    assert c.delete(f"/v1/pins/{pin['id']}", headers=AUTH).status_code == 404
    assert len(c.get("/v1/pins").json()["pins"]) == 1


def test_decisions_blocks_and_status(tmp_path: Path) -> None:
    idx = BlockIndex()
    clock = Clock()
    for i, h in enumerate(range(101, 151)):  # 50 gpu blocks > 0.95 * 48 capacity -> shedding decisions
        idx.store(h, None, Tier.GPU, t=(clock.t - 50 + i) * 1000)
    p, c = plane(tmp_path, index=idx, clock=clock)
    p.loop.tick()
    r = c.get("/v1/decisions", params={"limit": 3, "action": "demote", "tier": "cpu"})
    assert r.status_code == 200
    ds = r.json()["decisions"]
    assert len(ds) == 3 and all(d["action"] == "demote" and d["tier"] == "cpu" for d in ds)
    assert all(d["outcome"] == "shadow" and d["score"] is None for d in ds)
    assert ds[0]["id"] > ds[1]["id"] > ds[2]["id"]  # newest first
    assert c.get("/v1/decisions", params={"limit": 0}).status_code == 422
    assert c.get("/v1/decisions", params={"action": "teleport"}).status_code == 422
    b = c.get(f"/v1/blocks/{ds[0]['block_hash']}").json()
    assert b["tiers"] == ["gpu"] and 0 <= b["predicted_reuse"] <= 1 and b["features"]["frequency"] == 1
    assert b["decisions"][0]["id"] == ds[0]["id"]
    assert c.get("/v1/blocks/00000000deadbeef").status_code == 404
    assert c.get("/v1/blocks/zzz").status_code == 422
    st = c.get("/v1/status").json()
    assert st["mode"] == "shadow" and st["controller"]["last_tick"]["decisions"] >= 3
    m = c.get("/metrics/").text
    assert (
        'kvtier_decisions_total{action="demote",tier="cpu"}' in m and "kvtier_loop_tick_seconds_bucket" in m
    )


def test_policy_pins_and_model_persist_across_restart(tmp_path: Path) -> None:
    idx = BlockIndex()
    clock = Clock()
    for h in range(1, 301):
        idx.store(h, None, Tier.GPU, t=(clock.t - 400 + h) * 1000)
    # index-only planning: the index-trained model is the live predictor (no placement policy object)
    p, c = plane(tmp_path, index=idx, clock=clock, placement_policy=None)
    assert c.patch("/v1/policy", json={"mode": "active", "hysteresis_s": 12}, headers=AUTH).status_code == 200
    assert (
        c.post("/v1/pins", json={"token_ids": list(range(64)), "tier": "cpu"}, headers=AUTH).status_code
        == 201
    )
    # the model manager snapshotted features at start; half the blocks come back afterwards -> trainable
    clock.t += 600
    for h in range(1, 301, 2):
        idx.touch(h, clock.t * 1000)
    r = c.post("/v1/model/retrain", headers=AUTH)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["trained"] and info["version"] == 1 and info["training_samples"] == 240
    assert info["auc"] is not None and info["calibration"]
    p.store.close()
    # restart: a fresh plane on the same state dir
    p2, c2 = plane(tmp_path, index=idx, clock=clock, placement_policy=None)
    assert c2.get("/v1/policy").json()["hysteresis_s"] == 12 and p2.loop.policy.mode == "active"
    pins = c2.get("/v1/pins").json()["pins"]
    assert len(pins) == 1 and pins[0]["tier"] == "cpu" and pins[0]["num_tokens"] == 64
    m = c2.get("/v1/model").json()
    assert m["version"] == 1 and m["predictor"] == "learned" and m["auc"] == info["auc"]
    assert p2.loop.predictor.name == "learned"


def test_retrain_without_labels_is_409(tmp_path: Path) -> None:
    _, c = plane(tmp_path)
    r = c.post("/v1/model/retrain", headers=AUTH)
    assert r.status_code == 409 and "labelled" in r.json()["detail"]
