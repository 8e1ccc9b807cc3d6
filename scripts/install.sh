#!/usr/bin/env bash
# Installs fsdp-lab and what it needs. A machine with no torch gets the CPU build (torch==2.13.0), not the
# multi-GB CUDA build that a bare `torch` requirement would pull; a machine that already has torch (a GPU lab
# server, say) keeps its own.  Usage: scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.13.0
fi
if [ "${1:-}" = "--test" ]; then
  "$PY" -m pip install -q -e ".[test]"
else
  "$PY" -m pip install -q -e .
fi
