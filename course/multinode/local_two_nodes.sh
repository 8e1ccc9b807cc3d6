#!/usr/bin/env bash
# Rehearse a two-node job on one machine: two copies of torchrun_two_nodes.sh, one per "node", meeting at
# 127.0.0.1:$PORT. Exactly the flags of a real two-node run; only the address, the device and the model size
# differ. CPU and gloo, so it runs on a laptop.
#
#   bash course/multinode/local_two_nodes.sh                 # 2 "nodes" x 1 process, 5 tiny steps, FULL_SHARD
#   NPROC=2 STRATEGY=HYBRID_SHARD RDZV_BACKEND=c10d bash course/multinode/local_two_nodes.sh   # HSDP on 2 x 2
#   PORT=29611 STEPS=20 CKPT=/tmp/run bash course/multinode/local_two_nodes.sh   # rerun it: resumes from /tmp/run
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$(mktemp -d)}"
export HEAD=127.0.0.1 PORT="${PORT:-29500}" STEPS="${STEPS:-5}" GPUS="${NPROC:-1}" \
  STRATEGY="${STRATEGY:-FULL_SHARD}" RDZV_BACKEND="${RDZV_BACKEND:-static}" RDZV_ID="${RDZV_ID:-rehearsal}" \
  DEVICE=cpu PRESET=tiny PRECISION=fp32 BATCH="${BATCH:-8}" EVERY="${EVERY:-0}" CKPT="${CKPT:-$OUT/ckpt}"
extra=(--lr 1e-3 --timeout 60 --rdzv-timeout 120 --no-progress --json-log "$OUT/log.jsonl")
NODE_RANK=1 bash "$HERE/torchrun_two_nodes.sh" "${extra[@]}" > "$OUT/node1.log" 2>&1 &
node1=$!
status=0
NODE_RANK=0 bash "$HERE/torchrun_two_nodes.sh" "${extra[@]}" || status=$?
wait "$node1" || status=$?
echo "node 1's output: $OUT/node1.log; per-step log: $OUT/log.jsonl; checkpoints: $CKPT; exit $status"
exit "$status"
