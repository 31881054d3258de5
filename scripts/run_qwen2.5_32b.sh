#!/usr/bin/env bash
# Recipe: Qwen2.5-32B, 4 training nodes x 8 GPUs (TP=4 CP=2 PP=2 DP=2); engines on their own node(s).
# Config: examples/qwen2.5-32b.yaml (the paper's hyper-parameters and 16k context, staleness 256; see its header).
# First start the engines + router on each rollout node:
#   MODEL_PATH=/models/X scripts/launch_sglang_fleet.sh
# then on every training node r = 0..3:
#   NODE_RANK=r MASTER_ADDR=<node0> ROUTER_ADDR=http://<rollout-node>:29999 MODEL_PATH=/models/X \
#     DATA_TRAIN=/data/train.parquet scripts/run_qwen2.5_32b.sh [--dry-run | --rehearse] [key=value ...]
# Environment defaults: MAX_RESTARTS=2 NNODES=4 GPUS_PER_NODE=8; everything else as in scripts/train.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
export NNODES=${NNODES:-4} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# A crashed worker restarts the group, which resumes from its last checkpoint (torchrun --max-restarts).
export MAX_RESTARTS=${MAX_RESTARTS:-2}
exec "$HERE/train.sh" "$REPO/examples/qwen2.5-32b.yaml" "$@"
