#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs the real peers (vLLM CPU, LMCache, Mooncake,
# Prometheus, Chromium), a dev venv with kvtier, then runs ruff, lint-imports, mypy and pytest.
# Usage: scripts/test.sh [--fast] [pytest args...]
#   --fast: the tests that need no live peer (no vLLM, LMCache, Mooncake, Prometheus, Chromium, compose
#           client, npm validators, nothing marked slow), without installing the peers; the full suite (no flag) is CI's.
set -euo pipefail
cd "$(dirname "$0")/.."
export DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 PIP_DISABLE_PIP_VERSION_CHECK=1
FAST=()
if [ "${1:-}" = --fast ]; then
  shift
  FAST=(-m "not (slow or vllm or lmcache or mooncake or prometheus or browser or compose or node)")
else
  scripts/setup-peers.sh
  # shellcheck disable=SC1091
  . "${KVTIER_PEERS_DIR:-.peers}/env.sh"
fi
VENV=${KVTIER_DEV_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
"$VENV/bin/pip" install -q -U pip
"$VENV/bin/pip" install -q -e '.[dev]'
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/python" scripts/lint_imports.py  # lint-imports: the layers contract in pyproject.toml
"$VENV/bin/python" scripts/typecheck.py
exec "$VENV/bin/python" -m pytest "${FAST[@]}" "$@"
