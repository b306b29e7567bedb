"""Interface contract: capabilities vs NotSupported, and LMCache-MP demote without any L2 view (an L2 adapter
that neither lists nor is a local fs, e.g. remote S3 -- not runnable here, so the HTTP side is an
httpx.MockTransport that records what would have been sent). The real-server behaviour is in *_live.py."""

from __future__ import annotations

import json

import httpx
import pytest

from kvtier.controller.actuators.base import Actuator, BlockRef, Capability, NotSupported, Outcome
from kvtier.controller.actuators.lmcache_controller import build as build_controller
from kvtier.controller.actuators.lmcache_mp import LMCacheMPActuator
from kvtier.controller.actuators.resilience import HttpCaller
from kvtier.policies.tiers import Tier


def mp_with(handler: httpx.MockTransport) -> LMCacheMPActuator:
    return LMCacheMPActuator(HttpCaller("http://mp", client=httpx.Client(transport=handler)), chunk_size=64)


def test_unadvertised_actions_raise_not_supported() -> None:
    act = mp_with(httpx.MockTransport(lambda r: httpx.Response(200, json={})))
    assert Capability.HARD_PIN not in act.capabilities() and not act.supports("copy")
    with pytest.raises(NotSupported):
        act.copy([BlockRef(layer_key="x")], None)  # type: ignore[arg-type]
    with pytest.raises(NotSupported):
        act.move([], None, None)  # type: ignore[arg-type]
    ctl = build_controller("http://ctl", "i0")
    assert {Capability.PIN, Capability.CLEAR} <= ctl.capabilities()
    assert Capability.UNPIN not in ctl.capabilities()
    with pytest.raises(NotSupported):
        ctl.unpin([BlockRef(token_ids=(1,))], Tier.CPU)
    with pytest.raises(TypeError):
        Actuator()  # type: ignore[abstract]


def test_demote_without_an_l2_view_never_deletes() -> None:
    sent: list[tuple[str, str]] = []
    status = {
        "is_healthy": True,
        "chunk_size": 64,
        "storage_manager": {"l2_adapters": [{"type": "S3L2Adapter", "is_healthy": True}]},
    }

    def handler(r: httpx.Request) -> httpx.Response:
        sent.append((r.method, r.url.path))
        return httpx.Response(200, json=status if r.url.path == "/status" else {"deleted": 1})

    act = mp_with(httpx.MockTransport(handler))
    res = act.demote([BlockRef(model="m", token_ids=tuple(range(128)))], Tier.DISK)
    assert res.count(Outcome.SKIPPED) == 2 and all("last copy" in o.detail for o in res.outcomes)
    assert ("DELETE", "/cache/objects") not in sent
    res = act.evict([BlockRef(model="m", token_ids=tuple(range(128)))], Tier.CPU)  # same safe path
    assert res.count(Outcome.SKIPPED) == 2 and ("DELETE", "/cache/objects") not in sent


def test_evict_all_sends_one_idempotent_delete_per_key() -> None:
    bodies: list[dict[str, object]] = []

    def handler(r: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(r.content))
        return httpx.Response(200, json={"deleted": 0, "skipped": 0, "ok": True})

    act = mp_with(httpx.MockTransport(handler))
    ref = BlockRef(model="m", token_ids=tuple(range(200)), cache_salt="t")
    res = act.evict([ref, ref], None)  # duplicate refs are de-duplicated
    assert len(bodies) == 3 and all(b["tier"] == "all" for b in bodies)
    assert res.count(Outcome.SKIPPED) == 3  # absent keys: nothing deleted, not an error
    assert {k["cache_salt"] for b in bodies for k in b["keys"]} == {"t"}  # type: ignore[attr-defined]


def test_registry_builds_by_name_and_rejects_unknown() -> None:
    from kvtier.controller.actuators import registry

    assert {"lmcache-mp", "lmcache-controller", "mooncake"} <= set(registry.names())
    act = registry.build("lmcache-mp", url="http://127.0.0.1:1", chunk_size=64)
    assert act.name == "lmcache-mp" and act.supports("promote")
    with pytest.raises(ValueError, match="unknown actuator"):
        registry.build("nope")


class _Cfg:
    def __init__(self) -> None:
        self.preferred_segments: list[str] = []
        self.replica_num = 1
        self.with_hard_pin = False
        self.soft_pin_action = None
        self.soft_pin_ttl_ms = 0


class _Bindings:
    ReplicateConfig = _Cfg

    class SoftPinAction:
        ENABLE, DISABLE = "ENABLE", "DISABLE"


class _LossyStore:
    """A Mooncake client whose upsert fails after dropping the key (cannot be provoked on the real master)."""

    def __init__(self) -> None:
        self.data = {"k": b"bytes"}
        self.puts: list[tuple[str, bytes]] = []

    def get(self, key: str) -> bytes:
        return self.data.get(key, b"")

    def upsert(self, key: str, value: bytes, config: object = None) -> int:
        self.data.pop(key, None)
        return -1

    def put(self, key: str, value: bytes, config: object = None) -> int:
        self.puts.append((key, value))
        self.data[key] = value
        return 0


def test_mooncake_failed_pin_rewrite_restores_the_key() -> None:
    from kvtier.controller.actuators.mooncake import MooncakeActuator

    store = _LossyStore()

    def admin(r: httpx.Request) -> httpx.Response:
        present = "k" in store.data
        return httpx.Response(
            200, json={"success": present, "data": [{"transport_endpoint_": "seg-a"}] if present else []}
        )

    caller = HttpCaller("http://m", client=httpx.Client(transport=httpx.MockTransport(admin)))
    act = MooncakeActuator(store, caller, bindings=_Bindings)  # type: ignore[arg-type]
    res = act.pin([BlockRef(layer_key="k")], Tier.CPU)
    assert res.count(Outcome.FAILED) == 1 and "restored" in res.outcomes[0].detail
    assert store.data == {"k": b"bytes"} and store.puts == [("k", b"bytes")]
