"""The settings tree: one model per section, unknown keys are errors naming the key (``kvtier serve`` exits 2
with one stderr line, no traceback), flat legacy keys and env names still land in their section, the policy
document's planner defaults are the pure planner's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.settings import (
    LearnedSettings,
    LMCacheMPSettings,
    Settings,
    SettingsError,
    VllmWarmupSettings,
    load_settings,
)
from kvtier.policies.planner import LinkBudget, PlannerConfig


def _serve_config(path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "serve", "--config", str(path), "--listen", "127.0.0.1:1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("bad.yaml", "collectors:\n  engine_urls: [http://127.0.0.1:1]\nengine_url: http://127.0.0.1:2\n",
         "'engine_url'"),
        ("bad.toml", "[collectors]\nscrape_intervall_s = 1.0\n", "'collectors.scrape_intervall_s'"),
        ("nested.yaml", "actuators:\n  - kind: lmcache-mp\n    url: http://127.0.0.1:1\n    retrys: 2\n",
         "'actuators.0.retrys'"),
        ("flat.toml", "scrape_intervall_s = 1.0\n", "'scrape_intervall_s'"),
    ],
)  # fmt: skip
def test_misspelled_key_exits_2_naming_it(tmp_path: Path, name: str, text: str, key: str) -> None:
    cfg = tmp_path / name
    cfg.write_text(text)
    r = _serve_config(cfg)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert key in lines[0] and "unknown key" in lines[0] and name in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_malformed_file_exits_2_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("collectors: [unclosed\n")
    r = _serve_config(cfg)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "broken.yaml" in r.stderr


def test_sections_from_yaml_env_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(
        "serve: {listen: '127.0.0.1:9000', mode: shadow}\n"
        "collectors: {engine_urls: ['127.0.0.1:1'], scrape_interval_s: 7}\n"
        "planner: {hysteresis_s: 12}\n"
        "loop: {tick_interval_s: 0.25, policy: lru}\n"
        "learned: {retrain_every: 500}\n"
        "actuators: [{kind: vllm-warmup, tokens_per_s: 100}, {kind: lmcache-mp, url: 'http://h:1'}]\n"
    )
    for k in [k for k in os.environ if k.startswith("KVTIER_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVTIER_COLLECTORS__SCRAPE_INTERVAL_S", "3")
    monkeypatch.setenv("KVTIER_MODE", "active")  # a flat (pre-tree) name still works
    s = load_settings(cfg, listen="127.0.0.1:9001")
    assert s.collectors.engine_urls == ["http://127.0.0.1:1"]
    assert s.collectors.scrape_interval_s == 3.0  # env beats file
    assert s.serve.listen_host_port == ("127.0.0.1", 9001) and s.serve.mode == "active"  # flag, env
    assert s.loop.policy == "lru" and s.learned.options() == {"retrain_every": 500}
    warm, mp = s.actuators
    assert isinstance(warm, VllmWarmupSettings) and warm.tokens_per_s == 100.0
    assert isinstance(mp, LMCacheMPSettings) and mp.url == "http://h:1"
    doc = PolicyDoc.model_validate(s.policy_doc_seed())
    assert (doc.hysteresis_s, doc.tick_interval_s, doc.mode) == (12.0, 0.25, "active")


def test_flat_actuator_env_lifts_into_the_tagged_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_ACTUATORS", "shadow,lmcache-controller")
    monkeypatch.setenv("KVTIER_ACTUATOR_OPTIONS", '{"lmcache-controller": {"instance_id": "w0"}}')
    monkeypatch.setenv("KVTIER_WARMUP_TOKENS_PER_S", "5")
    kinds = [(a.kind, getattr(a, "instance_id", None)) for a in load_settings().actuators]
    assert kinds == [("shadow", None), ("lmcache-controller", "w0")]
    monkeypatch.setenv("KVTIER_ACTUATOR_OPTIONS", '{"lmcache-controller": {"instance": "w0"}}')
    with pytest.raises(SettingsError, match="unknown key 'actuators.1.instance'"):
        load_settings()


def test_defaults_live_in_one_place() -> None:
    pc = {f.name: f.default for f in dataclasses.fields(PlannerConfig)}
    doc = PolicyDoc()
    for k in ("hysteresis_s", "pin_retry_s", "min_gain_s", "reuse_threshold", "prefill_s_per_token"):
        assert getattr(doc, k) == pc[k], k
    assert doc.default_budget.model_dump() == dataclasses.asdict(LinkBudget())
    assert LearnedSettings().options() == {}  # the learned section mirrors the constructor's defaults
    assert PolicyDoc.model_validate(Settings().policy_doc_seed()) == PolicyDoc()


def test_every_field_has_a_description() -> None:
    from pydantic import BaseModel

    seen: set[type] = set()
    missing: list[str] = []

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, f in model.model_fields.items():
            if not f.description and name != "kind":
                missing.append(f"{model.__name__}.{name}")
            for arg in _models(f.annotation):
                walk(arg)

    walk(Settings)
    assert not missing, missing


def _models(tp: object) -> list[type]:
    import typing

    from pydantic import BaseModel

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models(a)]


def test_actuator_options_follow_the_actuator_wherever_it_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file's options for an actuator apply when a flag or the environment names it (``kvtier bench``
    starts ``kvtier serve --config F --actuator lmcache-l1`` with the keeper's knobs in F); the L1 keeper the
    sidecar builds gets them."""
    from kvtier.controller.root import build_sidecar
    from kvtier.controller.settings import LMCacheL1Settings

    for k in [k for k in os.environ if k.startswith("KVTIER_")]:
        monkeypatch.delenv(k)
    flat = tmp_path / "flat.yaml"
    flat.write_text("actuator_options:\n  lmcache-l1:\n    measure_every_s: 2.0\n    model_name: tiny\n")
    tree = tmp_path / "tree.yaml"
    tree.write_text(
        "actuators: [{kind: lmcache-l1, measure_every_s: 3.0, model_name: tiny}, {kind: shadow}]\n"
    )
    (l1,) = load_settings(flat, actuators=["lmcache-l1"]).actuators
    assert isinstance(l1, LMCacheL1Settings) and l1.measure_every_s == 2.0
    assert load_settings(flat).actuators == []  # options alone enable nothing
    kinds = [(a.kind, getattr(a, "measure_every_s", None)) for a in load_settings(tree).actuators]
    assert kinds == [("lmcache-l1", 3.0), ("shadow", None)]
    monkeypatch.setenv("KVTIER_ACTUATORS", "shadow")  # the env's list replaces the file's ...
    assert [a.kind for a in load_settings(tree).actuators] == ["shadow"]
    s = load_settings(
        tree, actuators=["lmcache-l1"], lmcache_urls=["http://127.0.0.1:9"], state_dir=str(tmp_path)
    )
    (l1,) = s.actuators  # ... and a name alone takes the file's entry of that kind
    assert isinstance(l1, LMCacheL1Settings) and l1.measure_every_s == 3.0
    sc = build_sidecar(s)
    assert sc.l1_keeper is not None and sc.l1_keeper.measure_every_s == 3.0
    assert sc.plane.loop.actuators == []  # the keeper is not a planner actuator
    monkeypatch.setenv("KVTIER_WARMUP_TOKENS_PER_S", "5")  # flat options alone do not clear a file's list
    monkeypatch.delenv("KVTIER_ACTUATORS")
    assert [a.kind for a in load_settings(tree).actuators] == ["lmcache-l1", "shadow"]


def test_unknown_key_names_the_closest_setting(tmp_path: Path) -> None:
    cfg = tmp_path / "k.yaml"
    cfg.write_text("engine_url: [http://127.0.0.1:1]\nactuators: [{kind: lmcache-l1, measure_every: 2}]\n")
    with pytest.raises(SettingsError) as ei:
        load_settings(cfg)
    msg = str(ei.value)
    assert "unknown key 'engine_url' (did you mean 'engine_urls'?)" in msg, msg
    assert "unknown key 'actuators.0.measure_every' (did you mean 'measure_every_s'?)" in msg, msg
