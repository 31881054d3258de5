"""Measure the distribution behind a stochastic test's threshold.

A stochastic assertion (reward rises, M2PO masks less than GRPO clips, the tiny base lands in
its accuracy band) needs a threshold set from the spread of the asserted quantity over many
seeds, and a check that a broken learner still fails it. This tool runs the exact command a
test runs, once per seed, and prints per quantity: mean, standard deviation, min, max, the
3.3-sigma bound (a false failure rarer than 1 in 2,000 for a normal spread) and how many runs
the test's own threshold would fail; then the same for broken variants.

    python tools/test_margins.py reward_rise --seeds 1-24 --jobs 2 --out runs/margins/reward_rise.json
    python tools/test_margins.py reward_rise --seeds 1-20 --variant lr0        # a learner that cannot learn
    python tools/test_margins.py staleness_fast --seeds 1-20 --jobs 1
    python tools/test_margins.py tiny_base --seeds 0-19 --jobs 2               # base accuracy over build seeds

The test modules own the commands and the statistics (``tests/trainer/test_e2e_tiny.py``:
``RISE_OVERRIDES``, ``rise_statistic``, ``RISE_THRESHOLD``; ``tests/test_experiment.py``:
``fast_experiment_command``, ``fast_experiment_statistics``, ``FAST_*``); this tool imports
them, so the measured numbers and the test cannot disagree about what is measured.
``--set KEY=VALUE`` appends an override, to explore a setting before changing a test.
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
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests" / "trainer"), os.environ.get("PYTHONPATH")]))}


def _module(rel: str):
    sys.path.insert(0, str(ROOT / "tests"))  # the test helpers (waiting.py), as pytest's rootdir conftest does
    path = ROOT / rel
    spec = importlib.util.spec_from_file_location("m2po_margins_" + path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def _fail(seed: int, proc: subprocess.CompletedProcess) -> dict:
    return {"seed": seed, "error": (proc.stdout + proc.stderr)[-2000:]}


# ------------------------------------------------------------------------------------ tests
class RewardRise:
    """tests/trainer/test_e2e_tiny.py::test_reward_rises_on_the_synthetic_task."""

    variants = {"healthy": [],
                "lr0": ["optim.lr=1e-12"],  # the config refuses 0; Adam then steps ~1e-12
                # advantages of the wrong sign (tests/trainer/broken_learners.py)
                "flipped": ["algo.plugins=broken_learners", "algo.loss=flipped_pg"]}
    default_variants = ["healthy", "lr0", "flipped"]

    def __init__(self) -> None:
        self.mod = _module("tests/trainer/test_e2e_tiny.py")
        self.bounds = {"rise": (">", self.mod.RISE_THRESHOLD), "gain": (">", self.mod.GAIN_THRESHOLD)}
        from megatron_m2po.standins.tiny_base import ensure_tiny_base

        self.base = ensure_tiny_base(os.path.expanduser("~/.cache/megatron_m2po/tiny_base"), progress=False)
        self.base_acc = self.mod.expected_accuracy(self.base)

    def run(self, seed: int, extra: list[str], work: Path) -> dict:
        run = work / f"seed{seed}"
        m = self.mod
        cmd = [sys.executable, "-m", "megatron_m2po.cli", "train", str(m.EXAMPLE), f"trainer.run_dir={run}",
               *m.SHORT, *m.RISE_OVERRIDES, f"trainer.seed={seed}", *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
        if proc.returncode != 0:
            return _fail(seed, proc)
        acc = [r["rollout/acc"] for r in m._records(run) if "rollout/acc" in r]
        gain = m.expected_accuracy(run / "final_hf", self.base) - self.base_acc
        return {"seed": seed, "values": {"rise": m.rise_statistic(acc), "gain": gain}, "acc": acc}


class StalenessFast:
    """tests/test_experiment.py::test_fast_experiment_m2po_masks_far_less_than_grpo_clips_and_does_not_collapse."""

    # A broken M2PO: a threshold 400x too tight masks most trust-region tokens.
    variants = {"healthy": [], "tight": ["algo.m2po.threshold=1e-4"]}
    default_variants = ["healthy"]

    def __init__(self) -> None:
        self.mod = _module("tests/test_experiment.py")
        m = self.mod
        self.bounds = {"clip": (">", m.FAST_MIN_CLIP), "ratio": ("<", m.FAST_MAX_RATIO),
                       "late_minus_base": (">=", m.FAST_MIN_LATE_MINUS_BASE)}

    def run(self, seed: int, extra: list[str], work: Path) -> dict:
        out = work / f"seed{seed}"
        cmd = self.mod.fast_experiment_command(out, seed)
        at = cmd.index(self.mod.CONFIG) + 1  # overrides go right after the config
        cmd[at:at] = extra
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
        if proc.returncode != 0:
            return _fail(seed, proc)
        st = self.mod.fast_experiment_statistics(out)
        return {"seed": seed, "values": {k: st[k] for k in ("clip", "mask", "ratio", "late_minus_base")}}


class TinyBase:
    """tests/standins/test_tiny_base.py::test_default_build_accuracy_and_reward: base accuracy per build seed."""

    variants = {"healthy": []}
    default_variants = ["healthy"]

    def __init__(self) -> None:
        self.mod = _module("tests/standins/test_tiny_base.py")
        self.bounds = {"base_accuracy_t1": ("in", self.mod.BASE_BAND)}

    def run(self, seed: int, extra: list[str], work: Path) -> dict:
        code = ("import json, sys; from megatron_m2po.standins.tiny_base import ensure_tiny_base, load_tiny_meta; "
                "m = load_tiny_meta(ensure_tiny_base(sys.argv[1], seed=int(sys.argv[2]), progress=False)); "
                "print(json.dumps({k: m[k] for k in ('base_accuracy_t1', 'steps', 'model_sha256')}))")
        proc = subprocess.run([sys.executable, "-c", code, str(work / f"seed{seed}"), str(seed)], cwd=ROOT,
                              env=ENV, capture_output=True, text=True)
        if proc.returncode != 0:
            return _fail(seed, proc)
        meta = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"seed": seed, "values": {"base_accuracy_t1": meta["base_accuracy_t1"]},
                "steps": meta["steps"], "model_sha256": meta["model_sha256"]}


TESTS = {"reward_rise": RewardRise, "staleness_fast": StalenessFast, "tiny_base": TinyBase}


def _fails(value: float, bound: tuple) -> bool:
    op, thr = bound
    if op == "in":
        return not thr[0] <= value <= thr[1]
    return not {">": value > thr, ">=": value >= thr, "<": value < thr}[op]


def summarize(rows: list[dict], bounds: dict) -> dict:
    out = {}
    keys = sorted({k for r in rows for k in r.get("values", {})})
    for key in keys:
        vals = [r["values"][key] for r in rows if "values" in r]
        s = {"runs": len(vals), "mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}
        s["std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        s["mean-3.3sd"], s["mean+3.3sd"] = s["mean"] - Z * s["std"], s["mean"] + Z * s["std"]
        if key in bounds:
            s["test_bound"] = bounds[key]
            s["fail_test"] = sum(_fails(v, bounds[key]) for v in vals)
        out[key] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("test", choices=sorted(TESTS), help="which stochastic test to measure")
    p.add_argument("--seeds", default="1-20", help="seeds, e.g. 1-20 or 1,5,9 (default 1-20)")
    p.add_argument("--variant", action="append", help="variant(s) to run (default: the test's)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel")
    p.add_argument("--out", type=Path, help="write every per-seed value here (JSON)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override after the test's own (to explore a setting before changing the test)")
    args = p.parse_args(argv)
    test = TESTS[args.test]()
    variants = args.variant or test.default_variants
    unknown = [v for v in variants if v not in test.variants]
    if unknown:
        p.error(f"unknown variant(s) {unknown} for {args.test}; known: {sorted(test.variants)}")
    report: dict = {"test": args.test, "set": args.set, "z": Z, "variants": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="m2po-margins-") as tmp:
        for variant in variants:
            work = Path(tmp) / variant
            work.mkdir()
            extra = [*args.set, *test.variants[variant]]
            rows = []
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                for f in concurrent.futures.as_completed([pool.submit(test.run, s, extra, work)
                                                          for s in _seeds(args.seeds)]):
                    row = f.result()
                    rows.append(row)
                    shown = (" ".join(f"{k} {v:+.4f}" for k, v in row["values"].items()) if "values" in row
                             else "FAILED: " + row["error"][-400:])
                    print(f"[{variant}] seed {row['seed']:>3}: {shown}", flush=True)
            report["variants"][variant] = {"summary": summarize(rows, test.bounds),
                                           "rows": sorted(rows, key=lambda r: r["seed"])}
    report["seconds"] = time.perf_counter() - t0
    print(f"\n{'variant':<9} {'quantity':<17} {'runs':>4} {'mean':>8} {'std':>7} {'min':>8} {'max':>8} "
          f"{'mean-3.3sd':>10} {'mean+3.3sd':>10}  test bound (runs failing it)")
    for variant, v in report["variants"].items():
        for key, s in v["summary"].items():
            bound = f"{s['test_bound'][0]} {s['test_bound'][1]} ({s['fail_test']})" if "test_bound" in s else ""
            print(f"{variant:<9} {key:<17} {s['runs']:>4} {s['mean']:>+8.4f} {s['std']:>7.4f} {s['min']:>+8.4f} "
                  f"{s['max']:>+8.4f} {s['mean-3.3sd']:>+10.4f} {s['mean+3.3sd']:>+10.4f}  {bound}")
    print(f"total {report['seconds'] / 60:.1f} min")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"per-seed values: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
