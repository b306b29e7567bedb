"""The Helm chart (deploy/helm/kvtier) through Helm's own Go SDK (``helm-python-sdk``: ``helm lint`` and
``helm template`` without a helm binary), every rendered Kubernetes object validated against the bundled
schemas of two Kubernetes versions (``kubernetes-validate``, strict: unknown fields fail), and the
PrometheusRule's rules through the real ``promtool``.

The Prometheus Operator's kinds (PodMonitor, ServiceMonitor, PrometheusRule) have no schema in
``kubernetes-validate``: they go through the validators ``@kubernetes-models/prometheus-operator`` generates
from the operator's Go API types (npm, installed by ``scripts/setup-peers.sh``; types, enums and required
fields, but unknown fields pass), their references (ports, Secret, selector) are checked against the rendered
Pod and the rules with ``promtool check rules``."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier import __version__
from tests.e2e.prom import promtool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvtier"
KUBE_VERSIONS = ("1.33.0", "1.37.0")  # native sidecars are GA from 1.33; the newest bundled schemas
CRD_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "servicemonitor-existing-secret-pvc": {
        "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": False},
                       "prometheusRule": {"runbookBaseUrl": "https://example.org/kvtier/docs"}},
        "kvtier": {"apiToken": {"existingSecret": "my-token"}, "state": {"claimName": "kvtier-state"},
                   "mode": "active", "actuators": ["lmcache-mp", "vllm-warmup"]},
        "lmcache": {"l2": {"enabled": True, "claimName": "nvme"}},
    },
    "no-lmcache-no-monitoring": {
        "lmcache": {"enabled": False},
        "kvtier": {"actuators": ["vllm-warmup"]},
        "monitoring": {"podMonitor": {"enabled": False}, "vllmPodMonitor": {"enabled": False},
                       "prometheusRule": {"enabled": False}, "dashboards": {"enabled": False}},
    },
}  # fmt: skip

helm = pytest.importorskip("helm_python", reason="dev extra: pip install -e '.[dev]'")


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    out = helm.Chart.load(CHART).render(values, name="demo", namespace="llm", is_install=True)
    docs = [d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if isinstance(d, dict)]  # fmt: skip
    assert docs
    return docs


def operator_validation(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per object (``kind``, ``name``, ``ok``, ``errors``) from the operator's validators."""
    script = os.environ.get("KVTIER_CRD_VALIDATOR")
    if not script:
        pytest.fail("KVTIER_CRD_VALIDATOR unset: run scripts/setup-peers.sh and source .peers/env.sh")
    r = subprocess.run(["node", Path(script).name], input=json.dumps(objs), capture_output=True, text=True,
                       cwd=Path(script).parent, timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return [json.loads(ln) for ln in r.stdout.splitlines()]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    spec: dict[str, Any] = dep["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_helm_lint_strict(kube: str) -> None:
    report = helm.lint(CHART, strict=True, kube_version=f"v{kube}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_rendered_object_validates(variant: str, kube: str) -> None:
    docs = render(VARIANTS[variant])
    validated = 0
    for d in docs:
        if d["kind"] in CRD_KINDS:  # no Kubernetes schema: test_operator_objects_validate checks them
            assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["metadata"]["name"]
            continue
        kubernetes_validate.validate(d, kube, strict=True)  # raises ValidationError naming the field
        validated += 1
    assert validated >= 3  # Deployment, Service, ... at least


@pytest.mark.node
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_operator_objects_validate(variant: str) -> None:
    crs = [d for d in render(VARIANTS[variant]) if d["kind"] in CRD_KINDS]
    verdicts = operator_validation(crs)
    assert [(v["kind"], v["name"]) for v in verdicts] == [(d["kind"], d["metadata"]["name"]) for d in crs]
    assert all(v["ok"] for v in verdicts), [v for v in verdicts if not v["ok"]]
    want = {
        "defaults": {"PodMonitor", "PrometheusRule"},
        "no-lmcache-no-monitoring": set(),
        "servicemonitor-existing-secret-pvc": {"PodMonitor", "ServiceMonitor", "PrometheusRule"},
    }
    assert {d["kind"] for d in crs} == want[variant]


@pytest.mark.node
def test_operator_validation_rejects_a_malformed_monitor() -> None:
    """The validator can fail: a wrong type, a bad enum value and a rule without ``expr``."""
    crs = [d for d in render({}) if d["kind"] in CRD_KINDS]
    (pm,) = [d for d in crs if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "demo-kvtier"]
    (rule,) = [d for d in crs if d["kind"] == "PrometheusRule"]
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = 15
    pm["spec"]["podMetricsEndpoints"][0]["scheme"] = "gopher"
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    verdicts = {v["kind"]: v for v in operator_validation([pm, rule])}
    assert not verdicts["PodMonitor"]["ok"] and "interval" in verdicts["PodMonitor"]["errors"]
    assert "scheme" in verdicts["PodMonitor"]["errors"]
    assert not verdicts["PrometheusRule"]["ok"] and "expr" in verdicts["PrometheusRule"]["errors"]


def test_pod_runs_kvtier_as_a_hardened_native_sidecar() -> None:
    spec = pod_spec(render({}))
    (kv,) = [c for c in spec["initContainers"] if c["name"] == "kvtier"]
    assert kv["restartPolicy"] == "Always"  # native sidecar: up before vLLM, down after it
    sc = kv["securityContext"]
    assert isinstance(sc["runAsUser"], int) and sc["runAsUser"] > 0 and sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in kv["volumeMounts"]}
    assert mounts["/tmp"] == "kvtier-tmp" and mounts["/var/lib/kvtier"] == "kvtier-state"
    assert "--state-dir=/var/lib/kvtier" in kv["args"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in vols["kvtier-tmp"] and "emptyDir" in vols["kvtier-state"]
    assert kv["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert kv["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert kv["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert kv["resources"]["requests"]["memory"] and kv["resources"]["limits"]["memory"]
    env = {e["name"]: e for e in kv["env"]}
    assert "secretKeyRef" in env["KVTIER_API_TOKEN"]["valueFrom"]  # the token never sits in the manifest
    assert "--listen=0.0.0.0:8787" in kv["args"]  # pod IP for Prometheus: with the token only
    assert "--engine-url=http://127.0.0.1:8000" in kv["args"]
    names = [c["name"] for c in spec["containers"]]
    assert names == ["vllm", "lmcache"]
    vllm_args = " ".join(spec["containers"][0]["args"])
    assert "LMCacheMPConnector" in vllm_args and "enable_kv_cache_events" in vllm_args


def test_token_secret_is_created_unless_one_is_named() -> None:
    docs = render({})
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert len(secret["data"]["token"]) >= 40 and secret["metadata"]["name"] == "demo-kvtier-api-token"
    docs = render(VARIANTS["servicemonitor-existing-secret-pvc"])
    assert not [d for d in docs if d["kind"] == "Secret"]
    kv = pod_spec(docs)["initContainers"][0]
    env = {e["name"]: e for e in kv["env"]}
    assert env["KVTIER_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-token"


@pytest.mark.parametrize("variant", ["defaults", "servicemonitor-existing-secret-pvc"])
def test_monitors_point_at_real_ports_and_the_token(variant: str) -> None:
    docs = render(VARIANTS[variant])
    spec = pod_spec(docs)
    ports = {p["name"] for c in spec["containers"] + spec["initContainers"] for p in c.get("ports", [])}
    svc = next(d for d in docs if d["kind"] == "Service")
    env = {e["name"]: e for e in spec["initContainers"][0]["env"]}
    secret = env["KVTIER_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    monitors = [d for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")]
    assert monitors
    for m in monitors:
        eps = m["spec"].get("podMetricsEndpoints") or m["spec"]["endpoints"]
        want = ports if m["kind"] == "PodMonitor" else {p["name"] for p in svc["spec"]["ports"]}
        assert all(e["port"] in want for e in eps), (m["metadata"]["name"], eps)
        assert m["spec"]["selector"]["matchLabels"].items() <= svc["spec"]["selector"].items()
        for e in eps:
            if e["port"] == "kvtier":
                assert e["authorization"]["credentials"] == {"name": secret["name"], "key": secret["key"]}
                assert m["spec"]["jobLabel"] == "kvtier.dev/job"  # -> job="kvtier", as the alerts expect


def test_prometheus_rule_carries_the_alert_rules(tmp_path: Path) -> None:
    docs = render(VARIANTS["servicemonitor-existing-secret-pvc"])
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    source = yaml.safe_load((ROOT / "deploy/prometheus/rules/kvtier.yml").read_text())
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts.keys() == {r["alert"] for g in source["groups"] for r in g["rules"] if "alert" in r}
    for name, r in alerts.items():
        url = r["annotations"]["runbook_url"]
        assert url == f"https://example.org/kvtier/docs/operate.md#{name.lower()}", url
    f = tmp_path / "rules.yml"
    f.write_text(yaml.safe_dump(rule["spec"]))
    r = promtool("check", "rules", f)
    assert r.returncode == 0, r.stdout + r.stderr


def test_chart_files_are_the_repository_sources() -> None:
    """The chart carries copies (Helm reads only its own directory); refresh them with
    ``cp dashboards/*.json deploy/helm/kvtier/files/dashboards/`` and
    ``cp deploy/prometheus/rules/kvtier.yml deploy/helm/kvtier/files/prometheus/``."""
    src = sorted((ROOT / "dashboards").glob("*.json"))
    assert [p.name for p in src] == sorted(p.name for p in (CHART / "files/dashboards").glob("*.json"))
    for p in src:
        assert (CHART / "files/dashboards" / p.name).read_bytes() == p.read_bytes(), p.name
    rules = (ROOT / "deploy/prometheus/rules/kvtier.yml").read_bytes()
    assert (CHART / "files/prometheus/kvtier.yml").read_bytes() == rules


def test_dashboards_are_configmaps_for_grafanas_sidecar() -> None:
    docs = render({})
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for p in sorted((ROOT / "dashboards").glob("*.json")):
        cm = cms[f"demo-kvtier-{p.stem}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"][p.name]) == json.loads(p.read_text())


def test_chart_app_version_is_kvtiers() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert pod_spec(render({}))["initContainers"][0]["image"] == f"kvtier:{__version__}"


def test_every_runbook_url_has_a_section_in_the_operator_guide() -> None:
    doc = (ROOT / "docs" / "operate.md").read_text()
    anchors = {h.strip().lower() for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules/kvtier.yml").read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                path, _, anchor = r["annotations"]["runbook_url"].partition("#")
                assert path == "docs/operate.md" and anchor == r["alert"].lower(), r["alert"]
                assert anchor in anchors, f"docs/operate.md has no section {r['alert']}"
