"""One tier model: :class:`~kvtier.policies.tiers.TierSpec` is the only class that describes a tier's
capacity and bandwidth; the planner, the policy document, the replay tier stack and the simulator share it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.controller.policy_doc import PolicyDoc
from kvtier.policies.planner import PlannerConfig
from kvtier.policies.tiers import Tier, TierSpec
from kvtier.replay.sim.scenario import load_scenario
from kvtier.replay.tiers import bundled_config, load_tier_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collectors", "controller", "policies", "replay")
# per-tier facts: a class declaring two of these fields is modelling a tier
TIER_FIELDS = {
    "capacity_blocks", "capacity_gib", "capacity_fraction", "high_watermark", "low_watermark",
    "load_bandwidth_bytes_s", "read_bytes_s", "write_bytes_s", "read_gbps", "write_gbps", "latency_us",
}  # fmt: skip


def _classes() -> list[tuple[str, str, set[str]]]:
    """(file, class name, names of the class body's annotated fields) for every class of the packages."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    names = {
                        s.target.id
                        for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    }
                    out.append((str(path.relative_to(ROOT)), node.name, names))
    return out


def test_scan_sees_the_packages() -> None:
    found = {(f, c) for f, c, _ in _classes()}
    assert ("policies/tiers.py", "TierSpec") in found and ("controller/policy_doc.py", "PolicyDoc") in found


def test_only_the_tier_model_declares_per_tier_fields() -> None:
    modelling = [(f, c) for f, c, n in _classes() if len(n & TIER_FIELDS) >= 2]
    assert modelling == [("policies/tiers.py", "TierSpec")]


def test_tier_classes_are_the_enum_the_model_and_the_replayed_stack() -> None:
    """``grep -rn "class Tier" collectors controller policies replay`` shows the names, the one tier model and
    the replay's exclusive stack (a container of :class:`TierSpec` with no per-tier fields of its own)."""
    assert sorted((f, c) for f, c, _ in _classes() if c.startswith("Tier")) == [
        ("policies/tiers.py", "Tier"), ("policies/tiers.py", "TierSpec"), ("replay/tiers.py", "TierStack")
    ]  # fmt: skip


def test_every_layer_holds_the_same_class() -> None:
    doc = PolicyDoc()
    assert all(type(t) is TierSpec for t in doc.tiers)
    assert all(type(t) is TierSpec for t in doc.planner_config().tiers)
    assert all(type(t) is TierSpec for t in load_tier_config(bundled_config("llama3-8b")).tiers)
    assert all(type(t) is TierSpec for t in load_scenario("demo-8b").tiers)
    hw = load_scenario("demo-8b").tiers[1]
    cfg = PlannerConfig(tiers=(hw,))
    assert cfg.tiers[0] is hw  # the simulator's tier feeds the planner as is


def test_policy_document_keeps_its_json_and_one_line_errors() -> None:
    doc = PolicyDoc.model_validate({"tiers": [{"tier": "disk", "capacity_blocks": 7}]})
    (t,) = doc.tiers
    assert t == TierSpec(Tier.DISK, 7)
    assert doc.model_dump(mode="json")["tiers"] == [
        {"tier": "disk", "capacity_blocks": 7, "high_watermark": 0.95, "low_watermark": 0.85,
         "load_bandwidth_bytes_s": 1e10}
    ]  # fmt: skip
    # a tier carrying hardware-only fields dumps without them
    hw = TierSpec(Tier.CPU, 5, latency_s=1e-3, write_bandwidth_bytes_s=1e9, policy="lru")
    assert set(PolicyDoc(tiers=[hw]).model_dump(mode="json")["tiers"][0]) == {
        "tier", "capacity_blocks", "high_watermark", "low_watermark", "load_bandwidth_bytes_s"
    }  # fmt: skip
    schema = PolicyDoc.model_json_schema()["$defs"]
    tier_schema = schema["TierConfig"]  # the OpenAPI component keeps its name
    assert tier_schema["title"] == "TierConfig" and "TierSpec" not in schema
    assert sorted(tier_schema["properties"]) == [
        "capacity_blocks", "high_watermark", "load_bandwidth_bytes_s", "low_watermark", "tier"
    ]  # fmt: skip
    assert tier_schema["additionalProperties"] is False and tier_schema["required"] == [
        "tier",
        "capacity_blocks",
    ]
    assert (
        tier_schema["properties"]["capacity_blocks"]["description"]
        == "blocks the planner may place in this tier"
    )
    for bad, words in [
        (
            {"tier": "gpu", "capacity_blocks": 10, "high_watermark": 0.5, "low_watermark": 0.9},
            "low_watermark",
        ),
        ({"tier": "gpu", "capacity_blocks": -1}, "greater than or equal to 0"),
        ({"tier": "gpu", "capacity_blocks": 1, "latency_s": 0.1}, "unknown key 'latency_s'"),
        ({"tier": "gpu", "capacity_blok": 1}, "unknown key 'capacity_blok'"),
        ({"tier": "tape", "capacity_blocks": 1}, "tier"),
    ]:
        with pytest.raises(ValidationError) as e:
            PolicyDoc.model_validate({"tiers": [bad]})
        msgs = [err["msg"] for err in e.value.errors()]
        assert any(words in m for m in msgs) or any(words in str(err["loc"]) for err in e.value.errors())
        assert all("\n" not in m for m in msgs)
