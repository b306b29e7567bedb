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
    monkeypatch.setitem(registry._LAZY, "lazy-one", "kvtier_fake_policy_mod")
    assert isinstance(registry.get_policy("lazy-one", 3), Lazy)
    monkeypatch.setitem(registry._LAZY, "broken", "kvtier_no_such_module_xyz")
    assert not registry.is_available("broken")
    with pytest.raises(KeyError, match="cannot import"):
        registry.get_policy("broken", 3)
