#!/usr/bin/env bash
# Installs fsdp-lab with its test tools (and Chromium for the browser test) and runs the whole suite:
# unit and multi-rank tests, every notebook under nbval, the browser test, the workshop hub test and the CPU
# benchmark smoke run.
# pytest's exit code 5 ("no tests collected") is turned into a failure: an empty run must never pass.
# Everything runs with the Python that scripts/env.sh picks (the active environment, else .venv).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
fsdp_lab_select_python || exit 1
fsdp_lab_install --test || exit 1
# The workshop test runs a real JupyterHub, whose proxy comes from npm (a few seconds; skipped once installed).
fsdp_lab_install_proxy || echo "warning: configurable-http-proxy is not installed; the workshop test will say why it cannot run"
# The browser test drives JupyterLab in Debian's Chromium; the CJK font only makes its screenshots legible.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
    || echo "warning: could not install chromium; the browser test will say why it cannot run"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-wqy-microhei >/dev/null 2>&1 \
    || echo "note: no CJK font installed; screenshots will show boxes for Chinese text"
fi
"$PY" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
