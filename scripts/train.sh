#!/usr/bin/env bash
# Launch `m2po train` with torchrun on this node; run the same command on every training node.
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 scripts/train.sh CONFIG.yaml [key=value ...]
#   scripts/train.sh --dry-run CONFIG.yaml [key=value ...]   # print + validate, launch nothing
#   scripts/train.sh --exec CMD [ARGS ...]   # CMD in the trainer's environment below (tools/gpu_check.py uses it)
#   scripts/train.sh CONFIG.yaml --rehearse [options]   # the recipe end to end on this CPU machine: 2 simulated
#       nodes x 2 processes through this script, CPU engines behind the router, a node SIGKILLed and resumed
#       (python -m megatron_m2po.rehearsal --help; every scripts/run_*.sh passes --rehearse here)
#
# Environment (defaults): NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1; required when
# NNODES > 1), MASTER_PORT (29500), GPUS_PER_NODE (trainer processes per node: all visible GPUs,
# 1 without a GPU), PYTHON (the repo's .venv python if present, else python3), TORCHRUN (torchrun
# next to PYTHON, else `torchrun`), MAX_RESTARTS (0: torchrun restarts the group of workers up to
# this many times after a worker dies, each restart resuming from the last checkpoint by itself;
# above 0 the nodes meet through torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT, which a
# restart needs: the static one cannot re-form the group). Convenience overrides, appended after the arguments (so they
# win): MODEL_PATH -> model.hf_path, DATA_TRAIN -> data.train, ROUTER_ADDR -> rollout.router_addr,
# RUN_DIR -> trainer.run_dir. Arguments starting with "-" go to `m2po train` only; the config file
# and key=value overrides also go to `m2po config` / `m2po plan` in --dry-run.
#
# Trainer-only environment (set here, not image-wide, so SGLang engines never inherit it; an
# existing value wins): CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's TP / sequence-parallel
# communication overlap needs kernels queued in issue order), PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True (less fragmentation with variable-length RL batches),
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torchrun's own default too: a failed or timed-out collective of the
# training groups ends the process instead of hanging it; the weight-update groups to the engines are
# built with 2, so a push to a dead engine raises and the trainer relaunches it: parallel/side_group.py,
# docs/sglang.md). Network: IFNAME=<interface> sets NCCL_SOCKET_IFNAME and
# GLOO_SOCKET_IFNAME (the interface the nodes reach each other on); every other NCCL_* / GLOO_* /
# UCX_* variable you export (NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_DEBUG, ...) passes through to
# every trainer process unchanged, as torchrun inherits the environment.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
if [ -z "${TORCHRUN:-}" ]; then
  TORCHRUN=torchrun
  [ -x "$(dirname "$PYTHON")/torchrun" ] && TORCHRUN="$(dirname "$PYTHON")/torchrun"
fi
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${GPUS_PER_NODE:-0}" -ge 1 ] 2>/dev/null || GPUS_PER_NODE=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}
# torchrun restarts (below): workers get a fresh store per round, not the agent's shared one, on which a
# restarted group reads the dead group's keys (gloo / NCCL peer addresses) and cannot connect (pytorch#135712).
if [ "$MAX_RESTARTS" != 0 ]; then export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}; fi

die() { echo "train.sh: $*" >&2; exit 2; }

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# One NCCL (docker/install.sh): the image names the engines' libnccl.so.2; the trainer's processes
# preload it, so a distributed weight push joins one NCCL build on both sides.
if [ -n "${M2PO_NCCL_PRELOAD:-}" ]; then
  [ -e "$M2PO_NCCL_PRELOAD" ] || die "M2PO_NCCL_PRELOAD=$M2PO_NCCL_PRELOAD does not exist (docker/install.sh links it)"
  case ":${LD_PRELOAD:-}:" in
    *":$M2PO_NCCL_PRELOAD:"*) ;;
    *) export LD_PRELOAD="$M2PO_NCCL_PRELOAD${LD_PRELOAD:+:$LD_PRELOAD}" ;;
  esac
fi
if [ -n "${IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$IFNAME}
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$IFNAME}
fi
export M2PO_TRAINER_ENV=1  # what runs below knows it has the trainer's environment
if [ "${1:-}" = --exec ]; then
  shift
  [ "$#" -ge 1 ] || die "--exec needs a command"
  exec "$@"
fi
for v in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE MAX_RESTARTS; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v=${!v} must be a non-negative integer"
done
[ "$NNODES" -ge 1 ] || die "NNODES=$NNODES must be >= 1"
[ "$GPUS_PER_NODE" -ge 1 ] || die "GPUS_PER_NODE=$GPUS_PER_NODE must be >= 1"
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK must be < NNODES=$NNODES"

for a in "$@"; do
  if [ "$a" = --rehearse ]; then
    rest=()
    for b in "$@"; do [ "$b" = --rehearse ] || rest+=("$b"); done
    exec "$PYTHON" -m megatron_m2po.rehearsal ${rest[@]+"${rest[@]}"}
  fi
done

dry_run=0
train_args=()   # everything for `m2po train`
cfg_args=()     # config file + key=value overrides (for `m2po config` / `m2po plan`)
[ -n "${MODEL_PATH:-}" ] && set -- "$@" "model.hf_path=$MODEL_PATH"
[ -n "${DATA_TRAIN:-}" ] && set -- "$@" "data.train=$DATA_TRAIN"
[ -n "${ROUTER_ADDR:-}" ] && set -- "$@" "rollout.router_addr=$ROUTER_ADDR"
[ -n "${RUN_DIR:-}" ] && set -- "$@" "trainer.run_dir=$RUN_DIR"
for a in "$@"; do
  case "$a" in
    --dry-run) dry_run=1 ;;
    -*) train_args+=("$a") ;;
    *) train_args+=("$a"); cfg_args+=("$a") ;;
  esac
done

if [ -z "${MASTER_ADDR:-}" ]; then
  if [ "$NNODES" -gt 1 ] && [ "$dry_run" -eq 0 ]; then
    die "NNODES=$NNODES needs MASTER_ADDR (the address of node 0, reachable from every node)"
  fi
  MASTER_ADDR=127.0.0.1
  [ "$NNODES" -gt 1 ] && MASTER_ADDR='<node0-address>'
fi

torchrun_cmd() {  # $1 = node rank
  local cmd=("$TORCHRUN" --nnodes "$NNODES" --node-rank "$1" --nproc-per-node "$GPUS_PER_NODE")
  if [ "$MAX_RESTARTS" -gt 0 ]; then
    # torchrun's fault-tolerant launch (its docs): a c10d rendezvous re-forms the group after a worker dies.
    cmd+=(--max-restarts "$MAX_RESTARTS" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
          --rdzv-id "${RDZV_ID:-m2po-$MASTER_PORT}")
  else
    cmd+=(--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
  fi
  cmd+=(-m megatron_m2po.cli train)
  printf '%s\n' "${cmd[@]}" ${train_args[@]+"${train_args[@]}"}
}

if [ "$dry_run" -eq 1 ]; then
  echo "# resolved config"
  "$PYTHON" -m megatron_m2po.cli config ${cfg_args[@]+"${cfg_args[@]}"} || exit $?
  echo "# trainer environment"
  env | grep -E '^(CUDA_DEVICE_MAX_CONNECTIONS|PYTORCH_CUDA_ALLOC_CONF|TORCH_NCCL_|NCCL_|GLOO_|UCX_)' | sort || true
  echo "# commands (one per training node; run each on its node)"
  [ "$MASTER_ADDR" = '<node0-address>' ] && echo "# note: set MASTER_ADDR to node 0's address before launching"
  for ((r = 0; r < NNODES; r++)); do
    mapfile -t c < <(torchrun_cmd "$r")
    echo "node $r: $(printf '%q ' "${c[@]}")"
  done
  echo "# plan"
  exec "$PYTHON" -m megatron_m2po.cli plan --nnodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" \
    ${cfg_args[@]+"${cfg_args[@]}"}
fi

mapfile -t c < <(torchrun_cmd "$NODE_RANK")
exec "${c[@]}"
