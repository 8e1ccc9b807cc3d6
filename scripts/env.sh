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
# before anything else, so no dependency can pull an unpinned (multi-GB CUDA) build: from pip's configured index,
# or from FSDP_LAB_TORCH_INDEX_URL (pip --index-url), e.g. https://download.pytorch.org/whl/cpu for the CPU build
# or https://download.pytorch.org/whl/cu126 for CUDA 12.6.
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
  local extras="" torch index=${FSDP_LAB_TORCH_INDEX_URL:-}
  [ "${1:-}" = --test ] && extras="[test]"
  torch=$(_fsdp_lab_torch "$PY")
  if _fsdp_lab_usable_torch "$torch"; then
    echo "keeping torch ${torch%% *} (${torch#* })${index:+; FSDP_LAB_TORCH_INDEX_URL is not used}" >&2
  else
    [ -n "$torch" ] && echo "note: torch ${torch%% *} is older than $FSDP_LAB_TORCH_MIN; replacing it" >&2
    echo "installing $FSDP_LAB_TORCH_PIN from ${index:-the index pip is configured with}" >&2
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
