#!/usr/bin/env bash
# The distillation comparison's runs, exactly as registered (PREREGISTRATION.md), resumable: rerun it
# and finished runs are skipped (the harness resumes a run from its checkpoint).
#
#   OUT=/work/runs/distill_tiny LADDER=/work/runs/drift_ladder bash docs/measurements/distill_tiny/run.sh
#
# OUT      where the runs go (default runs/distill_tiny; checkpoints included, large)
# LADDER   the drift ladder's run directory (its on-policy grpo_s0 seed 1234 is the pre-flight's reference)
# HARVEST  where each finished run's small files are copied (default docs/measurements/distill_tiny/results)
set -euo pipefail
OUT=${OUT:-runs/distill_tiny}
LADDER=${LADDER:-runs/drift_ladder}
HARVEST=${HARVEST:-docs/measurements/distill_tiny/results}
M2PO=${M2PO:-m2po}
COMMON=(examples/staleness_tiny.yaml optim.lr=5e-5 trainer.num_steps=256)

# shellcheck source=../harvest.sh
source "$(dirname "${BASH_SOURCE[0]}")/../harvest.sh"

echo "distill: pre-flight, grpo_s0 seed 1234, 8 steps from this commit ($(date -u +%FT%TZ))"
"$M2PO" experiment staleness "${COMMON[@]}" trainer.num_steps=8 --arms grpo_s0 --seeds 1 --parallel 1 \
    --no-progress --out "$OUT/preflight"
python - "$OUT/preflight/grpo_s0/metrics.jsonl" "$LADDER/onpolicy/grpo_s0/seed_1234/metrics.jsonl" \
    > "$OUT/preflight/verdict.txt" <<'PY'
import json, sys
keys = ("update/policy/kl_k3", "update/loss/total", "update/optim/grad_norm")
def updates(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        if any(k in r for k in keys):
            out[r["step"]] = [r.get(k) for k in keys]
    return out
a, b = updates(sys.argv[1]), updates(sys.argv[2])
steps = sorted(a)[:32]
# equal within 1e-6 relative, or 1e-9 absolute (kl_k3 of an on-policy update is ~1e-10)
worst = max(abs(x - y) / max(abs(y), 1e-3) for s in steps for x, y in zip(a[s], b[s]))
ok = len(steps) == 32 and all(s in b for s in steps) and worst <= 1e-6
print(f"updates compared: {len(steps)}; largest relative difference: {worst:.3g}; "
      f"controls: {'the ladder runs' if ok else 'rerun from this commit'}")
PY
cat "$OUT/preflight/verdict.txt"
harvest
arms0=(grpo_distill_s0) armsk=(m2po_distill_sk)
if grep -q "rerun from this commit" "$OUT/preflight/verdict.txt"; then arms0+=(grpo_s0); armsk+=(m2po_sk); fi
echo "distill: k=0 ($(date -u +%FT%TZ))"
"$M2PO" experiment staleness "${COMMON[@]}" --arms "${arms0[@]}" --seeds 3 --parallel 1 --no-progress --out "$OUT/k0"
harvest
echo "distill: k=32 ($(date -u +%FT%TZ))"
"$M2PO" experiment staleness "${COMMON[@]}" --arms "${armsk[@]}" --k 32 --seeds 3 --parallel 1 --no-progress \
    --out "$OUT/k32"
harvest
echo "distill: done ($(date -u +%FT%TZ))"
