"""Rehearse a GPU recipe end to end on this CPU machine, in its own topology.

    scripts/run_qwen2.5_32b.sh --rehearse [--workdir DIR] [--steps 8] [key=value ...]
    python -m megatron_m2po.rehearsal examples/qwen2.5-32b.yaml [...]     # the same

What runs is the recipe's own config through the launch path its users run, with only what a
CPU cannot hold substituted (each substitution is printed with its reason):

* the model: the tiny base of the recipe's family (:mod:`megatron_m2po.standins.tiny_base`, a
  Qwen3-shaped one for Qwen3 recipes, the tiny Qwen3-MoE -- 4 experts, top-2 -- for Qwen3-MoE
  ones), in the recipe's dtype;
* the data: the synthetic task instead of the recipe's parquet file (not on this machine), in
  the recipe's prompt template, graded by the recipe's reward;
* sizes: a few prompts per step with the recipe's number of updates per step, short responses;
* parallelism: TP=2 x PP=2 over 4 processes (a recipe with context parallelism, or a
  ``parallel.context_parallel`` given on the command line: TP=2 x CP=2; an MoE recipe: expert
  parallel EP=2 with TP and PP scaled as in :func:`_expert_layout`), keeping every feature
  the recipe turns on (sequence parallel, its recompute mode, the distributed optimizer);
* staleness: ``stale_k`` scaled to the same number of updates per step but a lag of
  ``LAG_STEPS`` steps instead of ``stale_k / U`` (64 for the 32B recipes), so that staleness
  is actually seen within the rehearsal's steps;
* the shared paths: ``trainer.run_dir`` and ``rollout.weight_sync_dir`` are absolute paths in
  the rehearsal's ``shared/`` directory -- the only things the recipe says every node (and the
  engines) must share.

Topology: 2 simulated nodes x 2 processes, each node launched by ``scripts/train.sh`` with
``NNODES=2 NODE_RANK=r`` (torchrun on loopback) in its own working directory ``node<r>/``. The
engines are CPU workers started the way the recipe starts its SGLang engines:

* ``rollout.launcher=external`` (the 32B recipes): by ``scripts/launch_sglang_fleet.sh``
  (``ENGINE=cpu_worker``) behind the real sglang-router, the trainer attached by
  ``rollout.router_addr`` alone;
* ``rollout.launcher=local`` (the 7B / 8B recipes): by trainer rank 0 itself (``LocalLauncher``,
  inside a torchrun worker, so with the environment handling of ``rollout/launcher.py``
  ``engine_env``: a CPU worker initialises torch.distributed at start-up as SGLang does and hangs
  on an inherited ``TORCHELASTIC_USE_AGENT_STORE``), behind a router rank 0 starts too; the
  recipe's GPU list is dropped (CPU workers take no GPU) and the ports are free ones. They die
  with node 0 and come back with it.

Script: run until the checkpoint after ``--kill-after`` steps exists, SIGKILL node 1's
processes, wait for node 0 to fail on its own (a hang is an error), relaunch both nodes (they
resume from that checkpoint), let them finish, check the metrics, and print last::

    rehearsal ok <recipe> steps=... resumed_from=... staleness=<min>..<max> ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megatron_m2po.config import apply_overrides, Config, config_from_dict, config_to_dict, load_config
from megatron_m2po.utils.net import free_port
from megatron_m2po.utils.standin import load_standin

LAUNCH_SCRIPTS = ("train.sh", "launch_sglang_fleet.sh")  # what a rehearsal runs, from one scripts/ directory


def find_scripts(config: Path, env: Optional[dict] = None, cwd: Optional[Path] = None) -> Path:
    """The ``scripts/`` directory whose launchers a rehearsal runs (it must hold ``LAUNCH_SCRIPTS``).

    Looked for, first found wins: ``$M2PO_SCRIPTS_DIR``; the checkout this package is imported
    from (an editable install); the checkout the recipe ``config`` sits in
    (``<repo>/examples/x.yaml`` -> ``<repo>/scripts``); ``scripts/`` under the working directory.
    An installed (non-editable) package lives in site-packages with no ``scripts/`` beside it,
    which is why the package's own location is not enough (the image sets the variable).
    Raises :class:`RehearsalError` naming every place looked at.
    """
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    candidates = []
    if env.get("M2PO_SCRIPTS_DIR"):
        candidates.append(("$M2PO_SCRIPTS_DIR", Path(env["M2PO_SCRIPTS_DIR"]).expanduser()))
    candidates += [("this package's checkout", Path(__file__).resolve().parents[1] / "scripts"),
                   ("the recipe's checkout", Path(config).resolve().parent.parent / "scripts"),
                   ("the working directory", cwd / "scripts")]
    for _, d in candidates:
        if all((d / name).is_file() for name in LAUNCH_SCRIPTS):
            return d.resolve()
    looked = "; ".join(f"{what}: {d}" for what, d in candidates)
    raise RehearsalError(f"no scripts/ directory with {' and '.join(LAUNCH_SCRIPTS)} found (looked at {looked}); "
                         "set M2PO_SCRIPTS_DIR to the repository's scripts/ directory")

NODES, PROCS_PER_NODE = 2, 2
TP, PP, CP = 2, 2, 2
EP = 2                        # an MoE recipe's rehearsal: expert parallel over 2 of the 4 processes
LAG_STEPS = 2                 # rehearsal stale_k = LAG_STEPS x updates per step
PROMPTS_PER_UPDATE = 1
SAMPLES_PER_PROMPT = 4
MAX_NEW_TOKENS = 16
ENGINES = 2


class RehearsalError(RuntimeError):
    """A rehearsal step failed; the message names the step and the log to read."""


@dataclass
class RehearsalPlan:
    """The rehearsal's config: the recipe with the substitutions (key -> (value, reason))."""

    recipe: str
    config_path: Path
    cfg: Config
    overrides: dict[str, tuple[str, str]]
    family: str
    stale_k_note: str
    steps: int
    kill_after: int
    extra: list[str] = field(default_factory=list)

    def args(self) -> list[str]:
        return [f"{k}={v}" for k, (v, _) in self.overrides.items()] + self.extra


def family_of(cfg: Config) -> str:
    """The tiny base family standing in for the recipe's model (from its HF path's name; a Qwen3
    MoE is named ``...-A<active>B``, e.g. Qwen3-30B-A3B, or ``...moe...``)."""
    name = Path(cfg.model.hf_path.rstrip("/")).name.lower()
    if "qwen3" in name and ("moe" in name or re.search(r"-a\d+(\.\d+)?b\b", name)):
        return "qwen3_moe"
    if "qwen3" in name:
        return "qwen3"
    if "qwen2" in name:
        return "qwen2"
    raise RehearsalError(f"model.hf_path={cfg.model.hf_path}: no tiny base of this family (Qwen2 / Qwen2.5 / "
                         "Qwen3 recipes only)")


# A distillation recipe's teacher: the tiny base of another family stands in for it (every tiny base
# shares the byte-level tokenizer, as a real teacher must share the student's; other weights, so the
# teacher's reverse KL is not zero).
TEACHER_FAMILY = {"qwen2": "qwen3", "qwen3": "qwen2", "qwen3_moe": "qwen3"}


def plan(config_path: Path, *, shared: Path, model_dir: str, family: str, steps: int, kill_after: int,
         extra: list[str], router_addr: str, teacher_dir: str = "") -> RehearsalPlan:
    """The recipe with the substitutions; validated as the trainer will see it (with ``router_addr``,
    which the nodes get from ``ROUTER_ADDR`` like a user's run). ``teacher_dir``: the tiny base of
    :data:`TEACHER_FAMILY` standing in for a distillation recipe's teacher."""
    cfg = load_config(config_path)
    t, p = cfg.trainer, cfg.parallel
    U = t.num_updates_per_step
    o: dict[str, tuple[str, str]] = {}

    def put(key: str, value, why: str) -> None:
        o[key] = (str(value).lower() if isinstance(value, bool) else str(value), why)

    put("model.hf_path", model_dir, f"the tiny {family} base stands in for {cfg.model.hf_path}")
    if cfg.algo.distill.coef > 0:
        if not teacher_dir:
            raise RehearsalError("a distillation recipe's rehearsal needs a teacher_dir (the tiny stand-in teacher)")
        put("algo.distill.teacher", teacher_dir, f"the tiny {TEACHER_FAMILY[family]} base (the student's tokenizer, "
            f"other weights) stands in for {cfg.algo.distill.teacher}")
    put("data.train", "synthetic", f"{cfg.data.train} is not on this machine: the synthetic task, "
        f"in the recipe's '{cfg.data.template}' template")
    put("trainer.prompts_per_update", PROMPTS_PER_UPDATE, f"small batch ({t.prompts_per_update} in the recipe)")
    put("trainer.prompts_per_step", PROMPTS_PER_UPDATE * U, f"the recipe's {U} updates per step")
    put("rollout.n_samples_per_prompt", SAMPLES_PER_PROMPT, f"small batch ({cfg.rollout.n_samples_per_prompt})")
    put("rollout.max_new_tokens", MAX_NEW_TOKENS, f"short responses ({cfg.rollout.max_new_tokens})")
    n = NODES * PROCS_PER_NODE
    # context parallelism from the recipe or the command line: TP x CP fills the 4 processes
    wants_cp = config_from_dict(apply_overrides(config_to_dict(cfg), extra)).parallel.context_parallel > 1
    extra = [x for x in extra if not x.startswith("parallel.context_parallel=")] if wants_cp else extra
    if wants_cp:
        put("parallel.context_parallel", CP, f"{n} processes ({p.context_parallel} in the recipe)")
    pp = PP if p.pipeline_parallel > 1 and not wants_cp else 1
    tp = TP
    if family == "qwen3_moe":
        tp, pp = _expert_layout(p, n, put)
    if p.tensor_parallel != tp:
        put("parallel.tensor_parallel", tp, f"{n} processes ({p.tensor_parallel} in the recipe)")
    if p.pipeline_parallel != pp:
        put("parallel.pipeline_parallel", pp, f"{n} processes ({p.pipeline_parallel} in the recipe)")
    if p.virtual_pipeline_parallel is not None:
        put("parallel.virtual_pipeline_parallel", "null", f"{p.virtual_pipeline_parallel} in the recipe: the tiny "
            "model's 2 layers make no virtual stages")
    local = cfg.rollout.launcher == "local"
    if local:
        put("rollout.engine", "cpu_worker", f"{cfg.rollout.engine} in the recipe: CPU workers, still started by trainer "
            "rank 0 under torchrun (rollout.launcher=local)")
        put("rollout.num_engines", ENGINES, f"{cfg.rollout.num_engines} in the recipe")
        if cfg.rollout.engine_gpu_ids:
            put("rollout.engine_gpu_ids", "[]", f"{cfg.rollout.engine_gpu_ids} in the recipe: CPU workers take no GPU")
        put("rollout.base_port", 0, f"{cfg.rollout.base_port} in the recipe: free ports on this shared machine")
    elif cfg.rollout.launcher != "external":
        put("rollout.launcher", "external", f"{cfg.rollout.launcher} in the recipe (engines on Ray): "
            "here the CPU fleet of scripts/launch_sglang_fleet.sh, attached by rollout.router_addr")
    put("trainer.run_dir", shared / "run", f"shared by every node ({t.run_dir} in the recipe)")
    if cfg.rollout.weight_sync_dir:
        put("rollout.weight_sync_dir", shared / "weights",
            f"shared by trainer and engines ({cfg.rollout.weight_sync_dir} in the recipe)")
    put("trainer.num_steps", steps, f"{t.num_steps} in the recipe")
    put("checkpoint.save_every_steps", kill_after, f"{cfg.checkpoint.save_every_steps} in the recipe")
    put("trainer.eval_every_steps", 0, "no held-out sets on this machine")
    put("logging.progress", False, "log lines, not a progress bar")
    note = f"mode={t.mode}"
    if t.mode == "stale_k":
        k = LAG_STEPS * U
        put("trainer.stale_k", k, f"{t.stale_k} in the recipe")
        put("store.max_staleness", k + U - 1, f"{cfg.store.max_staleness}: covers k + U - 1")
        note = (f"stale_k {t.stale_k}->{k}: the recipe lags {t.stale_k}/{U} = {t.stale_k / U:g} steps of {U} "
                f"updates, more than a rehearsal runs; {k} = {LAG_STEPS} steps of {U} updates, so from step "
                f"{LAG_STEPS} on every step trains on rollouts {LAG_STEPS} steps old (staleness {k}..{k + U - 1})")
    elif t.mode == "async":
        put("store.max_staleness", min(cfg.store.max_staleness, 2 * U), f"{cfg.store.max_staleness}")
    data = apply_overrides(config_to_dict(cfg), [f"{k}={v}" for k, (v, _) in o.items()] + extra
                           + ([] if local else [f"rollout.router_addr={router_addr}"]))
    final = config_from_dict(data)
    name = config_path.stem
    return RehearsalPlan(name, config_path, final, o, family, note, steps, kill_after, extra)


def _expert_layout(p, n: int, put: Callable[..., None]) -> tuple[int, int]:
    """An MoE recipe's layout scaled to ``n`` processes with expert parallel ``EP``: TP 2 where the
    recipe has TP (1 otherwise), the recipe's expert-TP choice (whole experts, or split as the
    attention), and PP 2 where the recipe pipelines and ``etp x EP x pp`` still divides ``n``
    (Megatron's rule); the rest is data parallel. Returns (tp, pp)."""
    tp = TP if p.tensor_parallel > 1 else 1
    recipe_etp = p.expert_tensor_parallel or p.tensor_parallel
    etp = 1 if recipe_etp == 1 else tp
    pp = PP if p.pipeline_parallel > 1 and n % (etp * EP * PP) == 0 and n % (tp * PP) == 0 else 1
    put("parallel.expert_parallel", EP, f"{n} processes ({p.expert_parallel} in the recipe)")
    put("parallel.expert_tensor_parallel", etp, f"{'whole experts' if etp == 1 else 'experts split as the attention'}"
        f" as in the recipe (expert_tensor_parallel={recipe_etp})")
    return tp, pp


# ---------------------------------------------------------------------------- processes


def _wait(cond: Callable[[], object], what: str, timeout: float,
          hopeless: Optional[Callable[[], Optional[str]]] = None) -> object:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        why = hopeless() if hopeless else None
        if why:
            raise RehearsalError(f"{what}: will not happen ({why})")
        if time.monotonic() > deadline:
            raise RehearsalError(f"{what}: did not happen within {timeout:.0f} s")
        time.sleep(0.2)  # poll interval: cond() decides


def _tail(path: Path, n: int = 25) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


class _Proc:
    """A launched script in its own session (so one signal reaches its whole tree)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.name, self.log = name, log
        cwd.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            f.write(f"\n=== {name}: {' '.join(cmd)}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def tree(self) -> list[int]:
        """This process and every descendant (torchrun starts its workers in sessions of their own,
        so a process-group signal would miss them)."""
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to the whole tree at once (ids taken first, so no child escapes by re-parenting)."""
        pids = self.tree()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # stragglers of the tree
        self.proc.wait()


def _router_healthy(router: str) -> int:
    from megatron_m2po.rollout.client import SGLangClient

    async def go():
        async with SGLangClient(router, max_retries=0) as c:
            return await c.request("GET", "/workers")
    try:
        workers = asyncio.run(go()).get("workers", [])
    except Exception:  # noqa: BLE001 - not up yet
        return 0
    return sum(1 for w in workers if w.get("is_healthy"))


def _free_pair() -> int:
    """A port p with p and p+1 free (two engines on BASE_PORT, BASE_PORT+1)."""
    for _ in range(50):
        p = free_port()
        if p < 65000 and _port_free(p + 1):
            return p
    raise RehearsalError("no two consecutive free ports")


def _port_free(port: int) -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------- the run


@dataclass
class Rehearsal:
    plan: RehearsalPlan
    workdir: Path
    model_dir: str
    router_port: int
    scripts: Path  # find_scripts()
    python: str = sys.executable
    say: Callable[[str], None] = print
    timeout_s: float = 900.0
    procs: list[_Proc] = field(default_factory=list)
    kill: str = "node"  # "worker": one worker dies, torchrun --max-restarts restarts the group by itself;
    # "node+worker": node 1 dies, and in the resumed run a worker dies too and torchrun restarts the group;
    # "none": nothing killed here: the rehearsal is stopped from outside (a Slurm requeue) and run again
    resumed_from: Optional[str] = None  # kill="none": the checkpoint an earlier attempt left (see main)

    @property
    def shared(self) -> Path:
        return self.workdir / "shared"

    @property
    def ckpt_dir(self) -> Path:
        return self.shared / "run" / "checkpoints"

    def _env(self, **kw: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MODEL_PATH", "DATA_TRAIN", "ROUTER_ADDR", "RUN_DIR", "NNODES", "NODE_RANK",
                            "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(PYTHON=self.python, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **kw)
        return env

    def start_fleet(self) -> str:
        d = self.workdir / "fleet"
        base, rport = _free_pair(), self.router_port
        env = self._env(MODEL_PATH=self.model_dir, ENGINE="cpu_worker", NUM_ENGINES=str(ENGINES),
                        BASE_PORT=str(base), ROUTER_PORT=str(rport), HOST="127.0.0.1", ADVERTISE_HOST="127.0.0.1",
                        PROMETHEUS_PORT=str(free_port()), LOG_DIR=str(d / "logs"))
        fleet = _Proc("fleet", ["bash", str(self.scripts / "launch_sglang_fleet.sh")], env, d, d / "fleet.log")
        self.procs.append(fleet)
        router = f"http://127.0.0.1:{rport}"
        _wait(lambda: _router_healthy(router) >= ENGINES, f"{ENGINES} CPU workers healthy behind the router {router}",
              300, lambda: fleet.poll() is not None and f"the fleet exited; see {d}/logs")
        self.say(f"fleet: {ENGINES} CPU workers behind sglang-router at {router} (scripts/launch_sglang_fleet.sh, "
                 f"ENGINE=cpu_worker; logs in {d / 'logs'})")
        return router

    @property
    def trainer_launches_engines(self) -> bool:
        """The recipe's engines are started by trainer rank 0 (``rollout.launcher=local``)."""
        return self.plan.cfg.rollout.launcher == "local"

    def start_nodes(self, router: Optional[str], attempt: int, **extra_env: str) -> list[_Proc]:
        port = free_port()
        nodes = []
        for r in range(NODES):
            d = self.workdir / f"node{r}"
            env = self._env(NNODES=str(NODES), NODE_RANK=str(r), GPUS_PER_NODE=str(PROCS_PER_NODE),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **({"ROUTER_ADDR": router} if router else {}),
                            # the node-kill run checks that node 0 stops by itself (no torchrun restarts,
                            # whatever the recipe's default); the worker-kill run asks for restarts
                            **{"MAX_RESTARTS": "0", **extra_env})
            cmd = ["bash", str(self.scripts / "train.sh"), str(self.plan.config_path), *self.plan.args()]
            nodes.append(_Proc(f"node {r}", cmd, env, d, d / f"train_{attempt}.log"))
        self.procs += nodes
        return nodes

    def latest(self) -> Optional[str]:
        p = self.ckpt_dir / "latest"
        return p.read_text().strip() if p.is_file() else None

    def run(self) -> dict:
        if self.kill == "worker":
            return self.run_worker_kill()
        if self.kill == "none":
            return self.run_to_the_end()
        t0 = time.monotonic()
        plan = self.plan
        ck = f"step_{plan.kill_after:06d}"
        try:
            router = None if self.trainer_launches_engines else self.start_fleet()
            nodes = self.start_nodes(router, 1)
            engines = (f"{ENGINES} CPU workers and the router started by trainer rank 0 (rollout.launcher=local; "
                       f"logs in {self.shared / 'run' / 'engines'})" if router is None
                       else f"attached by rollout.router_addr={router}")
            self.say(f"nodes: {NODES} x {PROCS_PER_NODE} processes (scripts/train.sh NNODES={NODES} NODE_RANK=0/1, "
                     f"working directories {self.workdir}/node0, node1), {engines}")

            def exited() -> Optional[str]:
                for n in nodes:
                    if n.poll() is not None:
                        return f"{n.name} exited with {n.poll()}; log {n.log}:\n{_tail(n.log)}"
                return None
            _wait(lambda: self.latest() == ck, f"the checkpoint after step {plan.kill_after}", self.timeout_s, exited)
            self.say(f"checkpoint {ck} written ({time.monotonic() - t0:.0f} s); SIGKILL to node 1's processes")
            nodes[1].kill(signal.SIGKILL)
            nodes[1].proc.wait()
            t_kill = time.monotonic()
            try:
                _wait(lambda: nodes[0].poll() is not None, "node 0 stopping after node 1 died", 300)
            except RehearsalError:
                nodes[0].kill(signal.SIGKILL)
                raise RehearsalError(f"node 0 did not stop within 300 s of node 1's death (hung); log {nodes[0].log}:"
                                     f"\n{_tail(nodes[0].log)}") from None
            self.say(f"node 0 stopped on its own {time.monotonic() - t_kill:.0f} s after node 1 died "
                     f"(exit {nodes[0].poll()})")
            if (self.ckpt_dir / f"step_{plan.steps:06d}").exists():
                raise RehearsalError("the run finished before node 1 was killed: raise --steps")
            resumed_from = self.latest()
            # node+worker: the resumed run's last rank SIGKILLs itself after its first step; torchrun
            # (MAX_RESTARTS=1) restarts both nodes' workers, which resume from the same checkpoint.
            worker = ({"MAX_RESTARTS": "1", "M2PO_FAULT": "worker_dies@1", "M2PO_FAULT_RANK": str(NODES * PROCS_PER_NODE - 1)}
                      if self.kill == "node+worker" else {})
            nodes = self.start_nodes(router, 2, **worker)
            for n in nodes:
                _wait(lambda n=n: n.poll() is not None, f"{n.name} finishing after the resume", self.timeout_s,
                      lambda: exited() if any(m.poll() not in (None, 0) for m in nodes) else None)
            for n in nodes:
                if n.poll() != 0:
                    raise RehearsalError(f"{n.name} exited with {n.poll()} after the resume; log {n.log}:\n{_tail(n.log)}")
            resumed_line = next((ln for ln in nodes[0].log.read_text(errors="replace").splitlines()
                                 if "resumed from" in ln), None)
            if resumed_line is None or ck not in resumed_line:
                raise RehearsalError(f"node 0 did not report resuming from {ck}; log {nodes[0].log}")
            if worker:
                logs = "\n".join(n.log.read_text(errors="replace") for n in nodes)
                if "m2po fault point worker_dies" not in logs:
                    raise RehearsalError(f"no worker was killed after the resume; logs {[str(n.log) for n in nodes]}")
                if logs.count(f"resumed from {self.ckpt_dir / ck}") != 2:
                    raise RehearsalError(f"the group torchrun restarted did not report resuming from {ck}; logs "
                                         f"{[str(n.log) for n in nodes]}")
                self.say(f"after the resume a worker died after step {plan.kill_after + 1}; torchrun restarted the "
                         f"group, which resumed from {ck} again")
            if self.trainer_launches_engines:
                self.check_trainer_launched_engines()
            return self.summary(resumed_from, time.monotonic() - t0)
        finally:
            for p in reversed(self.procs):
                p.stop()

    def check_trainer_launched_engines(self) -> None:
        """Rank 0 launched every engine twice (first run and resume), and each came up through its own
        torch.distributed init inside a torchrun worker's process tree."""
        logs = sorted((self.shared / "run" / "engines").glob("engine_*.log"))
        if len(logs) != ENGINES:
            raise RehearsalError(f"expected {ENGINES} engine logs from trainer rank 0, found {[p.name for p in logs]}")
        for p in logs:
            text = p.read_text(errors="replace")
            launches = text.count("=== launch")
            if launches < 2 or text.count("init torch.distributed: backend=gloo") != launches:
                raise RehearsalError(f"{p}: not launched and initialised in each run (first run and resume):\n"
                                     f"{_tail(p)}")

    def run_to_the_end(self) -> dict:
        """Nothing killed by the rehearsal: the nodes run to the last step. What stops them comes from
        outside (``scontrol requeue``, a node failure: scripts/slurm/m2po.sbatch); the same command
        on the same ``--workdir`` then runs this again, and the nodes resume from the checkpoint the
        stopped attempt left (:attr:`resumed_from`), as a requeued job's run does."""
        t0 = time.monotonic()
        attempt = 1 + len(list((self.workdir / "node0").glob("train_*.log")))
        try:
            router = None if self.trainer_launches_engines else self.start_fleet()
            nodes = self.start_nodes(router, attempt)
            self.say(f"nodes: {NODES} x {PROCS_PER_NODE} processes (attempt {attempt}"
                     + (f", resuming from {self.resumed_from}" if self.resumed_from else "") + ")")
            for n in nodes:
                _wait(lambda n=n: n.poll() is not None, f"{n.name} finishing", self.timeout_s,
                      lambda: next((f"{m.name} exited with {m.poll()}; log {m.log}:\n{_tail(m.log)}" for m in nodes
                                    if m.poll() not in (None, 0)), None))
            if self.resumed_from and f"resumed from {self.ckpt_dir / self.resumed_from}" not in \
                    nodes[0].log.read_text(errors="replace"):
                raise RehearsalError(f"node 0 did not report resuming from {self.resumed_from}; log {nodes[0].log}")
            return self.summary(self.resumed_from, time.monotonic() - t0)
        finally:
            for p in reversed(self.procs):
                p.stop(10.0)

    def run_worker_kill(self) -> dict:
        """torchrun's own restarts: the nodes run ``scripts/train.sh`` with ``MAX_RESTARTS=1``; global
        rank 3 SIGKILLs itself (``M2PO_FAULT=worker_dies``) once the step after the checkpoint is
        logged; torchrun restarts the group on both nodes, which resumes from that checkpoint and
        finishes, with no relaunch by anyone."""
        t0 = time.monotonic()
        plan = self.plan
        ck = f"step_{plan.kill_after:06d}"
        try:
            router = None if self.trainer_launches_engines else self.start_fleet()
            nodes = self.start_nodes(router, 1, MAX_RESTARTS="1", M2PO_FAULT=f"worker_dies@{plan.kill_after + 1}",
                                     M2PO_FAULT_RANK=str(NODES * PROCS_PER_NODE - 1))
            self.say(f"nodes: {NODES} x {PROCS_PER_NODE} processes (scripts/train.sh MAX_RESTARTS=1: torchrun "
                     f"--max-restarts 1, c10d rendezvous); rank {NODES * PROCS_PER_NODE - 1} SIGKILLs itself after step "
                     f"{plan.kill_after + 1}, past the checkpoint {ck}")
            for n in nodes:
                _wait(lambda n=n: n.poll() is not None, f"{n.name} finishing", self.timeout_s,
                      lambda: next((f"{m.name} exited with {m.poll()}; log {m.log}:\n{_tail(m.log)}" for m in nodes
                                    if m.poll() not in (None, 0)), None))
            logs = "\n".join(n.log.read_text(errors="replace") for n in nodes)
            if "m2po fault point worker_dies" not in logs:
                raise RehearsalError(f"no worker was killed (the run ended first?); logs {[str(n.log) for n in nodes]}")
            if f"resumed from {self.ckpt_dir / ck}" not in logs:
                raise RehearsalError(f"the restarted group did not report resuming from {ck}; logs "
                                     f"{[str(n.log) for n in nodes]}")
            self.say(f"a worker died after step {plan.kill_after + 1}; torchrun restarted the group, which resumed "
                     f"from {ck} and finished ({time.monotonic() - t0:.0f} s)")
            return self.summary(ck, time.monotonic() - t0)
        finally:
            for p in reversed(self.procs):
                p.stop()

    def summary(self, resumed_from: Optional[str], seconds: float) -> dict:
        plan = self.plan
        U = plan.cfg.trainer.num_updates_per_step
        recs = [json.loads(ln) for ln in (self.shared / "run" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        updates: dict[int, dict] = {}
        steps: set[int] = set()
        for r in recs:
            if any(k.startswith("update/") for k in r):
                updates[r["step"]] = r
            if "train/step" in r:
                steps.add(int(r["train/step"]))
        want = list(range(1, plan.steps * U + 1))
        if sorted(updates) != want:
            raise RehearsalError(f"updates logged {sorted(updates)}, expected 1..{plan.steps * U}")
        if sorted(steps) != list(range(plan.steps)):
            raise RehearsalError(f"steps logged {sorted(steps)}, expected 0..{plan.steps - 1}")
        lo = min(int(r["update/staleness/min"]) for r in updates.values())
        hi = max(int(r["update/staleness/max"]) for r in updates.values())
        if plan.cfg.trainer.mode == "stale_k" and hi < plan.cfg.trainer.stale_k:
            raise RehearsalError(f"staleness never reached stale_k={plan.cfg.trainer.stale_k} (max {hi})")
        return {"recipe": plan.recipe, "steps": plan.steps, "updates": plan.steps * U, "resumed_from": resumed_from,
                "staleness_min": lo, "staleness_max": hi, "seconds": round(seconds, 1)}


# ---------------------------------------------------------------------------- work directory

KEPT = ("*.log", "metrics.jsonl", "config.yaml", "config.json")  # what a rehearsal that passed leaves


def prune_workdir(workdir: Path) -> int:
    """Remove what a rehearsal that passed no longer needs from ``workdir`` (checkpoints, weights,
    stores, traces) and keep what its output pointed to: every log (the nodes', the fleet's, the
    engines', whatever is under a ``logs/`` directory), the run's ``metrics.jsonl`` and its config.
    Returns the bytes kept."""
    kept = 0
    for p in sorted(workdir.rglob("*"), key=lambda q: len(q.parts), reverse=True):  # files before their dirs
        if p.is_symlink() or p.is_file():
            if "logs" in p.relative_to(workdir).parts[:-1] or any(p.match(k) for k in KEPT):
                kept += p.stat().st_size if p.is_file() else 0
            else:
                p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    return kept


# ---------------------------------------------------------------------------- entry


KILL_NOTES = {"node": "node 1 SIGKILLed after it", "worker": "a worker SIGKILLed, torchrun restarted the group",
              "node+worker": "node 1 SIGKILLed after it, then a worker, torchrun restarted the group",
              "none": "an earlier attempt stopped from outside, this one resumed"}


class _Stopped(Exception):
    """SIGTERM (Slurm's requeue or scancel, a plain kill): stop every process tree, then exit."""


def _on_sigterm(signum, frame):
    raise _Stopped()


def _workdir(given: Optional[str], recipe: str, kill: str) -> tuple[Path, Optional[str]]:
    """The work directory (``--workdir`` or a new temporary one) and, when it holds an earlier
    attempt that ``--kill none`` continues, the checkpoint that attempt left (None: none yet)."""
    workdir = Path(given).resolve() if given else Path(tempfile.mkdtemp(prefix=f"rehearse-{recipe}-"))
    if not (workdir.exists() and any(workdir.iterdir())):
        return workdir, None
    if kill != "none" or not (workdir / "shared" / "run").is_dir():
        raise RehearsalError(f"--workdir {workdir} is not empty: a rehearsal starts from nothing (only --kill "
                             "none continues an earlier attempt of itself there)")
    latest = workdir / "shared" / "run" / "checkpoints" / "latest"
    resumed_from = latest.read_text().strip() if latest.is_file() else None
    print(f"continuing the rehearsal in {workdir}: an earlier attempt was stopped (a requeued job?); the run "
          f"resumes from {resumed_from or 'its start (no checkpoint yet)'}")
    return workdir, resumed_from


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="rehearse", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="the recipe's YAML (examples/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value applied after the substitutions")
    ap.add_argument("--workdir", default=None, help="where nodes, fleet and shared/ go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the whole work directory after success (default: its logs, metrics and configs only)")
    ap.add_argument("--steps", type=int, default=8, help="total steps (default 8)")
    ap.add_argument("--kill-after", type=int, default=4, help="checkpoint after this step, then SIGKILL node 1")
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on each phase, seconds")
    ap.add_argument("--kill", choices=("node", "worker", "node+worker", "none"), default="node",
                    help="node: SIGKILL node 1 after the checkpoint, then relaunch both nodes; worker: one worker "
                         "SIGKILLs itself after it, torchrun (MAX_RESTARTS=1) restarts the group by itself; "
                         "node+worker: both, the worker in the relaunched run; none: nothing killed here (stopped "
                         "from outside, e.g. a Slurm requeue: the same command on the same --workdir resumes)")
    a = ap.parse_intermixed_args(argv)
    if not 0 < a.kill_after < a.steps:
        ap.error(f"--kill-after={a.kill_after} must be between 0 and --steps={a.steps}")
    config = Path(a.config).resolve()
    recipe = config.stem
    t0 = time.monotonic()
    try:
        scripts = find_scripts(config)
        workdir, resumed_from = _workdir(a.workdir, recipe, a.kill)
        workdir.mkdir(parents=True, exist_ok=True)
        family = family_of(load_config(config))
        tb = load_standin("tiny_base")
        cache = os.path.expanduser(load_config(config).model.tiny_cache_dir)
        model_dir = str(tb.ensure_tiny_base(cache, spec=tb.TinyBaseSpec(model=tb.TinyModelSpec(family=family)),
                                            progress=False))
        teacher_dir = ""
        if load_config(config).algo.distill.coef > 0:
            spec = tb.TinyBaseSpec(model=tb.TinyModelSpec(family=TEACHER_FAMILY[family]))
            teacher_dir = str(tb.ensure_tiny_base(cache, spec=spec, progress=False))
        router_port = free_port()
        p = plan(config, shared=workdir / "shared", model_dir=model_dir, family=family, steps=a.steps,
                 kill_after=a.kill_after, extra=a.overrides,
                 router_addr=f"http://127.0.0.1:{router_port}", teacher_dir=teacher_dir)
        print(f"rehearsal of {recipe} ({config}) in {workdir}")
        for k, (v, why) in p.overrides.items():
            print(f"  {k}={v}  # {why}")
        for x in p.extra:
            print(f"  {x}  # given on the command line")
        print(f"  staleness: {p.stale_k_note}")
        pc = p.cfg.parallel
        ep = (f" EP={pc.expert_parallel} ETP={pc.expert_tensor_parallel or pc.tensor_parallel}"
              if family == "qwen3_moe" else "")
        kept = (f"TP={pc.tensor_parallel} PP={pc.pipeline_parallel}{f' CP={pc.context_parallel}' if pc.context_parallel > 1 else ''}{ep} "
                f"sequence_parallel={pc.sequence_parallel} "
                f"recompute={pc.recompute} distributed_optimizer={pc.use_distributed_optimizer} "
                f"packing={pc.packing} max_tokens_per_microbatch={pc.max_tokens_per_microbatch} "
                f"dtype={p.cfg.model.dtype} loss={p.cfg.algo.loss} launcher={p.cfg.rollout.launcher} "
                f"weight_sync={p.cfg.rollout.weight_sync}")
        print(f"  kept: {kept}")
        signal.signal(signal.SIGTERM, _on_sigterm)
        out = Rehearsal(p, workdir, model_dir, router_port, scripts, timeout_s=a.timeout, kill=a.kill,
                        resumed_from=resumed_from).run()
    except (RehearsalError, ValueError) as e:
        print(f"rehearsal FAILED {recipe}: {e}", file=sys.stderr)
        return 1
    except _Stopped:
        print(f"rehearsal of {recipe} stopped by SIGTERM: every process it started was stopped; the same command "
              f"with --workdir {workdir} --kill none continues it", file=sys.stderr)
        return 143
    if not a.keep and not a.workdir:
        # The logs its lines pointed to stay where they said (checkpoints, weights and stores go).
        size = prune_workdir(workdir)
        print(f"logs kept in {workdir} ({size / 2**20:.1f} MiB; --keep keeps everything, --workdir chooses where)")
    engines = ("engines=trainer-launched" if p.cfg.rollout.launcher == "local"
               else "engines=launch_sglang_fleet.sh")
    print(f"rehearsal ok {recipe} steps={out['steps']} updates={out['updates']} nodes={NODES}x{PROCS_PER_NODE} "
          f"{kept} resumed_from={out['resumed_from']} "
          f"({KILL_NOTES[a.kill] if a.kill != 'none' or out['resumed_from'] else 'not interrupted'}) "
          f"staleness={out['staleness_min']}..{out['staleness_max']} ({p.stale_k_note}) "
          f"{engines} time={time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
