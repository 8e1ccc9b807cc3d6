#!/usr/bin/env bash
# Installs fsdp-lab and opens the course: JupyterLab on notebooks/, bound to 127.0.0.1, token auth on.
# Extra arguments go to `fsdp-lab lab` (e.g. --ip 0.0.0.0 on a lab server; the token stays on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec fsdp-lab lab "$@"
