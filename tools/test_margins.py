"""Measure the distribution behind a stochastic test's threshold.

A stochastic assertion (reward rises, M2PO masks less than GRPO clips, ...) needs a threshold
set from the spread of the asserted quantity over many seeds, and a check that a broken learner
still fails it. This tool runs the exact `m2po train` command a test runs, once per seed, and
prints the per-seed values, mean, standard deviation and the threshold ``mean - z * std``
(z = 3.3: a false failure rarer than 1 in 2,000 for a normal spread), for the healthy learner
and for a broken one (learning rate ~0).

    python tools/test_margins.py reward_rise --seeds 1-24 --jobs 2 --out runs/margins/reward_rise.json
    python tools/test_margins.py reward_rise --seeds 1-8 --variant lr0

The test module (``tests/trainer/test_e2e_tiny.py``) owns the command (``RISE_OVERRIDES``) and
the statistic (``rise_statistic``); this tool imports both, so the measured numbers and the
test can never disagree about what is measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Z = 3.3

# Broken learners the threshold must reject.
VARIANTS = {
    "healthy": [],
    "lr0": ["optim.lr=1e-12"],  # the config refuses 0; Adam's step is then ~1e-12
}


def _test_module():
    path = ROOT / "tests" / "trainer" / "test_e2e_tiny.py"
    spec = importlib.util.spec_from_file_location("m2po_test_e2e_tiny", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def _run_one(mod, seed: int, extra: list[str], workdir: Path) -> dict:
    run = workdir / f"seed{seed}"
    cmd = [sys.executable, "-m", "megatron_m2po.cli", "train", str(mod.EXAMPLE), f"trainer.run_dir={run}",
           *mod.SHORT, *mod.RISE_OVERRIDES, f"trainer.seed={seed}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"seed": seed, "error": (proc.stdout + proc.stderr)[-2000:]}
    records = mod._records(run)
    acc = [r["rollout/acc"] for r in records if "rollout/acc" in r]
    return {"seed": seed, "value": mod.rise_statistic(acc), "acc": acc, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("test", choices=["reward_rise"], help="which stochastic test to measure")
    p.add_argument("--seeds", default="1-24", help="seeds, e.g. 1-24 or 1,5,9 (default 1-24)")
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                   help="learner variant(s) to run (default: healthy, lr0)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (each uses ~2 cores at peak)")
    p.add_argument("--out", type=Path, help="write every per-seed value here (JSON)")
    args = p.parse_args(argv)
    mod = _test_module()
    seeds = _seeds(args.seeds)
    report: dict = {"test": args.test, "overrides": [*mod.SHORT, *mod.RISE_OVERRIDES], "z": Z, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="m2po-margins-") as tmp:
        for variant in args.variant or ["healthy", "lr0"]:
            work = Path(tmp) / variant
            work.mkdir()
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                futs = [pool.submit(_run_one, mod, s, VARIANTS[variant], work) for s in seeds]
                rows = []
                for f in concurrent.futures.as_completed(futs):
                    row = f.result()
                    rows.append(row)
                    shown = f"{row['value']:+.4f}" if "value" in row else "FAILED: " + row["error"][-300:]
                    print(f"[{variant}] seed {row['seed']:>3}: {shown}", flush=True)
            vals = [r["value"] for r in rows if "value" in r]
            summary = {"runs": len(vals), "failed_runs": len(rows) - len(vals)}
            if len(vals) >= 2:
                mean, sd = statistics.fmean(vals), statistics.stdev(vals)
                summary.update(mean=mean, std=sd, min=min(vals), max=max(vals), threshold=mean - Z * sd,
                               below_test_threshold=sum(v <= mod.RISE_THRESHOLD for v in vals))
            report["variants"][variant] = {"summary": summary, "rows": sorted(rows, key=lambda r: r["seed"])}
    print(f"\n{'variant':<10} {'runs':>5} {'mean':>8} {'std':>7} {'min':>8} {'max':>8} "
          f"{'mean-3.3sd':>10} {'<= test thr':>11}")
    for variant, v in report["variants"].items():
        s = v["summary"]
        if "mean" in s:
            print(f"{variant:<10} {s['runs']:>5} {s['mean']:>+8.4f} {s['std']:>7.4f} {s['min']:>+8.4f} "
                  f"{s['max']:>+8.4f} {s['threshold']:>+10.4f} {s['below_test_threshold']:>11}")
    print(f"test threshold: {mod.RISE_THRESHOLD:+.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"per-seed values: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
