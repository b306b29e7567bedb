"""``make_actuator`` wiring: the cache-layer adapters take their URL from the CLI flags (``--lmcache-url``,
``--lmcache-controller-url``) unless ``KVTIER_ACTUATOR_OPTIONS`` sets one; a missing URL or option is a
clear error naming what to set. No request is sent (the adapters against real servers are tested in
tests/cachelayers); building them needs no peer."""

from __future__ import annotations

import pytest

from kvtier.controller.root import make_actuator


def test_lmcache_controller_actuator_uses_the_controller_url_flag() -> None:
    a = make_actuator(
        "lmcache-controller",
        engine_url=None,
        engine_model="m",
        lmcache_controller_url="http://127.0.0.1:9001/",
        options={"instance_id": "w0"},
    )
    assert a.name == "lmcache-controller"
    assert a.caller.base_url == "http://127.0.0.1:9001"  # type: ignore[attr-defined]
    assert a.instance_id == "w0"  # type: ignore[attr-defined]


def test_an_options_url_wins_over_the_flags() -> None:
    a = make_actuator(
        "lmcache-controller",
        engine_url=None,
        engine_model="m",
        lmcache_controller_url="http://127.0.0.1:9001",
        options={"instance_id": "w0", "url": "http://127.0.0.1:9002"},
    )
    assert a.caller.base_url == "http://127.0.0.1:9002"  # type: ignore[attr-defined]
    b = make_actuator("lmcache-mp", engine_url=None, engine_model="m", lmcache_url="http://127.0.0.1:9003")
    assert b.name == "lmcache-mp"


@pytest.mark.parametrize(
    ("name", "kw", "message"),
    [
        ("lmcache-controller", {"options": {"instance_id": "w0"}}, "--lmcache-controller-url"),
        ("lmcache-controller", {"lmcache_controller_url": "http://h:1"}, "actuators settings"),
        ("lmcache-mp", {}, "--lmcache-url"),
        ("vllm-warmup", {}, "--engine-url"),
        ("nope", {}, "unknown actuator"),
    ],
)
def test_missing_urls_and_options_are_clear_errors(name: str, kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_actuator(name, engine_url=None, engine_model="m", **kw)  # type: ignore[arg-type]
