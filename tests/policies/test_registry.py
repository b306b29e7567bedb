"""Registry: lazy resolution by module path, runtime registration, clear errors."""

from __future__ import annotations

import sys
import types

import pytest

from kvtier.policies import registry
from kvtier.policies.lru import LRUPolicy


def test_builtins_resolve() -> None:
    for name in ("lru", "fifo", "lfu", "lfuda", "s3fifo", "arc", "leaf-lru", "belady"):
        p = registry.get_policy(name, 5, seed=1)
        assert p.name == name and p.capacity_blocks == 5 and p.seed == 1


def test_register_and_lazy_module(monkeypatch: pytest.MonkeyPatch) -> None:
    class Mine(LRUPolicy):
        name = "mine"

    registry.register("mine", Mine)
    assert isinstance(registry.get_policy("mine", 3), Mine)
    # a lazily imported module that only defines a Policy subclass with the right name
    mod = types.ModuleType("kvtier_fake_policy_mod")

    class Lazy(LRUPolicy):
        name = "lazy-one"

    mod.Lazy = Lazy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier_fake_policy_mod", mod)
    registry.register_module("lazy-one", "kvtier_fake_policy_mod")
    registry.register_module("broken", "kvtier_no_such_module_xyz")
    try:
        assert "lazy-one" in registry.known_policies()
        assert isinstance(registry.get_policy("lazy-one", 3), Lazy)
        assert not registry.is_available("broken")
        with pytest.raises(KeyError, match="cannot import"):
            registry.get_policy("broken", 3)
    finally:
        registry.unregister("lazy-one")
        registry.unregister("broken")
    assert "lazy-one" not in registry.known_policies() and "broken" not in registry.known_policies()
    with pytest.raises(KeyError, match="unknown policy"):
        registry.get_policy("lazy-one", 3)
