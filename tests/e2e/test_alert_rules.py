"""Alert and recording rules with the REAL ``promtool`` (Debian ``prometheus``): ``check rules``, ``check
config``, and ``test rules`` over one unit-test file per alert family, each of which must cover its alerts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.prom import promtool

pytestmark = pytest.mark.prometheus

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))
TESTS = sorted((PROM / "tests").glob("*.test.yml"))
ALERTS = sorted({a for f in RULES for a in re.findall(r"^\s*- alert:\s*(\w+)", f.read_text(), re.M)})


def test_check_rules() -> None:
    assert RULES
    r = promtool("check", "rules", *RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_check_config() -> None:
    r = promtool("check", "config", "--syntax-only", PROM / "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_five_alert_families_exist() -> None:
    assert {
        "KvtierTTFTP99Regression",
        "KvtierActuationFailureRatio",
        "KvtierKVEventLoss",
        "KvtierSidecarDown",
        "KvtierTierNearlyFull",
    } <= set(ALERTS)


@pytest.mark.parametrize("test_file", TESTS, ids=[t.name for t in TESTS])
def test_promtool_unit_tests(test_file: Path) -> None:
    r = promtool("test", "rules", test_file.name, cwd=test_file.parent)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_firing_unit_test() -> None:
    covered: set[str] = set()
    for t in TESTS:
        text = t.read_text()
        # an alertname whose expectation lists at least one alert (exp_labels follows)
        for m in re.finditer(r"alertname:\s*(\w+)\s*\n\s*exp_alerts:\s*\n\s*- exp_labels", text):
            covered.add(m.group(1))
    assert sorted(set(ALERTS) - covered) == []


def test_a_broken_rule_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum(rate(up[5m])\n")
    r = promtool("check", "rules", bad)
    out = r.stdout + r.stderr
    # rejected for the reason planted (not a crash or a missing file): the unclosed parenthesis of rule X
    assert r.returncode == 1 and "FAILED" in out and '"X"' in out and "unclosed left parenthesis" in out, out
    good = tmp_path / "good.yml"
    good.write_text(bad.read_text().replace("sum(rate(up[5m])", "sum(rate(up[5m]))"))
    assert promtool("check", "rules", good).returncode == 0  # the same file with the bug fixed passes
