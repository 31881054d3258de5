"""``m2po experiment staleness CONFIG`` — the paper's staleness comparison on one config.

Four arms, identical in everything (config, seed, prompts, base model) except the loss and the
staleness ``k`` of ``trainer.mode=stale_k`` (docs/design.md §3):

=============  ============  ===========================================================
arm            loss          staleness
=============  ============  ===========================================================
``grpo_s0``    grpo (clip)   0 (on-policy reference)
``grpo_sk``    grpo (clip)   k
``no_tr_sk``   no_tr         k (no trust region: the "prosperity before collapse" arm)
``m2po_sk``    m2po          k
=============  ============  ===========================================================

Each arm is one ``m2po train CONFIG [overrides] <arm overrides>`` subprocess with its own run
directory ``<out>/<arm>``; up to ``--parallel`` arms run at once (default: half the cores). A
live bar per arm follows its ``metrics.jsonl``. The experiment is resumable: an arm whose run
finished (``<out>/<arm>/experiment_done.json``) is skipped, an interrupted arm re-runs its
command, which resumes from the arm's last checkpoint. Ctrl-C / SIGTERM forwards SIGTERM to the
running arms (each checkpoints and exits), so re-running the same command continues.

Afterwards (and with ``--report-only`` on existing runs) it writes one PNG per metric with the
four curves into ``<out>/figures`` and the paper-style table (best / final held-out accuracy,
mean clip or mask fraction, collapsed) as ``<out>/summary.md`` and ``<out>/summary.json``.

Collapse rule (:class:`CollapseRule`, stated in the table): an arm collapsed when its final
held-out accuracy is below ``acc_ratio`` (0.5) times its best, or when its mean training reward
over the last ``tail_frac`` (10 %) of its steps is more than ``reward_margin`` (0.05) below the
base model's reward (the mean reward of all steps, of all arms, that trained on rollouts of the
base model: step 0 of every arm, the first ``k / U + 1`` steps of the stale arms).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

# --------------------------------------------------------------------------------------------
# Arms


@dataclass(frozen=True)
class Arm:
    name: str
    loss: str
    stale: bool  # staleness k (True) or 0 (False)
    title: str

    def label(self, k: int) -> str:
        return f"{self.title} s={k if self.stale else 0}"


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("grpo_s0", "grpo", False, "GRPO"),
    Arm("grpo_sk", "grpo", True, "GRPO"),
    Arm("no_tr_sk", "no_tr", True, "no trust region"),
    Arm("m2po_sk", "m2po", True, "M2PO"),
)}

# Trust-region statistic per loss: the fraction of tokens the loss clips / masks.
TR_KEY = {"grpo": "loss/clip_frac", "m2po": "m2po/mask_frac"}

# --fast: a short variant for CI and smoke tests (user overrides given on the command line win).
FAST_OVERRIDES = [
    "optim.lr=5e-5",
    "trainer.num_steps=8",
    "trainer.prompts_per_step=16",
    "trainer.prompts_per_update=4",
    "trainer.eval_every_steps=0",
    "rollout.num_engines=1",
    "checkpoint.save_every_steps=0",
    "checkpoint.export_hf_at_end=false",
]
FAST_K = 8

DONE_FILE = "experiment_done.json"
SPEC_FILE = "experiment.json"


def arm_overrides(arm: Arm, k: int, run_dir: Path, max_staleness: int) -> list[str]:
    """The overrides that make ``arm`` out of the shared config (nothing else differs)."""
    return [
        "trainer.mode=stale_k",
        f"trainer.stale_k={k if arm.stale else 0}",
        f"algo.loss={arm.loss}",
        f"store.max_staleness={max_staleness}",
        f"trainer.run_dir={run_dir}",
        "logging.progress=false",
    ]


# --------------------------------------------------------------------------------------------
# Analysis (pure functions over metrics records)


@dataclass(frozen=True)
class CollapseRule:
    acc_ratio: float = 0.5
    reward_margin: float = 0.05
    tail_frac: float = 0.1

    def describe(self) -> str:
        return (f"collapsed = final held-out accuracy < {self.acc_ratio:g} x best held-out accuracy, or mean "
                f"training reward over the last {self.tail_frac:.0%} of steps < base-model reward "
                f"- {self.reward_margin:g} (base-model reward: mean reward of the steps trained on rollouts of "
                f"the base model)")


@dataclass
class ArmSummary:
    arm: str
    label: str
    loss: str
    staleness: int
    steps: int  # training steps logged
    updates: int  # optimizer updates (x axis)
    best_acc: Optional[float] = None
    best_acc_update: Optional[int] = None
    final_acc: Optional[float] = None
    base_reward: Optional[float] = None
    final_reward: Optional[float] = None
    best_reward: Optional[float] = None  # max of the smoothed (tail-window) reward curve
    tr_key: Optional[str] = None
    mean_tr_frac: Optional[float] = None  # mean clip (grpo) / mask (m2po) fraction; 0 for no_tr
    mean_kl_k3: Optional[float] = None
    collapsed: Optional[bool] = None
    collapse_reason: str = ""
    extra: dict = field(default_factory=dict)


def step_records(records: Sequence[dict]) -> list[dict]:
    """The step-level records of a metrics file (per-update records carry only ``update/*``)."""
    return [r for r in records if "train/step" in r and isinstance(r.get("step"), (int, float))]


def _values(recs: Sequence[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for r in recs:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((int(r["step"]), float(v)))
    return out


def _mean(xs: Sequence[float]) -> Optional[float]:
    return float(sum(xs) / len(xs)) if xs else None


def summarize_arm(records: Sequence[dict], *, arm: str, label: str, loss: str, staleness: int,
                  rule: CollapseRule = CollapseRule(), base_reward: Optional[float] = None,
                  acc_key: str = "eval/synthetic/acc", reward_key: str = "rollout/reward_mean") -> ArmSummary:
    """The table row of one arm from its metrics records (``read_metrics`` output).

    ``base_reward``: the base model's training reward (default: this arm's step-0 reward, whose
    rollouts always come from the base model); :func:`pooled_base_reward` is less noisy.
    """
    recs = step_records(records)
    s = ArmSummary(arm=arm, label=label, loss=loss, staleness=staleness, steps=len(recs),
                   updates=int(recs[-1]["step"]) if recs else 0)
    acc = _values(recs, acc_key)
    if acc:
        best = max(acc, key=lambda t: t[1])  # first occurrence of the maximum
        s.best_acc, s.best_acc_update = best[1], best[0]
        s.final_acc = acc[-1][1]
    rew = [v for _, v in _values(recs, reward_key)]
    if rew:
        n_tail = max(1, int(round(rule.tail_frac * len(rew))))
        s.base_reward = rew[0] if base_reward is None else float(base_reward)
        s.final_reward = _mean(rew[-n_tail:])
        s.best_reward = max(_mean(rew[i:i + n_tail]) for i in range(len(rew) - n_tail + 1))
    if loss in TR_KEY:
        s.tr_key = TR_KEY[loss]
        s.mean_tr_frac = _mean([v for _, v in _values(recs, s.tr_key)])
    elif loss == "no_tr":
        s.mean_tr_frac = 0.0  # no trust region: nothing is clipped or masked
    s.mean_kl_k3 = _mean([v for _, v in _values(recs, "policy/kl_k3")])
    s.collapsed, s.collapse_reason = collapse_verdict(s, rule)
    return s


def pooled_base_reward(runs: Sequence[tuple[Sequence[dict], int, int]],
                       reward_key: str = "rollout/reward_mean") -> Optional[float]:
    """Mean training reward over every step, of every arm, that trained on base-model rollouts.

    ``runs``: (records, staleness k, updates per step) per arm. In ``stale_k`` mode the steps that
    start before version ``k`` exists train on rollouts of version 0 (``schedule.generation_version``),
    so a stale arm contributes about ``k / U + 1`` such steps and an on-policy arm its step 0.
    """
    from megatron_m2po.trainer.schedule import generation_version

    vals = []
    for records, k, U in runs:
        for r in step_records(records):
            v = r.get(reward_key)
            if isinstance(v, (int, float)) and generation_version(int(r["train/step"]), U, k) == 0:
                vals.append(float(v))
    return _mean(vals)


def collapse_verdict(s: ArmSummary, rule: CollapseRule = CollapseRule()) -> tuple[Optional[bool], str]:
    """(collapsed, why) under ``rule``; ``None`` when the arm has no data to judge."""
    reasons = []
    judged = False
    if s.best_acc is not None and s.final_acc is not None:
        judged = True
        if s.final_acc < rule.acc_ratio * s.best_acc:
            reasons.append(f"final held-out acc {s.final_acc:.3f} < {rule.acc_ratio:g} x best {s.best_acc:.3f}")
    if s.base_reward is not None and s.final_reward is not None:
        judged = True
        if s.final_reward < s.base_reward - rule.reward_margin:
            reasons.append(f"final reward {s.final_reward:.3f} < base {s.base_reward:.3f} - {rule.reward_margin:g}")
    if not judged:
        return None, "no data"
    return bool(reasons), "; ".join(reasons)


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:.3f}"


def format_table(rows: Sequence[ArmSummary], rule: CollapseRule = CollapseRule()) -> str:
    """The paper-style table as markdown."""
    head = ("| arm | staleness | updates | best held-out acc (update) | final held-out acc | base reward | "
            "final reward | mean clip / mask frac | collapsed |")
    lines = [head, "|" + "---|" * 9]
    for s in rows:
        best = _fmt(s.best_acc) + (f" ({s.best_acc_update})" if s.best_acc_update is not None else "")
        tr = _fmt(s.mean_tr_frac, pct=True)
        if s.loss == "no_tr":
            tr += " (none)"
        elif s.tr_key:
            tr += " clip" if s.loss == "grpo" else " mask"
        lines.append(f"| {s.label} | {s.staleness} | {s.updates} | {best} | {_fmt(s.final_acc)} | "
                     f"{_fmt(s.base_reward)} | {_fmt(s.final_reward)} | {tr} | {_fmt(s.collapsed)} |")
    lines.append("")
    lines.append(f"Rule: {rule.describe()}.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Figures

FIGURES: list[tuple[str, str, str]] = [
    # (file stem, title, metric key; "@tr" = the arm's clip / mask fraction; "@m2" = M2)
    ("heldout_acc", "Held-out accuracy (eval/synthetic/acc)", "eval/synthetic/acc"),
    ("reward", "Training reward (rollout/reward_mean)", "rollout/reward_mean"),
    ("trust_region", "Clipped (GRPO) / masked (M2PO) token fraction", "@tr"),
    ("m2", "M2 = mean (log r)^2", "@m2"),
    ("kl", "KL(behaviour || current), k3 estimator", "policy/kl_k3"),
    ("grad_norm", "Gradient norm (before clipping)", "optim/grad_norm"),
    ("entropy", "Policy entropy", "policy/entropy"),
    ("staleness", "Mean staleness of trained tokens (updates)", "staleness/mean"),
]


def _curves(recs: list[dict], arm: Arm, key: str) -> list[tuple[str, list[int], list[float], str]]:
    """(suffix, xs, ys, linestyle) curves of one arm for one figure key."""
    if key == "@tr":
        if arm.loss == "no_tr":  # no trust region: nothing is ever clipped or masked
            xs = [int(r["step"]) for r in recs]
            return [(" (nothing clipped)", xs, [0.0] * len(xs), ":")] if xs else []
        key = TR_KEY.get(arm.loss, "")
    if key == "@m2":
        out = []
        exact = _values(recs, "policy/m2") or _values(recs, "m2po/m2_before")
        if exact:
            src = "" if _values(recs, "policy/m2") else " (exact, trust-region tokens)"
            out.append((src, [x for x, _ in exact], [y for _, y in exact], "-"))
            after = _values(recs, "m2po/m2_after")
            if after:
                out.append((" after mask", [x for x, _ in after], [y for _, y in after], "--"))
        k3 = _values(recs, "policy/kl_k3")
        if k3 and not _values(recs, "policy/m2"):
            out.append((" ≈ 2·KL_k3 (all tokens)", [x for x, _ in k3], [2 * y for _, y in k3], ":"))
        return out
    vals = _values(recs, key)
    return [("", [x for x, _ in vals], [y for _, y in vals], "-")] if vals else []


def write_figures(runs: dict[str, list[dict]], k: int, out_dir: Path, *, smooth: int = 0) -> list[Path]:
    """One PNG per figure in :data:`FIGURES` with one colour per arm (arms without data skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_m2po.utils.logging import moving_average

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = {"grpo_s0": "tab:blue", "grpo_sk": "tab:orange", "no_tr_sk": "tab:red", "m2po_sk": "tab:green"}
    written = []
    for stem, title, key in FIGURES:
        fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=110)
        drew = False
        for name, records in runs.items():
            arm = ARMS[name]
            recs = step_records(records)
            for suffix, xs, ys, ls in _curves(recs, arm, key):
                c = colors.get(name)
                if smooth > 1 and len(ys) > smooth and key in ("rollout/reward_mean", "@tr", "optim/grad_norm",
                                                                 "policy/kl_k3", "@m2", "policy/entropy"):
                    ax.plot(xs, ys, color=c, linestyle=ls, linewidth=0.8, alpha=0.25)
                    ys = moving_average(ys, smooth)
                ax.plot(xs, ys, color=c, linestyle=ls, linewidth=1.6, label=arm.label(k) + suffix,
                        marker="o" if len(xs) <= 30 else None, markersize=3)
                drew = True
        if not drew:
            plt.close(fig)
            continue
        if key in ("policy/kl_k3", "@m2", "optim/grad_norm") and _all_positive(ax):
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer updates")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _all_positive(ax) -> bool:
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 50


# --------------------------------------------------------------------------------------------
# Running the arms


class MetricsTail:
    """Reads the complete lines appended to a ``metrics.jsonl`` since the last poll."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""
        self.last: dict[str, Any] = {}  # latest value of every step-level key
        self.steps_done = 0

    def poll(self) -> bool:
        """Read new records; True when a new step was logged."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return False
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = False
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "train/step" in rec:
                self.last.update({k: v for k, v in rec.items() if v is not None})
                self.steps_done = max(self.steps_done, int(rec["train/step"]) + 1)
                new = True
        return new

    def describe(self, loss: str) -> str:
        parts = []
        for key, name in (("rollout/reward_mean", "reward"), ("eval/synthetic/acc", "eval acc"),
                          (TR_KEY.get(loss, ""), "clip" if loss == "grpo" else "mask"),
                          ("staleness/mean", "stale")):
            v = self.last.get(key)
            if isinstance(v, (int, float)):
                parts.append(f"{name} {v:.3f}" if name != "stale" else f"{name} {v:.1f}")
        return "  ".join(parts)


@dataclass
class ArmRun:
    arm: Arm
    run_dir: Path
    command: list[str]
    overrides: list[str]
    tail: MetricsTail = field(init=False)
    proc: Optional[subprocess.Popen] = None
    log_file: Any = None
    started: float = 0.0
    status: str = "pending"  # pending | skipped | running | done | failed | stopped
    rc: Optional[int] = None
    wall_s: float = 0.0
    expected_steps: int = 0
    config_sha256: str = ""

    def __post_init__(self) -> None:
        self.tail = MetricsTail(self.run_dir / "metrics.jsonl")

    @property
    def done_file(self) -> Path:
        return self.run_dir / DONE_FILE

    def finished_before(self, strict: bool = True) -> bool:
        """Whether this arm's run finished earlier; with ``strict``, with the same config and overrides."""
        if not self.done_file.is_file():
            return False
        try:
            done = json.loads(self.done_file.read_text())
        except ValueError:
            return False
        then = (done.get("overrides"), done.get("config_sha256"))
        same = then[0] == self.overrides and then[1] in (None, self.config_sha256)  # None: written before digests
        if strict and not same:
            raise ValueError(
                f"{self.run_dir} holds a finished run of arm {self.arm.name} with different settings (config "
                f"sha256 {str(then[1])[:12]}, overrides {then[0]}; now {self.config_sha256[:12]}, {self.overrides}); "
                f"use a fresh --out directory or delete {self.run_dir}")
        return True

    def start(self, env: dict[str, str]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.run_dir / "train.log", "ab")
        self.log_file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.command)}\n".encode())
        self.log_file.flush()
        # Own session: a terminal Ctrl-C reaches only the experiment, which forwards SIGTERM so
        # every arm can checkpoint before it exits.
        self.proc = subprocess.Popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.status = "running"

    def check(self) -> bool:
        """True when the process has ended (status updated)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.rc = self.proc.returncode
        self.wall_s = time.monotonic() - self.started
        self.log_file.close()
        self.tail.poll()
        if self.rc == 0 and self.tail.steps_done >= self.expected_steps:
            self.status = "done"
            self.done_file.write_text(json.dumps({
                "arm": self.arm.name, "overrides": self.overrides, "config_sha256": self.config_sha256,
                "command": self.command, "rc": self.rc,
                "wall_s": round(self.wall_s, 1), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
        elif self.rc == 0:
            self.status = "stopped"  # it checkpointed on a signal before the last step
        else:
            self.status = "failed"
        return True


def _run_arms(runs: list[ArmRun], parallel: int, progress: bool) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    pending = [r for r in runs if r.status == "pending"]
    active: list[ArmRun] = []

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    live = progress and sys.stderr.isatty()
    bars = Progress(TextColumn("{task.fields[arm]:<22}"), BarColumn(bar_width=28), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[status]:<8} {task.fields[info]}"),
                    disable=not live, refresh_per_second=2)
    tasks = {id(r): bars.add_task("", total=r.expected_steps, arm=r.arm.label(_k_of(r)), status=r.status,
                                  info="", completed=r.expected_steps if r.status == "skipped" else 0)
             for r in runs}
    last_print: dict[int, float] = {}

    def refresh(r: ArmRun) -> None:
        new = r.tail.poll()
        bars.update(tasks[id(r)], completed=r.tail.steps_done, status=r.status, info=r.tail.describe(r.arm.loss))
        now = time.monotonic()
        if not live and progress and new and now - last_print.get(id(r), 0.0) > 30:
            last_print[id(r)] = now
            print(f"[{r.arm.name}] step {r.tail.steps_done}/{r.expected_steps}  {r.tail.describe(r.arm.loss)}",
                  file=sys.stderr, flush=True)

    def on_signal(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        with bars:
            while pending or active:
                while pending and len(active) < parallel:
                    r = pending.pop(0)
                    r.start(env)
                    active.append(r)
                    if not live and progress:
                        print(f"[{r.arm.name}] started: {' '.join(r.command)}", file=sys.stderr, flush=True)
                for r in list(active):
                    refresh(r)
                    if r.check():
                        active.remove(r)
                        refresh(r)
                        if not live and progress:
                            print(f"[{r.arm.name}] {r.status} (rc={r.rc}) after {r.wall_s:.0f}s; log: "
                                  f"{r.run_dir / 'train.log'}", file=sys.stderr, flush=True)
                time.sleep(1.0)
    except KeyboardInterrupt:
        print("experiment: stopping the running arms (each checkpoints first); re-run the same command to "
              "continue", file=sys.stderr, flush=True)
        _stop_all(active)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)


def _k_of(r: ArmRun) -> int:
    for o in r.overrides:
        if o.startswith("trainer.stale_k="):
            return int(o.split("=", 1)[1])
    return 0


def _stop_all(active: list[ArmRun], grace_s: float = 180.0) -> None:
    """SIGTERM (finish the step, checkpoint, exit); a second SIGTERM, then SIGKILL, if it hangs."""
    for r in active:
        if r.proc and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in active:
        if r.proc is None:
            continue
        try:
            r.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.send_signal(signal.SIGTERM)  # the trainer's second signal aborts the step
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        r.check()


# --------------------------------------------------------------------------------------------
# The command


def plan(config: str, overrides: Sequence[str], arms: Sequence[str], k: Optional[int], out: Optional[str],
         fast: bool) -> tuple[list[ArmRun], dict[str, Any]]:
    """Validate every arm's config and build the commands (nothing runs)."""
    from megatron_m2po.config import ConfigError, config_to_dict, load_config

    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ConfigError(f"unknown arm(s) {unknown or arms}; choose from {list(ARMS)}")
    base = (FAST_OVERRIDES if fast else []) + list(overrides)
    cfg = load_config(config, base)
    if k is None:
        k = FAST_K if fast else cfg.trainer.stale_k
    if k < 1:
        raise ConfigError(f"staleness k={k}: the stale arms need k >= 1; pass --k or set trainer.stale_k in {config}")
    U = cfg.trainer.num_updates_per_step
    # Of the resolved config, so that editing a comment does not invalidate finished arms.
    digest = hashlib.sha256(json.dumps(config_to_dict(cfg), sort_keys=True, default=str).encode()).hexdigest()
    out_dir = Path(out if out else cfg.trainer.run_dir)
    max_staleness = max(cfg.store.max_staleness, k + U - 1)
    runs = []
    for name in arms:
        arm = ARMS[name]
        run_dir = (out_dir / name).resolve()
        arm_ov = base + arm_overrides(arm, k, run_dir, max_staleness)
        arm_cfg = load_config(config, arm_ov)  # fail before anything starts
        cmd = [sys.executable, "-m", "megatron_m2po.cli", "train", str(config), *arm_ov]
        r = ArmRun(arm=arm, run_dir=run_dir, command=cmd, overrides=arm_ov, config_sha256=digest)
        r.expected_steps = arm_cfg.trainer.num_steps
        runs.append(r)
    spec = {"config": str(config), "overrides": list(overrides), "fast": fast, "k": k, "updates_per_step": U,
            "num_steps": cfg.trainer.num_steps, "seed": cfg.trainer.seed, "arms": list(arms),
            "max_staleness": max_staleness, "out": str(out_dir)}
    return runs, spec


def report(runs: list[ArmRun], spec: dict[str, Any], out_dir: Path, figures_dir: Path,
           rule: CollapseRule = CollapseRule(), smooth: int = 5) -> list[ArmSummary]:
    """Figures, table (markdown + JSON) from the arms' metrics files; prints the table."""
    from megatron_m2po.utils.logging import read_metrics

    data: dict[str, list[dict]] = {}
    for r in runs:
        mpath = r.run_dir / "metrics.jsonl"
        if mpath.is_file():
            data[r.arm.name] = read_metrics(mpath)
    by_name = {r.arm.name: r for r in runs}
    base = pooled_base_reward([(recs, _k_of(by_name[n]), spec["updates_per_step"]) for n, recs in data.items()])
    spec["base_reward"] = base
    rows = []
    for r in runs:
        if r.arm.name not in data:
            continue
        s = summarize_arm(data[r.arm.name], arm=r.arm.name, label=r.arm.label(spec["k"]), loss=r.arm.loss,
                          staleness=_k_of(r), rule=rule, base_reward=base)
        s.extra = {"status": r.status, "wall_s": _wall_of(r), "expected_steps": r.expected_steps}
        rows.append(s)
    if not rows:
        raise ValueError(f"no arm of {out_dir} has a metrics.jsonl yet; run the experiment first")
    figs = write_figures(data, spec["k"], figures_dir, smooth=smooth)
    table = format_table(rows, rule)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text(table + "\n")
    (out_dir / "summary.json").write_text(json.dumps(
        {"spec": spec, "rule": {**asdict(rule), "text": rule.describe()}, "arms": [asdict(s) for s in rows],
         "figures": [str(p) for p in figs]}, indent=2) + "\n")
    print(table)
    print(f"\nfigures: {figures_dir}\ntable: {out_dir / 'summary.md'}, {out_dir / 'summary.json'}")
    return rows


def _wall_of(r: ArmRun) -> Optional[float]:
    if r.wall_s:
        return round(r.wall_s, 1)
    try:
        return json.loads(r.done_file.read_text()).get("wall_s")
    except (OSError, ValueError):
        return None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="Experiments built from several training runs.")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    esub.required = True
    s = esub.add_parser(
        "staleness", help="GRPO s=0 / GRPO s=k / no trust region s=k / M2PO s=k on identical seeds and data.",
        description="Runs GRPO s=0, GRPO s=k, no trust region s=k and M2PO s=k as `m2po train` subprocesses "
                    "that differ only in algo.loss and trainer.stale_k (same config, seed and data), then writes "
                    "one figure per metric and the paper-style table. Resumable: re-run the same command.")
    s.add_argument("config", help="YAML config shared by every arm (e.g. examples/staleness_tiny.yaml)")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every arm")
    s.add_argument("--arms", nargs="+", default=list(ARMS), metavar="ARM",
                   help=f"Arms to run, any of {', '.join(ARMS)} (default: all four)")
    s.add_argument("--k", type=int, default=None, help="Staleness k of the stale arms (default: trainer.stale_k)")
    s.add_argument("--parallel", type=int, default=None,
                   help="Arms run at once (default: max(1, cores // 2))")
    s.add_argument("--out", default=None, help="Experiment directory (default: the config's trainer.run_dir)")
    s.add_argument("--figures", default=None, help="Where the PNGs go (default: <out>/figures)")
    s.add_argument("--fast", action="store_true",
                   help=f"Short smoke variant: {' '.join(FAST_OVERRIDES)}, k={FAST_K} (overrides win)")
    s.add_argument("--report-only", action="store_true",
                   help="Do not run anything: redraw figures and the table from the existing arm runs")
    s.add_argument("--no-progress", action="store_true", help="No progress bars / progress lines")
    s.add_argument("--smooth", type=int, default=5, help="Moving-average window for noisy curves (0 = raw)")
    s.set_defaults(func=run)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run(args: argparse.Namespace) -> int:
    arms = [a for item in args.arms for a in item.split(",") if a]
    runs, spec = plan(args.config, args.overrides, arms, args.k, args.out, args.fast)
    out_dir = Path(spec["out"])
    figures_dir = Path(args.figures) if args.figures else out_dir / "figures"
    if not args.report_only:
        parallel = args.parallel if args.parallel is not None else max(1, _cores() // 2)
        if parallel < 1:
            raise ValueError(f"--parallel={parallel}: run at least one arm at a time")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
        for r in runs:
            if r.finished_before():
                r.status = "skipped"
                r.tail.poll()
                if not args.no_progress:
                    print(f"[{r.arm.name}] finished before: skipped ({r.done_file})", file=sys.stderr)
        t0 = time.monotonic()
        _run_arms(runs, parallel, progress=not args.no_progress)
        spec["last_invocation_wall_s"] = round(time.monotonic() - t0, 1)
        (out_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    else:
        for r in runs:
            r.status = "done" if r.finished_before(strict=False) else "incomplete"
    report(runs, spec, out_dir, figures_dir, smooth=args.smooth)
    bad = [r for r in runs if r.status not in ("done", "skipped")]
    for r in bad:
        print(f"arm {r.arm.name}: {r.status}" + (f" (rc={r.rc}); see {r.run_dir / 'train.log'}" if r.rc else ""),
              file=sys.stderr)
    return 1 if bad else 0
