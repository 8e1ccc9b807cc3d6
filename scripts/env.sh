# Sourced by install.sh, course.sh and test.sh (from the repository root): picks the Python that runs everything
# and installs fsdp-lab into it.
#
# [Note: which python] The interpreter is $PYTHON if set, else the active virtual environment's or conda env's
# python, else python3. One that belongs to a virtual environment or conda env is used as it is. Any other gets
# the repository's .venv made from it (and reused afterwards), because pip must not write into a system Python:
# Debian 12 and Ubuntu 24.04 refuse outright (PEP 668, "externally-managed-environment"). A new .venv shares the
# base Python's packages (--system-site-packages) only when that Python already has torch 2.11 or newer, so a GPU
# server's CUDA build is reused instead of being replaced by a download.
#
# [Note: which torch] An environment with torch 2.11 or newer keeps it. Otherwise the pinned torch is installed
# before anything else, so no dependency can pull an unpinned (multi-GB CUDA) build. FSDP_LAB_TORCH_INDEX_URL
# (pip --index-url) names the index when set, e.g. https://download.pytorch.org/whl/cu126 for CUDA 12.6. Unset,
# a Linux machine with no NVIDIA GPU (no working `nvidia-smi -L`, nothing under /proc/driver/nvidia/gpus) gets
# the CPU build from FSDP_LAB_TORCH_CPU_INDEX_URL (default https://download.pytorch.org/whl/cpu, a few hundred
# MB), because PyPI's Linux torch is the CUDA build (several GB). When that index cannot be reached in 10 s,
# pip's configured index is used and the script says so. Elsewhere (a GPU, macOS, Windows) pip's configured
# index is used. Every branch prints which build it installs.
#
# FSDP_LAB_PIP_DRY_RUN=1 prints each pip command instead of running it; the interpreter is still picked and .venv
# still made, which is what tests/test_install_env.py exercises.
#
# Functions return non-zero after printing one "error: ..." line; callers add `|| exit 1`.

FSDP_LAB_TORCH_PIN="torch==2.13.0"
FSDP_LAB_TORCH_MIN="2.11"     # pyproject.toml's torch>= bound (a test keeps them equal)
FSDP_LAB_PYTHON_MIN="3.10"    # pyproject.toml's requires-python (a test keeps them equal)

# Asked of an interpreter with one argument. "facts" prints: in_env major.minor can_make_venv has_pip executable.
# "torch" prints: version, then words for the build ("CPU build", "CUDA 12.6 build"); nothing without torch.
_FSDP_LAB_PROBE='
import os, sys
from importlib.util import find_spec
if sys.argv[1] == "facts":
    in_env = (sys.prefix != getattr(sys, "base_prefix", sys.prefix)
              or os.path.isdir(os.path.join(sys.prefix, "conda-meta")))
    can_make_venv = bool(find_spec("venv") and find_spec("ensurepip"))  # Debian ships ensurepip apart
    print(int(in_env), "%d.%d" % sys.version_info[:2], int(can_make_venv), int(bool(find_spec("pip"))),
          sys.executable)
else:
    try:
        import torch
    except Exception:
        sys.exit(0)
    v = torch.version
    build = "CUDA " + v.cuda if v.cuda else "ROCm " + v.hip if getattr(v, "hip", None) else "CPU"
    print(torch.__version__, build, "build")
'

_fsdp_lab_at_least() {  # VERSION MIN: true when VERSION's major.minor is at least MIN's
  local a b x y
  IFS=. read -r a b _ <<< "${1%%+*}."
  IFS=. read -r x y _ <<< "$2."
  b=${b%%[!0-9]*}
  [[ $a =~ ^[0-9]+$ && $b =~ ^[0-9]+$ ]] || return 1
  (( a > x || (a == x && b >= y) ))
}

_fsdp_lab_torch() {  # INTERPRETER: its torch as "version build words", empty without one
  "$1" -c "$_FSDP_LAB_PROBE" torch 2>/dev/null || true
}

_fsdp_lab_usable_torch() {  # "version build words" (may be empty): true when it is torch 2.11 or newer
  [ -n "$1" ] && _fsdp_lab_at_least "${1%% *}" "$FSDP_LAB_TORCH_MIN"
}

# Sets PY (absolute path) to the interpreter that runs everything, making .venv when needed, and puts its bin
# directory first on PATH so jupyter, fsdp-lab and the other console scripts there are found by child processes.
fsdp_lab_select_python() {
  local cand facts in_env ver can_venv has_pip exe torch ssp err venv="$PWD/.venv" fix="install Python"
  if [ -n "${PYTHON:-}" ]; then
    cand=$PYTHON fix="set PYTHON to Python"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    cand=$VIRTUAL_ENV/bin/python
  elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
    cand=$CONDA_PREFIX/bin/python
  else
    cand=python3
  fi
  facts=$("$cand" -c "$_FSDP_LAB_PROBE" facts 2>/dev/null) || facts=""
  if [ -z "$facts" ]; then
    echo "error: cannot run '$cand' as Python; $fix $FSDP_LAB_PYTHON_MIN or newer" >&2
    return 1
  fi
  read -r in_env ver can_venv has_pip exe <<< "$facts"
  if ! _fsdp_lab_at_least "$ver" "$FSDP_LAB_PYTHON_MIN"; then
    echo "error: $exe is Python $ver; fsdp-lab needs $FSDP_LAB_PYTHON_MIN or newer (set PYTHON to one)" >&2
    return 1
  fi
  if [ "$in_env" = 1 ]; then
    PY=$exe
    echo "using $PY (its own virtual environment or conda env)" >&2
  elif [ -x "$venv/bin/python" ] && [ "$("$venv/bin/python" -c "$_FSDP_LAB_PROBE" facts 2>/dev/null |
                                         cut -d' ' -f4)" = 1 ]; then
    PY=$venv/bin/python
    echo "using $PY (remove $venv to make it again)" >&2
  else
    if [ "$can_venv" != 1 ]; then
      local sudo="sudo "
      [ "$(id -u)" = 0 ] && sudo=""
      echo "error: $exe cannot make a virtual environment (no venv/ensurepip module); install it with:" \
           "${sudo}apt-get install python$ver-venv" >&2
      return 1
    fi
    [ -e "$venv" ] && echo "note: $venv has no working python with pip; making it again" >&2
    ssp=""
    torch=$(_fsdp_lab_torch "$exe")
    if _fsdp_lab_usable_torch "$torch"; then
      ssp=--system-site-packages
      echo "note: $exe has torch ${torch%% *} (${torch#* }); the new .venv shares it" \
           "($ssp)" >&2
    fi
    echo "making $venv from $exe, which is not a virtual environment" \
         "(later: source .venv/bin/activate to use it in a shell)" >&2
    if ! err=$("$exe" -m venv --clear ${ssp:+"$ssp"} "$venv" 2>&1 >/dev/null); then
      rm -rf "$venv"
      echo "error: could not make $venv with $exe: ${err##*$'\n'}" >&2
      return 1
    fi
    PY=$venv/bin/python
  fi
  PATH="$(dirname "$PY"):$PATH"
  export PATH
}

FSDP_LAB_NVIDIA_PROC=${FSDP_LAB_NVIDIA_PROC:-/proc/driver/nvidia}   # where the NVIDIA driver lists its GPUs

_fsdp_lab_has_nvidia_gpu() {  # true when the NVIDIA driver reports a GPU on this machine
  if [ -d "$FSDP_LAB_NVIDIA_PROC/gpus" ] && [ -n "$(ls -A "$FSDP_LAB_NVIDIA_PROC/gpus" 2>/dev/null)" ]; then
    return 0
  fi
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

_fsdp_lab_reachable() {  # URL: true when $PY can fetch it within 10 s (asked of Python: no curl needed)
  "$PY" -c 'import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10).close()
except Exception:
    sys.exit(1)' "$1" >/dev/null 2>&1
}

# Sets index (empty: pip's configured one) and build (words for the log) per [Note: which torch].
_fsdp_lab_pick_torch_index() {
  local cpu=${FSDP_LAB_TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}
  index=${FSDP_LAB_TORCH_INDEX_URL:-} build="the build that index serves"
  [ -n "$index" ] && return 0
  build="pip's default build"
  if [ "$(uname -s)" != Linux ]; then
    return 0
  fi
  if _fsdp_lab_has_nvidia_gpu; then
    build="pip's default build (CUDA on Linux: an NVIDIA GPU is present)"
    return 0
  fi
  if _fsdp_lab_reachable "$cpu/torch/"; then
    index=$cpu build="the CPU build (no NVIDIA GPU found)"
  else
    if [ -n "${PIP_INDEX_URL:-}" ]; then  # a mirror or a CPU index of the user's: no guess at its build
      echo "note: no NVIDIA GPU found, but the CPU index $cpu cannot be reached; using PIP_INDEX_URL" \
           "($PIP_INDEX_URL); the build it served is named once installed" >&2
    else
      echo "note: no NVIDIA GPU found, but the CPU index $cpu cannot be reached; using pip's configured index" \
           "(PyPI unless pip's config names another; PyPI's Linux torch is the CUDA build, several GB);" \
           "the build it served is named once installed" >&2
    fi
  fi
}

_fsdp_lab_pip() {  # pip ARGS... with $PY, or only printed under FSDP_LAB_PIP_DRY_RUN=1
  if [ "${FSDP_LAB_PIP_DRY_RUN:-}" = 1 ]; then
    echo "dry run: $PY -m pip $*"
    return 0
  fi
  "$PY" -m pip "$@"
}

# [--test]: installs torch if $PY lacks a usable one ([Note: which torch]), then fsdp-lab from this checkout
# (editable), with the test tools under --test.
fsdp_lab_install() {
  local extras="" torch index=${FSDP_LAB_TORCH_INDEX_URL:-} build
  [ "${1:-}" = --test ] && extras="[test]"
  torch=$(_fsdp_lab_torch "$PY")
  if _fsdp_lab_usable_torch "$torch"; then
    echo "keeping torch ${torch%% *} (${torch#* })${index:+; FSDP_LAB_TORCH_INDEX_URL is not used}" >&2
  else
    [ -n "$torch" ] && echo "note: torch ${torch%% *} is older than $FSDP_LAB_TORCH_MIN; replacing it" >&2
    _fsdp_lab_pick_torch_index
    echo "installing $FSDP_LAB_TORCH_PIN, $build, from ${index:-the index pip is configured with}" >&2
    if ! _fsdp_lab_pip install -q ${index:+--index-url "$index"} "$FSDP_LAB_TORCH_PIN"; then
      echo "error: pip could not install $FSDP_LAB_TORCH_PIN into $PY (its output is above)" >&2
      return 1
    fi
    if [ "${FSDP_LAB_PIP_DRY_RUN:-}" != 1 ]; then
      torch=$(_fsdp_lab_torch "$PY")
      if [ -z "$torch" ]; then
        echo "error: pip installed $FSDP_LAB_TORCH_PIN but $PY cannot import torch; try: $PY -c 'import torch'" >&2
        return 1
      fi
      echo "installed torch ${torch%% *} (${torch#* })" >&2
    fi
  fi
  echo "installing fsdp-lab$extras from this checkout (editable)" >&2
  if ! _fsdp_lab_pip install -q -e ".$extras"; then
    echo "error: pip could not install fsdp-lab$extras into $PY (its output is above)" >&2
    return 1
  fi
}

FSDP_LAB_PROXY_PIN="configurable-http-proxy@5.3.0"   # fsdp_lab/workshop/install.py's PROXY_PIN (a test keeps them equal)

# configurable-http-proxy (JupyterHub's proxy, a Node program) for `fsdp-lab workshop` and its test, into the
# project-local prefix .workshop/node with npm, never globally. Returns non-zero when npm is missing or fails.
fsdp_lab_install_proxy() {
  local prefix="$PWD/.workshop/node"
  [ -x "$prefix/node_modules/.bin/configurable-http-proxy" ] && return 0
  if ! command -v npm >/dev/null 2>&1; then
    echo "error: npm not found; configurable-http-proxy (for fsdp-lab workshop) needs Node.js 20 or newer" >&2
    return 1
  fi
  echo "installing $FSDP_LAB_PROXY_PIN into $prefix (npm)" >&2
  if [ "${FSDP_LAB_PIP_DRY_RUN:-}" = 1 ]; then
    echo "dry run: npm install --prefix $prefix $FSDP_LAB_PROXY_PIN"
    return 0
  fi
  mkdir -p "$prefix" && npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "$FSDP_LAB_PROXY_PIN" >&2
}
