"""Dashboard lint (no peers): the checked-in JSON is exactly the generator's output, valid, with unique panel
ids and resolvable datasources; every kvtier metric the dashboards and alert rules use is in the contract
(``dashboards/METRICS.md``); every vLLM metric they use is one the real vLLM CPU 0.32 build emits."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from kvtier.dashboards import generate, lint

REPO = Path(__file__).resolve().parents[2]
VLLM_SAMPLE = Path(__file__).parent / "data" / "vllm_cpu_0.32_metrics.txt"  # GET /metrics of a real server
RULES = sorted((REPO / "deploy" / "prometheus" / "rules").glob("*.yml"))


def test_checked_in_json_equals_generator_output() -> None:
    rendered = generate.render()
    on_disk = {p.name: p.read_text() for p in sorted((REPO / "dashboards").glob("*.json"))}
    assert sorted(on_disk) == sorted(rendered), "dashboards/*.json and the generator disagree on the file set"
    stale = [name for name, text in rendered.items() if on_disk[name] != text]
    assert not stale, f"stale {stale}: run `python -m kvtier.dashboards.generate`"
    assert generate.main(["--check"]) == 0


def test_dashboards_lint_clean() -> None:
    boards = lint.load()
    assert len(boards) == 3
    assert lint.provisioned_datasource_uids() == {"prometheus"}
    assert lint.lint(boards) == []
    for name, d in boards.items():
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[0] == "datasource" and len(names) == len(set(names)), name
        assert d["schemaVersion"] >= 39


def test_lint_catches_broken_dashboards(tmp_path: Path) -> None:
    good = lint.load()
    name = "kvtier-overview.json"
    bad = copy.deepcopy(good)
    panels = [p for p in bad[name]["panels"] if p["type"] != "row"]
    panels[3]["id"] = panels[2]["id"]
    panels[4]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "nope"}
    panels[5]["targets"][0]["expr"] = 'rate(vllm:prompt_tokens_total{model_name=~"$nosuchvar"}[5m])'
    panels[6]["datasource"] = {"type": "prometheus", "uid": "${model}"}  # a query variable, not a datasource
    problems = lint.lint(bad)
    text = "\n".join(problems)
    assert "panel id" in text and "'nope' is not provisioned" in text, text
    assert "undefined variable $nosuchvar" in text and "$model is not a datasource variable" in text, text
    with pytest.raises(ValueError, match="invalid JSON"):
        tmp = tmp_path / "broken.json"
        tmp.write_text("{not json")
        lint.load([tmp])


def test_template_variables() -> None:
    """datasource, engine, model, tier where they apply: the overview filters vLLM's metrics by model and
    engine, the tiers board adds tier, the controller board filters by the engine kvtier watches + tier."""
    want = {
        "kvtier-overview.json": {"datasource": "datasource", "model": "query", "engine": "query"},
        "kvtier-tiers.json": {
            "datasource": "datasource",
            "model": "query",
            "engine": "query",
            "tier": "query",
        },
        "kvtier-controller.json": {"datasource": "datasource", "kv_engine": "query", "tier": "query"},
    }
    boards = lint.load()
    for name, variables in want.items():
        got = {v["name"]: v["type"] for v in boards[name]["templating"]["list"]}
        assert got == variables, name
        assert variables.keys() == lint.REQUIRED_VARIABLES[name], name
    # the lint says when one is missing or unused
    bad = copy.deepcopy(boards)
    tv = bad["kvtier-tiers.json"]["templating"]["list"]
    tv[:] = [v for v in tv if v["name"] != "tier"]
    bad["kvtier-overview.json"]["templating"]["list"].append({"name": "tier", "type": "query", "query": "x"})
    text = "\n".join(lint.lint(bad))
    assert "kvtier-tiers.json: no template variable $tier" in text, text
    assert "kvtier-overview.json: template variable $tier is used by no panel query" in text, text


def test_panel_ids_unique_and_every_panel_has_a_query() -> None:
    for name, d in lint.load().items():
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
        for p in d["panels"]:
            if p["type"] != "row":
                assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), (name, p["title"])
                assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def _contract() -> set[str]:
    text = (REPO / "dashboards" / "METRICS.md").read_text()
    return set(re.findall(r"`(kvtier_[a-z0-9_]+)", text))


def _rule_exprs() -> list[str]:
    out = []
    for f in RULES:
        out += re.findall(
            r"^\s+expr:\s*(?:\|\n)?(.*?)(?=^\s+(?:for|labels|record|- alert|- record):|\Z)",
            f.read_text(),
            re.M | re.S,
        )
    return out


def test_every_kvtier_metric_is_in_the_contract() -> None:
    contract = _contract()
    used = {m for q in lint.queries(lint.load()) for m in q.metrics}
    used |= {m for e in _rule_exprs() for m in lint.metric_names(e)}
    base = {re.sub(r"_(bucket|count|sum)$", "", m) for m in used if m.startswith("kvtier_")}
    missing = sorted(m for m in base if m not in contract)
    assert not missing, f"kvtier metrics used but not in dashboards/METRICS.md: {missing}"
    # and the issue-given names are all there
    for m in (
        "kvtier_kv_events_total",
        "kvtier_kv_events_lost_total",
        "kvtier_blocks_tracked",
        "kvtier_collector_errors_total",
        "kvtier_loop_tick_seconds",
        "kvtier_decisions_total",
        "kvtier_actuations_total",
        "kvtier_predictor_auc",
        "kvtier_shadow_hits_total",
    ):
        assert m in contract and m in base, m


def test_every_vllm_metric_exists_in_real_vllm_output() -> None:
    emitted = set(re.findall(r"^(vllm:[A-Za-z0-9_:]+)", VLLM_SAMPLE.read_text(), re.M))
    assert "vllm:time_to_first_token_seconds_bucket" in emitted
    used = {m for q in lint.queries(lint.load()) for m in q.metrics if m.startswith("vllm:")}
    used |= {m for e in _rule_exprs() for m in lint.metric_names(e) if m.startswith("vllm:")}
    assert used, "no vllm metric used?"
    missing = sorted(used - emitted)
    assert not missing, f"not emitted by vLLM CPU 0.32: {missing}"


def test_query_helpers() -> None:
    q = lint.Query(
        "d",
        1,
        "p",
        "A",
        'sum(rate(vllm:x_total{model_name=~"$model"}[$__rate_interval])) '
        '/ on() kvtier_y + up{job="kvtier"} + lmcache_mp_z',
    )
    assert q.metrics == {"vllm:x_total", "kvtier_y", "lmcache_mp_z"}
    assert q.sources == {"vllm", "kvtier", "lmcache"}
    assert q.resolved({"__rate_interval": "1m"}).startswith('sum(rate(vllm:x_total{model_name=~".*"}[1m]))')
    assert lint.label_values('label_values(vllm:a{b=~"$c"}, engine)') == ('vllm:a{b=~"$c"}', "engine")
    assert lint.label_values("label_values(tier)") == (None, "tier")
    assert lint.label_values("up") is None
    json.dumps([q.expr])  # plain strings
