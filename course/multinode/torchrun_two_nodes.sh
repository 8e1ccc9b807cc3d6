#!/usr/bin/env bash
# Two GPU nodes, started by hand (or by any scheduler that runs one copy per node). Run the same script on
# both nodes:
#
#   node001$ HEAD=node001 bash course/multinode/torchrun_two_nodes.sh
#   node002$ HEAD=node001 bash course/multinode/torchrun_two_nodes.sh
#
# HYBRID_SHARD (the multi-node default): each unit is sharded over the GPUS ranks of a node, and only the reduced
# gradient shards cross between nodes (an all-reduce over the nodes). fsdp-lab train hands --nnodes and
# --rdzv-endpoint to torchrun; with the c10d rendezvous the nodes meet at HEAD:PORT and torchrun gives each its
# node rank (NODE_RANK is only read with RDZV_BACKEND=static). CKPT must be on a file system both nodes see:
# every rank writes its own piece of a checkpoint. The job ends with exit 3 if a rank dies or a peer stops
# answering for --timeout seconds, and --resume makes a rerun continue from the last complete checkpoint.
#
# Rehearse it on one machine: two copies with HEAD=127.0.0.1 DEVICE=cpu PRESET=tiny GPUS=2 (what
# tests/test_course_kit.py does). Extra arguments are passed on to fsdp-lab train.
set -euo pipefail
: "${HEAD:?set HEAD to the host name of node 0}"
read -ra FSDP_LAB <<< "${FSDP_LAB:-fsdp-lab}"   # e.g. FSDP_LAB="python -m fsdp_lab" without the console script
NNODES="${NNODES:-2}"
NODE_RANK="${NODE_RANK:-0}"
GPUS="${GPUS:-8}"                     # processes (GPUs) per node
PORT="${PORT:-29500}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"  # static: NODE_RANK decides each node's ranks
RDZV_ID="${RDZV_ID:-fsdp-lab}"
STRATEGY="${STRATEGY:-HYBRID_SHARD}"  # or FULL_SHARD: shard over every rank of every node
DEVICE="${DEVICE:-cuda}"
PRESET="${PRESET:-369m}"
PRECISION="${PRECISION:-bf16}"
BATCH="${BATCH:-16}"
STEPS="${STEPS:-200}"
EVERY="${EVERY:-50}"
CKPT="${CKPT:-$HOME/fsdp-lab-runs/369m}"
# export NCCL_SOCKET_IFNAME=eth0      # the interface the nodes reach each other on, if NCCL picks a wrong one
mkdir -p "$CKPT"
exec "${FSDP_LAB[@]}" train \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend "$RDZV_BACKEND" --rdzv-id "$RDZV_ID" \
  --rdzv-endpoint "$HEAD:$PORT" --nproc-per-node "$GPUS" \
  --device "$DEVICE" --preset "$PRESET" --mixed-precision "$PRECISION" --strategy "$STRATEGY" --forward-prefetch \
  --global-batch "$BATCH" --steps "$STEPS" --lr 3e-4 --timeout 600 \
  --checkpoint-dir "$CKPT" --checkpoint-every "$EVERY" --resume \
  --json-log "$CKPT.log.jsonl" "$@"
