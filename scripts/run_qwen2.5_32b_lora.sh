#!/usr/bin/env bash
# Recipe: Qwen2.5-32B with LoRA (r=32) on one 8-GPU node: GPUs 0-1 train (TP=1 x PP=2 x VPP=4), GPUs 2-7
# run three SGLang engines (TP=2) that load each version's adapter (docs/design.md "LoRA weight pushes").
# Config: examples/qwen2.5-32b-lora.yaml (the paper's hyper-parameters, staleness 256, 8k context; see its header).
#   MODEL_PATH=/models/X DATA_TRAIN=/data/train.parquet scripts/run_qwen2.5_32b_lora.sh [--dry-run | --rehearse] [key=value ...]
# Environment defaults: MAX_RESTARTS=2 NNODES=1 GPUS_PER_NODE=2 (trainer processes; the engines take
# the other six GPUs); everything else as in scripts/train.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
export NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-2}
# A crashed worker restarts the group, which resumes from its last checkpoint (torchrun --max-restarts).
export MAX_RESTARTS=${MAX_RESTARTS:-2}
exec "$HERE/train.sh" "$REPO/examples/qwen2.5-32b-lora.yaml" "$@"
