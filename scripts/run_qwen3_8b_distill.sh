#!/usr/bin/env bash
# Recipe: Qwen3-8B distilled on-policy from Qwen3-32B (algo.distill) with M2PO, one 8-GPU node: GPUs 0-3
# train (the teacher host-resident between its passes), 4-7 run the engines.
# Config: examples/qwen3-8b-distill.yaml (examples/qwen3-8b.yaml plus the teacher; see its header).
#   MODEL_PATH=/models/X DATA_TRAIN=/data/train.parquet scripts/run_qwen3_8b_distill.sh [--dry-run | --rehearse] [key=value ...]
# Environment defaults: MAX_RESTARTS=2 NNODES=1 GPUS_PER_NODE=4; everything else as in scripts/train.sh.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
export NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-4}
# A crashed worker restarts the group, which resumes from its last checkpoint (torchrun --max-restarts).
export MAX_RESTARTS=${MAX_RESTARTS:-2}
exec "$HERE/train.sh" "$REPO/examples/qwen3-8b-distill.yaml" "$@"
