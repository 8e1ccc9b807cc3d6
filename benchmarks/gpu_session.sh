#!/usr/bin/env bash
# One GPU session: the GPU checks, `fsdp-lab bench` at 369M and 1.3B (world size 1, NCCL) with a profiler trace
# of one overlapped step, a memory-only bench of two gloo ranks sharing the GPU, and the course's GPU lifecycle
# traces (scripts/record_gpu_traces.py). Everything lands in $OUT.
#
#   bash benchmarks/gpu_session.sh                 # on the H200, from the repo root (OUT defaults to ./gpu_out)
#   bash benchmarks/gpu_session.sh --cpu-smoke     # the same steps on CPU, tiny presets (1-2 minutes; OUT
#                                                  # defaults to $TMPDIR/fsdp_lab_gpu_smoke)
#
# Needs only python3 with torch (nothing pip-installed: PYTHONPATH=. is set here); pytest is optional. Each step
# has its own timeout, cut to what is left of the session budget (BUDGET_S, default 540 s), so one hang cannot
# eat the session. Files written (7; at most 8 files of at most 16 MiB come back from the device, checked last):
#   log.txt               everything printed, with each step's command, exit code and duration
#   gpu_checks.txt        PASS/FAIL per check (benchmarks/gpu_checks.py)
#   bench_369m.json       last line of `fsdp-lab bench --device cuda --preset 369m`
#   bench_1.3b.json       same at 1.3B
#   overlap_trace.json.gz torch.profiler Chrome trace of one fsdp_lab step at 369M (+ lifecycle events, summary)
#   gloo_mem.json         memory-only bench, 369M, 2 gloo ranks on one GPU
#   gpu_traces.tar.gz     fsdp_lab/data/gpu_traces/ as recorded here (NCCL 1 rank, gloo 2 and 4 ranks), packed
set -u
cd "$(dirname "$0")/.."
MODE=gpu
if [ "${1:-}" = "--cpu-smoke" ]; then MODE=cpu; fi
if [ "$MODE" = gpu ]; then OUT=${OUT:-./gpu_out}; else OUT=${OUT:-${TMPDIR:-/tmp}/fsdp_lab_gpu_smoke}; fi
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: > "$LOG"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-540}
# TIME_SCALE stretches every step's limit (and the budget) on a slow or shared machine; the device keeps 1.
TIME_SCALE=${TIME_SCALE:-1}
case "$TIME_SCALE" in ''|*[!0-9]*|0) echo "gpu_session.sh: TIME_SCALE must be a positive integer, got '$TIME_SCALE'" >&2; exit 2;; esac
BUDGET_S=$(( BUDGET_S * TIME_SCALE ))
T0=$(date +%s)
FAILED=()

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: run CMD with a timeout of min(LIMIT_S, what is left), output appended to the log.
step() {
  local name=$1 limit=$(( $2 * TIME_SCALE )); shift 2
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then say "=== SKIP $name: only ${left}s of the budget left"; FAILED+=("$name(skipped)"); return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "=== $name (timeout ${limit}s): $*"
  local start rc
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  say "=== $name: exit $rc after $(( $(date +%s) - start ))s (session at $(( $(date +%s) - T0 ))s)"
  [ "$rc" -ne 0 ] && FAILED+=("$name(exit $rc)")
}

say "=== gpu_session mode=$MODE date=$(date -u +%FT%TZ) host=$(hostname) out=$OUT"
say "commit: $(git rev-parse HEAD 2>/dev/null || echo 'no git checkout here')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" 2>&1 | tee -a "$LOG"

if [ "$MODE" = gpu ]; then
  DEV=(--device cuda); BIG=369m; HUGE=1.3b; SHORT=(); CHECKS=()
else
  DEV=(--device cpu --nproc-per-node 1); BIG=tiny; HUGE=small; SHORT=(--rounds 2 --steps-per-round 2); CHECKS=(--cpu-smoke)
fi

step gpu_checks 170 "$PY" benchmarks/gpu_checks.py ${CHECKS[@]+"${CHECKS[@]}"} --timeout $(( 110 * TIME_SCALE )) --out "$OUT/gpu_checks.txt"
OPT=()  # AdamW defaults to fused on CUDA (the same for all three setups)
step "bench_$BIG" 150 "$PY" -m fsdp_lab bench "${DEV[@]}" --preset "$BIG" ${SHORT[@]+"${SHORT[@]}"} \
  --trace "$OUT/overlap_trace.json.gz" --json-out "$OUT/bench_369m.json" --timeout $(( 140 * TIME_SCALE ))
# At world size 1 a setup that fails is reported in the JSON ("error") and the others still run: if one did
# (fused AdamW on FSDP2's DTensors, say), retry once with foreach AdamW for all three, and use it at 1.3B too.
some_failed() { [ -s "$1" ] && "$PY" -c "import json, sys; r = json.load(open(sys.argv[1]))['results']
sys.exit(0 if any('error' in row for row in r.values()) else 1)" "$1"; }
if [ "$MODE" = gpu ] && some_failed "$OUT/bench_369m.json"; then
  OPT=(--optimizer foreach)
  step "bench_${BIG}_foreach" 120 "$PY" -m fsdp_lab bench "${DEV[@]}" --preset "$BIG" ${OPT[@]+"${OPT[@]}"} \
    --trace "$OUT/overlap_trace.json.gz" --json-out "$OUT/bench_369m.json" --timeout $(( 110 * TIME_SCALE ))
fi
step "bench_$HUGE" 170 "$PY" -m fsdp_lab bench "${DEV[@]}" --preset "$HUGE" ${SHORT[@]+"${SHORT[@]}"} ${OPT[@]+"${OPT[@]}"} \
  --json-out "$OUT/bench_1.3b.json" --timeout $(( 160 * TIME_SCALE ))
if [ "$MODE" = gpu ]; then
  step gloo_mem 130 "$PY" -m fsdp_lab bench --device cuda --backend gloo --nproc-per-node 2 --preset 369m \
    --memory-only --memory-steps 2 --json-out "$OUT/gloo_mem.json" --timeout $(( 120 * TIME_SCALE ))
else
  step gloo_mem 90 "$PY" -m fsdp_lab bench --device cpu --backend gloo --nproc-per-node 2 --preset tiny \
    --memory-only --json-out "$OUT/gloo_mem.json" --timeout $(( 80 * TIME_SCALE ))
fi

# The lifecycle traces chapters 03 and 06 replay, packed into one archive (unpack it into fsdp_lab/data/).
if [ "$MODE" = gpu ]; then
  step gpu_traces 150 "$PY" scripts/record_gpu_traces.py --out "$OUT/gpu_traces" --timeout $(( 60 * TIME_SCALE ))
else
  step gpu_traces 120 "$PY" scripts/record_gpu_traces.py --device cpu --smoke --out "$OUT/gpu_traces" --timeout $(( 60 * TIME_SCALE ))
fi
if [ -d "$OUT/gpu_traces" ]; then
  tar -czf "$OUT/gpu_traces.tar.gz" -C "$OUT" gpu_traces && rm -rf "$OUT/gpu_traces"
fi

# The same checks through pytest, if this machine has it and time is left (the plain script above is the record).
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  if [ "$MODE" = gpu ]; then
    step pytest_gpu 120 "$PY" -m pytest tests/test_gpu.py -q -p no:cacheprovider -o addopts=""
  else
    say "=== pytest tests/test_gpu.py: skipped in --cpu-smoke (its tests skip without CUDA)"
  fi
else
  say "=== pytest is not installed here: skipped tests/test_gpu.py (gpu_checks.txt holds the same checks)"
fi

say "=== files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
# What the device hands back: at most 8 plain files of at most 16 MiB, nothing in subfolders.
n_files=$(find "$OUT" -mindepth 1 | wc -l)
big=$(find "$OUT" -type f -size +16M -printf '%f ')
[ "$n_files" -gt 8 ] && { say "=== too many results: $n_files entries in $OUT (at most 8 come back)"; FAILED+=("results(count $n_files)"); }
[ -n "$big" ] && { say "=== results over 16 MiB (they would not come back): $big"; FAILED+=("results(size)"); }
if [ "${#FAILED[@]}" -eq 0 ]; then
  say "=== gpu_session done in $(( $(date +%s) - T0 ))s: every step exited 0"
else
  say "=== gpu_session done in $(( $(date +%s) - T0 ))s: problems: ${FAILED[*]}"
fi
exit 0
