#!/usr/bin/env bash
# The drift ladder's runs, exactly as registered (PREREGISTRATION.md), resumable: rerun it after a
# reboot or a kill and finished runs are skipped (the harness resumes a run from its checkpoint;
# a finished drift is kept in <run>/drift/drift.json).
#
#   bash docs/measurements/drift_ladder/run_ladder.sh            # from the repository root
#
# OUT       where the runs go (default runs/drift_ladder; checkpoints included, large). The runs so
#           far used OUT=/work/runs/drift_ladder: a finished run is recognised by its settings,
#           its run directory's absolute path among them, so continue with the same OUT.
# HARVEST   where each finished piece's small files are copied (default
#           docs/measurements/drift_ladder/results): of each finished run metrics.jsonl (gzipped),
#           config.yaml, config.json, experiment_done.json; each experiment.json and drift.json.
#           Those are what the report is built from, so they are committed as they come in and
#           nothing measured is lost with the machine.
set -euo pipefail
OUT=${OUT:-runs/drift_ladder}
HARVEST=${HARVEST:-docs/measurements/drift_ladder/results}
M2PO=${M2PO:-m2po}
COMMON=(examples/staleness_tiny.yaml optim.lr=5e-5 trainer.num_steps=256)

# shellcheck source=../harvest.sh
source "$(dirname "${BASH_SOURCE[0]}")/../harvest.sh"

restore() {
  # A new machine: every run and drift finished (and harvested) before is put back under $OUT as the
  # harness recognises a finished run (experiment_done.json with its metrics and configs), so it is
  # skipped, never run again; the checkpoints are not needed once a run's drift is measured.
  [ -d "$HARVEST" ] || return 0
  (cd "$HARVEST" && find . \( -name experiment_done.json -o -path '*/drift/drift.json' -o -name experiment.json \) \
      -print0) |
    while IFS= read -r -d '' f; do
      d=$(dirname "$f")
      [ -e "$OUT/$f" ] && continue
      mkdir -p "$OUT/$d"
      if [ "$(basename "$f")" = experiment_done.json ]; then
        for g in config.yaml config.json; do
          if [ -f "$HARVEST/$d/$g" ]; then cp -p "$HARVEST/$d/$g" "$OUT/$d/$g"; fi
        done
        gunzip -c "$HARVEST/$d/metrics.jsonl.gz" > "$OUT/$d/metrics.jsonl"
      fi
      cp -p "$HARVEST/$f" "$OUT/$f"
    done
}

restore
echo "ladder: on-policy arm, 3 seeds ($(date -u +%FT%TZ))"
"$M2PO" experiment staleness "${COMMON[@]}" checkpoint.save_every_steps=2 checkpoint.keep_last=1000 \
    --arms grpo_s0 --seeds 3 --parallel 1 --no-progress --out "$OUT/onpolicy"
harvest
# The drift (the x-axis) needs the on-policy checkpoints: measured before anything else so that a
# lost machine loses no measurement that the harvested files do not already hold.
for s in 1234 1235 1236; do
  run="$OUT/onpolicy/grpo_s0/seed_$s"
  if [ ! -f "$run/drift/drift.json" ]; then
    echo "ladder: drift of seed $s ($(date -u +%FT%TZ))"
    "$M2PO" experiment drift "$run" --ks 8,32,128
  fi
  harvest
done
for k in 128 32 8; do
  echo "ladder: k=$k, three stale arms x 3 seeds ($(date -u +%FT%TZ))"
  "$M2PO" experiment staleness "${COMMON[@]}" --arms grpo_sk no_tr_sk m2po_sk --k "$k" \
      --seeds 3 --parallel 1 --no-progress --out "$OUT/k$k"
  harvest
done
# Amendment 1 (PREREGISTRATION.md): the cells the second machine's environment lacks, run there into
# reruns/ (same layout). Only on that environment: elsewhere they would start a third one.
here=$(python -c "from megatron_m2po.experiment.environment import weights_fingerprint as f; \
from megatron_m2po.config import load_config; from megatron_m2po.utils.hf_dir import resolve_model_path as r; \
print(f(r(load_config('examples/staleness_tiny.yaml', []).model)))")
if [ "$here" != "${LADDER_ENV:-393e5f0e33d61620}" ]; then
  echo "ladder: this machine's tiny base is $here, not the ladder's environment ${LADDER_ENV:-393e5f0e33d61620}: the reruns of Amendment 1 need that one"
  exit 0
fi
echo "ladder: Amendment 1, on-policy again in this environment ($(date -u +%FT%TZ))"
"$M2PO" experiment staleness "${COMMON[@]}" checkpoint.save_every_steps=2 checkpoint.keep_last=1000 \
    --arms grpo_s0 --seeds 3 --parallel 1 --no-progress --out "$OUT/reruns/onpolicy"
harvest
for s in 1234 1235 1236; do
  run="$OUT/reruns/onpolicy/grpo_s0/seed_$s"
  if [ ! -f "$run/drift/drift.json" ]; then
    echo "ladder: drift of seed $s in this environment ($(date -u +%FT%TZ))"
    "$M2PO" experiment drift "$run" --ks 8,32,128
  fi
  harvest
done
echo "ladder: Amendment 1, k=32 GRPO and no trust region ($(date -u +%FT%TZ))"
# (no trust region lacks seed 1234 here; the harness runs an arm's seeds together, and the report uses
# the first run of a seed it finds in this environment: the original 1235 and 1236, not their reruns)
"$M2PO" experiment staleness "${COMMON[@]}" --arms grpo_sk no_tr_sk --k 32 --seeds 3 --parallel 1 --no-progress \
    --out "$OUT/reruns/k32"
harvest
echo "ladder: Amendment 1, k=128 ($(date -u +%FT%TZ))"
"$M2PO" experiment staleness "${COMMON[@]}" --arms grpo_sk no_tr_sk m2po_sk --k 128 --seeds 3 --parallel 1 \
    --no-progress --out "$OUT/reruns/k128"
harvest
echo "ladder: done ($(date -u +%FT%TZ))"
