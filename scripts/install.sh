#!/usr/bin/env bash
# Installs fsdp-lab (editable) and what it needs into the Python that scripts/env.sh picks: the active virtual
# environment or conda env, else the repository's .venv; see [Note: which python] and [Note: which torch] there.
# Usage: scripts/install.sh [--test]   (--test adds the test tools)
set -euo pipefail
case "${1:-}" in
  "" | --test) ;;
  *) echo "usage: scripts/install.sh [--test]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
. scripts/env.sh
fsdp_lab_select_python || exit 1
fsdp_lab_install "$@" || exit 1
