#!/usr/bin/env bash
# Recipe: Qwen2.5-Math-7B colocated on one 8-GPU node: every GPU trains (TP=2 x DP=4) and runs an SGLang
# engine (TP=1), time-shared (rollout.colocate=true, docs/design.md "Colocated mode").
# Config: examples/qwen2.5-math-7b-colocated.yaml (the paper's hyper-parameters, staleness 256; see its header).
#   MODEL_PATH=/models/X DATA_TRAIN=/data/train.parquet scripts/run_qwen2.5_math_7b_colocated.sh [--dry-run | --rehearse] [key=value ...]
# Environment defaults: MAX_RESTARTS=2 NNODES=1 GPUS_PER_NODE=8; everything else as in scripts/train.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
export NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# A crashed worker restarts the group, which resumes from its last checkpoint (torchrun --max-restarts).
export MAX_RESTARTS=${MAX_RESTARTS:-2}
exec "$HERE/train.sh" "$REPO/examples/qwen2.5-math-7b-colocated.yaml" "$@"
