"""Name -> factory registry of placement policies, shared by the CLI, the replay harness and the controller.

Built-in baselines are imported lazily by module path. ``learned`` lives in ``kvtier.policies.learned``
(module or package): importing it may call :func:`register`; else its ``create_policy(capacity_blocks,
*, seed)`` or the :class:`Policy` subclass whose ``name`` is ``"learned"`` is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvtier.policies.base import Policy

PolicyFactory = Callable[..., Policy]  # (capacity_blocks, *, seed) -> Policy

# name -> "module:attr" (imported on first use) or a factory registered at runtime
_LAZY: dict[str, str] = {
    "lru": "kvtier.policies.lru:LRUPolicy",
    "fifo": "kvtier.policies.lru:FIFOPolicy",
    "lfu": "kvtier.policies.lfu:LFUPolicy",
    "lfuda": "kvtier.policies.lfu:LFUDAPolicy",
    "s3fifo": "kvtier.policies.s3fifo:S3FIFOPolicy",
    "arc": "kvtier.policies.arc:ARCPolicy",
    "leaf-lru": "kvtier.policies.leaf_lru:LeafLRUPolicy",
    "belady": "kvtier.policies.belady:BeladyPolicy",
    "learned": "kvtier.policies.learned",
}
_FACTORIES: dict[str, PolicyFactory] = {}

CLASSIC = ("lru", "fifo", "lfu", "lfuda", "s3fifo", "arc", "leaf-lru")


def register(name: str, factory: PolicyFactory) -> None:
    """Make ``get_policy(name, ...)`` call ``factory(capacity_blocks, seed=seed)``."""
    _FACTORIES[name] = factory


def register_module(name: str, target: str) -> None:
    """Make ``get_policy(name, ...)`` import ``target`` on first use: ``"module:attr"`` (a factory or
    :class:`Policy` subclass) or ``"module"`` (resolved as ``learned`` is: module doc). Nothing is imported
    here; an unimportable module shows on use (:func:`is_available` is False, :func:`get_policy` raises)."""
    _FACTORIES.pop(name, None)
    _LAZY[name] = target


def unregister(name: str) -> None:
    """Forget ``name`` (a runtime registration, a lazy module, or what either resolved to); a no-op for a
    name not known."""
    _FACTORIES.pop(name, None)
    _LAZY.pop(name, None)


def known_policies() -> list[str]:
    """All names that :func:`get_policy` may resolve (some may fail to import, e.g. ``learned`` if absent)."""
    return sorted(set(_LAZY) | set(_FACTORIES))


def _resolve(name: str) -> PolicyFactory:
    if name in _FACTORIES:
        return _FACTORIES[name]
    target = _LAZY.get(name)
    if target is None:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(known_policies())}")
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise KeyError(f"policy {name!r} is not available: cannot import {mod_name} ({e})") from e
    if name in _FACTORIES:  # the module registered itself on import
        return _FACTORIES[name]
    factory = getattr(mod, attr or "create_policy", None)
    if factory is None and not attr:  # a Policy subclass in the module whose ``name`` is ``name``
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Policy) and getattr(obj, "name", None) == name:
                factory = obj
                break
    if factory is None:
        raise KeyError(f"policy {name!r}: {mod_name} has no registration, create_policy or Policy so named")
    _FACTORIES[name] = factory
    return factory


def is_available(name: str) -> bool:
    """Can ``name`` be built here (its module imports)?"""
    try:
        _resolve(name)
    except KeyError:
        return False
    return True


def get_policy(name: str, capacity_blocks: int, seed: int = 0, **options: Any) -> Policy:
    """Build policy ``name`` holding at most ``capacity_blocks`` blocks; ``options`` are its constructor's
    other keyword arguments (e.g. the ``learned`` settings section)."""
    return _resolve(name)(capacity_blocks, seed=seed, **options)
