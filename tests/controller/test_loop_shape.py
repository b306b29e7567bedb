"""The reconcile loop's shape: ``controller/loop.py`` only sequences the stages of ``controller/reconcile``.

Static checks (AST) that fail when stage work drifts back into the loop: no numpy in ``loop.py``, no
long method on :class:`ReconcileLoop`, and no stage or loop code reading another object's private
attributes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CONTROLLER = Path(__file__).resolve().parents[2] / "controller"
LOOP = CONTROLLER / "loop.py"
STAGES = sorted((CONTROLLER / "reconcile").glob("*.py"))
MAX_METHOD_LINES = 40  # body lines (signature excluded) of any ReconcileLoop method


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_loop_module_imports_no_numpy() -> None:
    names = []
    for node in ast.walk(_tree(LOOP)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    assert names and not [n for n in names if n == "numpy" or n.startswith("numpy.")], names


def test_reconcile_loop_methods_are_short() -> None:
    (cls,) = [n for n in _tree(LOOP).body if isinstance(n, ast.ClassDef) and n.name == "ReconcileLoop"]
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) > 10
    long = {f.name: f.end_lineno - f.body[0].lineno + 1 for f in methods if f.end_lineno}
    assert {k: v for k, v in long.items() if v > MAX_METHOD_LINES} == {}


@pytest.mark.parametrize("path", [LOOP, *STAGES], ids=lambda p: p.name)
def test_no_private_attribute_of_another_object_is_read(path: Path) -> None:
    """``x._name`` only for ``x`` = ``self`` (or ``cls``); dunders are fine."""
    bad = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                bad.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert bad == []


def test_every_stage_module_is_imported_by_the_loop() -> None:
    """Each stage module is part of the tick (no orphan left behind by a refactor)."""
    imported = {
        n.module
        for n in ast.walk(_tree(LOOP))
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("kvtier.controller.reconcile")
    }
    want = {f"kvtier.controller.reconcile.{p.stem}" for p in STAGES if p.stem != "__init__"}
    assert imported == want
