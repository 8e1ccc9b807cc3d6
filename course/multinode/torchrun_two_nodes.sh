#!/usr/bin/env bash
# Two GPU nodes, started by hand (or by any scheduler that runs one copy per node). Run the same script on
# both nodes; only NODE_RANK differs:
#
#   node001$ HEAD=node001 NODE_RANK=0 bash course/multinode/torchrun_two_nodes.sh
#   node002$ HEAD=node001 NODE_RANK=1 bash course/multinode/torchrun_two_nodes.sh
#
# fsdp-lab train hands --nnodes/--node-rank/--rdzv-endpoint to torchrun (static rendezvous: node 0 hosts it on
# HEAD:PORT). CKPT must be on a file system both nodes see: every rank writes its own piece of a checkpoint.
# The job ends with exit 3 if a rank dies or a peer stops answering for --timeout seconds, and --resume makes
# a rerun continue from the last complete checkpoint, on any number of nodes.
set -euo pipefail
: "${HEAD:?set HEAD to the host name of node 0}"
: "${NODE_RANK:?set NODE_RANK to 0 on the first node and 1 on the second}"
NNODES="${NNODES:-2}"
GPUS="${GPUS:-8}"                     # processes (GPUs) per node
PORT="${PORT:-29500}"
CKPT="${CKPT:-$HOME/fsdp-lab-runs/369m}"
# export NCCL_SOCKET_IFNAME=eth0      # the interface the nodes reach each other on, if NCCL picks a wrong one
mkdir -p "$CKPT"
exec fsdp-lab train \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-endpoint "$HEAD:$PORT" --nproc-per-node "$GPUS" \
  --device cuda --preset 369m --mixed-precision bf16 --forward-prefetch \
  --global-batch 16 --steps 200 --lr 3e-4 --timeout 600 \
  --checkpoint-dir "$CKPT" --checkpoint-every 50 --resume \
  --json-log "$CKPT.log.jsonl"
