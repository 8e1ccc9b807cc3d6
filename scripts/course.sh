#!/usr/bin/env bash
# Installs fsdp-lab and opens the course: JupyterLab on notebooks/, bound to 127.0.0.1, token auth on.
# Extra arguments go to `fsdp-lab lab` (e.g. --ip 0.0.0.0 on a lab server; the token stays on).
# Everything runs with the Python that scripts/env.sh picks (the active environment, else .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
fsdp_lab_select_python || exit 1
fsdp_lab_install || exit 1
# The chapters are in Chinese and English: without a CJK font the browser draws the Chinese as boxes.
if command -v fc-list >/dev/null 2>&1 && [ -z "$(fc-list :lang=zh 2>/dev/null | head -n 1)" ]; then
  echo "note: no Chinese font found (fc-list :lang=zh is empty), so a browser on this machine shows the Chinese" \
       "text as boxes; on Debian/Ubuntu: sudo apt-get install fonts-noto-cjk (or fonts-wqy-microhei)" >&2
fi
exec "$PY" -m fsdp_lab lab "$@"
