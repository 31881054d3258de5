#!/usr/bin/env bash
# Start SGLang engines (one per ENGINE_TP GPUs) and an sglang-router on a rollout node.
#
#   MODEL_PATH=/models/Qwen2.5-32B ENGINE_TP=4 scripts/launch_sglang_fleet.sh [--dry-run] [extra sglang args]
#
# The trainer then attaches with rollout.launcher=external rollout.router_addr=http://<this-node>:ROUTER_PORT
# (or rollout.external_addrs=<engine urls> when ROUTER=0). Engines on further rollout nodes: run this
# there with ROUTER=0 and list their URLs in EXTRA_WORKER_URLS here.
# Environment (defaults): MODEL_PATH (required), GPUS (all visible, e.g. "0,1,2,3,4,5,6,7"),
# ENGINE_TP (1), NUM_ENGINES (#GPUS / ENGINE_TP), BASE_PORT (30000; engine i listens on BASE_PORT+i),
# ROUTER (1), ROUTER_PORT (BASE_PORT-1, as rollout.base_port assumes), HOST (0.0.0.0, bind address),
# ADVERTISE_HOST (`hostname -f`: how the router and trainer reach the engines), MEM_FRACTION (0.85,
# SGLang --mem-fraction-static), EXTRA_WORKER_URLS (""), LOG_DIR (./sglang_logs), PYTHON (python3, runs the router),
# ENGINE_PYTHON ($SGLANG_PYTHON, else PYTHON: runs the engines).
# ENGINE (sglang): cpu_worker starts `PYTHON -m megatron_m2po.standins.cpu_worker` (the CPU emulation of
# an SGLang server, this package) instead, on no GPU (GPUS is ignored; NUM_ENGINES defaults to 1,
# ENGINE_TP must be 1): the CPU rehearsal of a recipe (run_*.sh --rehearse) uses it.
# PROMETHEUS_PORT (the router's default): the router's metrics port.
# Router health checks: ROUTER_MAX_PAUSE_S (600): the longest an engine stays paused by a weight update
# (at least the trainer's rollout.weight_sync_timeout_s, 300 by default; a 32B disk load takes minutes), ROUTER_HEALTH_INTERVAL_S
# (30), ROUTER_HEALTH_TIMEOUT_S (25, above SGLang's 20 s SGLANG_HEALTH_CHECK_TIMEOUT). A paused engine
# fails /health (503 after 20 s), and sglang-router 0.3.2 stops routing to a worker after
# --health-failure-threshold failed checks in a row (default 3 x 60 s); the threshold here is
# (ROUTER_MAX_PAUSE_S + timeout) / interval + 2, so a pause never costs an engine (the same rule as
# megatron_m2po.rollout.engines.router_health_flags for the router the trainer starts).
# Engines start at --weight-version 0 (the base model; SGLang's own default tag, "default", is no
# version the trainer can count from).
# Arguments after the options are appended to every engine command line. --dry-run prints the
# commands and checks the GPU/port arithmetic without starting anything.
# Engines and the router get an explicit environment: this shell's, without a trainer's or
# torchrun's variables (RANK, WORLD_SIZE, LOCAL_*, GROUP_*, ROLE_*, MASTER_ADDR/PORT, TORCHELASTIC_*,
# TORCH_NCCL_*, NCCL_ASYNC_ERROR_HANDLING, NCCL_BLOCKING_WAIT, CUDA_DEVICE_MAX_CONNECTIONS,
# PYTORCH_CUDA_ALLOC_CONF, OMP_NUM_THREADS; CUDA_VISIBLE_DEVICES is set per engine). With
# TORCHELASTIC_USE_AGENT_STORE=True an SGLang engine's own torch.distributed init waits on a store
# nobody hosts. The same set as rollout/launcher.py engine_env (tests/test_scripts.py compares them).
set -euo pipefail
die() { echo "launch_sglang_fleet.sh: $*" >&2; exit 2; }

dry_run=0
extra=()
for a in "$@"; do
  if [ "$a" = --dry-run ]; then dry_run=1; else extra+=("$a"); fi
done

PYTHON=${PYTHON:-python3}
ENGINE_PYTHON=${ENGINE_PYTHON:-${SGLANG_PYTHON:-$PYTHON}}   # the image sets SGLANG_PYTHON=/opt/sglang/bin/python
[ -n "${MODEL_PATH:-}" ] || die "set MODEL_PATH to the HF model directory the engines serve"
ENGINE=${ENGINE:-sglang}
case "$ENGINE" in
  sglang) ;;
  cpu_worker)
    [ "${ENGINE_TP:-1}" = 1 ] || die "ENGINE=cpu_worker runs one process per engine: ENGINE_TP must be 1"
    NUM_ENGINES=${NUM_ENGINES:-1}
    GPUS=$(seq -s, 0 $((NUM_ENGINES - 1)))   # placeholders: CPU workers use no GPU
    ;;
  *) die "ENGINE=$ENGINE: use sglang or cpu_worker" ;;
esac
if [ -z "${GPUS:-}" ]; then
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${n:-0}" -ge 1 ] 2>/dev/null || n=8
  GPUS=$(seq -s, 0 $((n - 1)))
fi
IFS=', ' read -r -a gpu_list <<<"$GPUS"
ENGINE_TP=${ENGINE_TP:-1}
[[ "$ENGINE_TP" =~ ^[1-9][0-9]*$ ]] || die "ENGINE_TP=$ENGINE_TP must be a positive integer"
NUM_ENGINES=${NUM_ENGINES:-$(( ${#gpu_list[@]} / ENGINE_TP ))}
BASE_PORT=${BASE_PORT:-30000}
ROUTER=${ROUTER:-1}
ROUTER_PORT=${ROUTER_PORT:-$((BASE_PORT - 1))}
HOST=${HOST:-0.0.0.0}
ADVERTISE_HOST=${ADVERTISE_HOST:-$(hostname -f 2>/dev/null || hostname)}
MEM_FRACTION=${MEM_FRACTION:-0.85}
LOG_DIR=${LOG_DIR:-sglang_logs}

[[ "$NUM_ENGINES" =~ ^[0-9]+$ ]] && [ "$NUM_ENGINES" -ge 1 ] || die "NUM_ENGINES=$NUM_ENGINES must be >= 1 (GPUS=$GPUS, ENGINE_TP=$ENGINE_TP)"
need=$((NUM_ENGINES * ENGINE_TP))
[ "$need" -le "${#gpu_list[@]}" ] || die "NUM_ENGINES*ENGINE_TP = $NUM_ENGINES*$ENGINE_TP = $need GPUs but GPUS lists ${#gpu_list[@]} ($GPUS)"
for g in "${gpu_list[@]}"; do [[ "$g" =~ ^[0-9]+$ ]] || die "GPUS=$GPUS must be comma-separated GPU indices"; done
[[ "$BASE_PORT" =~ ^[0-9]+$ ]] && [ "$BASE_PORT" -ge 1024 ] && [ $((BASE_PORT + NUM_ENGINES)) -le 65535 ] \
  || die "BASE_PORT=$BASE_PORT must leave room for $NUM_ENGINES engine ports in 1024..65535"
if [ "$ROUTER" = 1 ] && [ "$ROUTER_PORT" -ge "$BASE_PORT" ] && [ "$ROUTER_PORT" -lt $((BASE_PORT + NUM_ENGINES)) ]; then
  die "ROUTER_PORT=$ROUTER_PORT collides with the engine ports $BASE_PORT..$((BASE_PORT + NUM_ENGINES - 1))"
fi

# Names to unset for the children (`env -u`): see the header.
drop=()
while read -r name; do
  case "$name" in
    RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE|\
    MASTER_ADDR|MASTER_PORT|CUDA_DEVICE_MAX_CONNECTIONS|PYTORCH_CUDA_ALLOC_CONF|NCCL_ASYNC_ERROR_HANDLING|\
    NCCL_BLOCKING_WAIT|CUDA_VISIBLE_DEVICES|OMP_NUM_THREADS|TORCHELASTIC_*|TORCH_NCCL_*) drop+=("$name") ;;
  esac
done < <(compgen -e | sort)
unset_flags=""
for name in ${drop[@]+"${drop[@]}"}; do unset_flags+=" -u $name"; done

engine_cmds=()
urls=()
for ((i = 0; i < NUM_ENGINES; i++)); do
  ids=$(IFS=,; echo "${gpu_list[*]:$((i * ENGINE_TP)):$ENGINE_TP}")
  port=$((BASE_PORT + i))
  if [ "$ENGINE" = cpu_worker ]; then
    engine_cmds+=("OMP_NUM_THREADS=1 $(printf '%q ' "$PYTHON" -m megatron_m2po.standins.cpu_worker \
      --model-path "$MODEL_PATH" --host "$HOST" --port "$port" --weight-version 0 ${extra[@]+"${extra[@]}"})")
  else
    engine_cmds+=("CUDA_VISIBLE_DEVICES=$ids $(printf '%q ' "$ENGINE_PYTHON" -m sglang.launch_server \
      --model-path "$MODEL_PATH" --tp-size "$ENGINE_TP" --host "$HOST" --port "$port" \
      --mem-fraction-static "$MEM_FRACTION" --weight-version 0 ${extra[@]+"${extra[@]}"})")
  fi
  urls+=("http://$ADVERTISE_HOST:$port")
done
IFS=', ' read -r -a more <<<"${EXTRA_WORKER_URLS:-}"
prom=()
[ -n "${PROMETHEUS_PORT:-}" ] && prom=(--prometheus-port "$PROMETHEUS_PORT")
ROUTER_MAX_PAUSE_S=${ROUTER_MAX_PAUSE_S:-600}
ROUTER_HEALTH_INTERVAL_S=${ROUTER_HEALTH_INTERVAL_S:-30}
ROUTER_HEALTH_TIMEOUT_S=${ROUTER_HEALTH_TIMEOUT_S:-25}
for v in ROUTER_MAX_PAUSE_S ROUTER_HEALTH_INTERVAL_S ROUTER_HEALTH_TIMEOUT_S; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v=${!v} must be a non-negative integer (seconds)"
done
[ "$ROUTER_HEALTH_INTERVAL_S" -ge 1 ] && [ "$ROUTER_HEALTH_TIMEOUT_S" -ge 1 ] \
  || die "ROUTER_HEALTH_INTERVAL_S and ROUTER_HEALTH_TIMEOUT_S must be >= 1"
health=(--health-check-interval-secs "$ROUTER_HEALTH_INTERVAL_S" --health-check-timeout-secs "$ROUTER_HEALTH_TIMEOUT_S"
        --health-failure-threshold $(( (ROUTER_MAX_PAUSE_S + ROUTER_HEALTH_TIMEOUT_S) / ROUTER_HEALTH_INTERVAL_S + 2 )))
router_cmd=$(printf '%q ' "$PYTHON" -m sglang_router.launch_router --host "$HOST" --port "$ROUTER_PORT" \
  ${prom[@]+"${prom[@]}"} "${health[@]}" --worker-urls "${urls[@]}" ${more[@]+"${more[@]}"})

if [ "$dry_run" -eq 1 ]; then
  if [ "$ENGINE" = cpu_worker ]; then echo "# engines ($NUM_ENGINES CPU workers)"
  else echo "# engines ($NUM_ENGINES x TP=$ENGINE_TP on GPUs $GPUS)"; fi
  echo "# not passed to engines and router:${drop[*]+ ${drop[*]}}"
  printf '%s\n' "${engine_cmds[@]}"
  if [ "$ROUTER" = 1 ]; then
    echo "# router"; echo "$router_cmd"
    echo "# trainer: rollout.launcher=external rollout.router_addr=http://$ADVERTISE_HOST:$ROUTER_PORT"
  else
    echo "# no router here; add to EXTRA_WORKER_URLS on the router node: ${urls[*]}"
  fi
  exit 0
fi

mkdir -p "$LOG_DIR"
pids=()
# shellcheck disable=SC2329  # invoked by the trap
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for ((i = 0; i < NUM_ENGINES; i++)); do
  echo "starting engine $i: ${engine_cmds[$i]}"
  bash -c "exec env$unset_flags ${engine_cmds[$i]}" >"$LOG_DIR/engine_$i.log" 2>&1 &
  pids+=($!)
done
if [ "$ROUTER" = 1 ]; then
  echo "starting router: $router_cmd"
  bash -c "exec env$unset_flags $router_cmd" >"$LOG_DIR/router.log" 2>&1 &
  pids+=($!)
fi
echo "fleet up (logs in $LOG_DIR); Ctrl-C stops it"
wait -n "${pids[@]}" || true
echo "a fleet process exited; stopping the rest (see $LOG_DIR)" >&2
exit 1
