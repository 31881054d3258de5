#!/usr/bin/env bash
# Recipe: Qwen3-30B-A3B (MoE), 2 training nodes x 8 GPUs (TP=2 PP=2 DP=4, EP=8 ETP=1); engines on their own node(s).
# Config: examples/qwen3-30b-a3b.yaml (the paper's hyper-parameters, staleness 256; see its header).
# First start the engines + router on each rollout node:
#   MODEL_PATH=/models/X ENGINE_TP=2 scripts/launch_sglang_fleet.sh
# then on every training node r = 0..1:
#   NODE_RANK=r MASTER_ADDR=<node0> ROUTER_ADDR=http://<rollout-node>:29999 MODEL_PATH=/models/X \
#     DATA_TRAIN=/data/train.parquet scripts/run_qwen3_30b_a3b.sh [--dry-run | --rehearse] [key=value ...]
# Environment defaults: MAX_RESTARTS=2 NNODES=2 GPUS_PER_NODE=8; everything else as in scripts/train.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
export NNODES=${NNODES:-2} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# A crashed worker restarts the group, which resumes from its last checkpoint (torchrun --max-restarts).
export MAX_RESTARTS=${MAX_RESTARTS:-2}
exec "$HERE/train.sh" "$REPO/examples/qwen3-30b-a3b.yaml" "$@"
