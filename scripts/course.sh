#!/usr/bin/env bash
# Installs fsdp-lab and opens the course: JupyterLab on notebooks/, bound to 127.0.0.1, token auth on.
# Extra arguments go to `fsdp-lab lab` (e.g. --ip 0.0.0.0 on a lab server; the token stays on).
# Everything runs with the Python that scripts/env.sh picks (the active environment, else .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
fsdp_lab_select_python || exit 1
fsdp_lab_install || exit 1
exec "$PY" -m fsdp_lab lab "$@"
