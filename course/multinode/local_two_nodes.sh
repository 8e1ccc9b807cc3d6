#!/usr/bin/env bash
# Rehearse a two-node job on one machine: two `fsdp-lab train` launchers, one per "node", meeting at
# 127.0.0.1:$PORT through torchrun's static rendezvous. Exactly the flags of a real two-node run; only the
# address differs. CPU and gloo, so it runs on a laptop.
#
#   bash course/multinode/local_two_nodes.sh            # 2 "nodes" x 1 process, 5 tiny steps
#   PORT=29611 STEPS=20 bash course/multinode/local_two_nodes.sh
set -euo pipefail
read -ra FSDP_LAB <<< "${FSDP_LAB:-fsdp-lab}"   # e.g. FSDP_LAB="python -m fsdp_lab" without the console script
PORT="${PORT:-29500}"
STEPS="${STEPS:-5}"
OUT="${OUT:-$(mktemp -d)}"
common=(--nnodes 2 --rdzv-endpoint "127.0.0.1:$PORT" --nproc-per-node 1 --device cpu --preset tiny
        --steps "$STEPS" --global-batch 8 --timeout 60 --no-progress)
"${FSDP_LAB[@]}" train "${common[@]}" --node-rank 1 > "$OUT/node1.log" 2>&1 &
node1=$!
status=0
"${FSDP_LAB[@]}" train "${common[@]}" --node-rank 0 --json-log "$OUT/log.jsonl" || status=$?
wait "$node1" || status=$?
echo "node 1's output: $OUT/node1.log; per-step log: $OUT/log.jsonl; exit $status"
exit "$status"
