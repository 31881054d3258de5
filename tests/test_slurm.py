"""scripts/slurm/m2po.sbatch: what each node of a Slurm job runs, derived from Slurm's variables.

Slurm's two commands the script calls are replaced on PATH by stand-ins that do what the real ones
do for these calls (Slurm 22.05 man pages): ``scontrol show hostnames LIST`` prints one host a
line; ``srun --ntasks=N ... CMD ARGS`` runs CMD once per task with that task's ``SLURM_PROCID``
(0..N-1, one task per node in node order with ``--ntasks-per-node=1``). train.sh's torchrun is a
recorder (``TORCHRUN``), so each node's torchrun command line is checked exactly as
tests/test_scripts.py checks a single node's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "scripts" / "slurm" / "m2po.sbatch"

SRUN = r'''#!/usr/bin/env bash
# srun stand-in: every option is --name=value; the command follows them; one run per task.
n=1
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
  case "$1" in --ntasks=*) n=${1#--ntasks=} ;; esac
  printf '%s\n' "$1" >> "$SRUN_LOG"
  shift
done
printf -- '-- %s\n' "$1" >> "$SRUN_LOG"
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_NODEID=$i "$@" || exit $?; done
'''


def _slurm_env(tmp_path: Path, hosts: list[str], **kw) -> dict[str, str]:
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "scontrol").write_text("#!/usr/bin/env bash\n[ \"$1 $2\" = 'show hostnames' ] || exit 1\n"
                                   f"printf '%s\\n' {' '.join(hosts)}\n")
    (bin_ / "srun").write_text(SRUN)
    rec = tmp_path / "torchrun"
    rec.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path}/argv.$NODE_RANK\n')
    for f in (bin_ / "scontrol", bin_ / "srun", rec):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "MASTER_",
                                                                      "ROUTER_ADDR", "ROLLOUT_NODES", "GPUS_PER"))}
    env.update(PATH=f"{bin_}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, TORCHRUN=str(rec),
               SLURM_JOB_NODELIST=f"node[0-{len(hosts) - 1}]", SLURM_JOB_NUM_NODES=str(len(hosts)),
               SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(REPO), SRUN_LOG=str(tmp_path / "srun.log"))
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _sbatch(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)


def test_each_training_node_runs_torchrun_with_its_rank_from_slurm(tmp_path):
    """Two nodes, the 32B recipe: one srun task a node, NODE_RANK from the task's SLURM_PROCID,
    NNODES and MASTER_ADDR (the first node) from the job's node list; the recipe's overrides go
    through unchanged to every node."""
    env = _slurm_env(tmp_path, ["node0", "node1"])
    r = _sbatch(tmp_path, env, "scripts/run_qwen2.5_32b.sh", "trainer.num_steps=7")
    assert r.returncode == 0, r.stdout + r.stderr
    srun = (tmp_path / "srun.log").read_text().splitlines()
    assert "--ntasks=2" in srun and "--ntasks-per-node=1" in srun and "--nodelist=node0,node1" in srun
    assert "--kill-on-bad-exit=1" in srun and not any(s.startswith("--container") for s in srun)
    for rank in (0, 1):
        argv = (tmp_path / f"argv.{rank}").read_text().splitlines()
        i = argv.index
        assert argv[i("--nnodes") + 1] == "2" and argv[i("--node-rank") + 1] == str(rank)
        assert argv[i("--rdzv-endpoint") + 1] == "node0:29500" and argv[i("--nproc-per-node") + 1] == "8"
        assert argv[-2:] == [str(REPO / "examples" / "qwen2.5-32b.yaml"), "trainer.num_steps=7"]


def test_rollout_nodes_run_the_fleet_and_the_trainer_attaches_to_its_router(tmp_path):
    """ROLLOUT_NODES=1 of 3: the first node runs launch_sglang_fleet.sh (with the router), the other
    two train with MASTER_ADDR = the first training node and ROUTER_ADDR = the fleet's router; the
    dry run prints what every node runs, then the recipe's own dry run; a pyxis image adds the
    container flags to every step."""
    env = _slurm_env(tmp_path, ["n0", "n1", "n2"], ROLLOUT_NODES=1, CONTAINER_IMAGE="/images/m2po.sqsh",
                     CONTAINER_MOUNTS="/models:/models")
    r = _sbatch(tmp_path, env, "--dry-run", "scripts/run_qwen2.5_32b.sh", "trainer.num_steps=7")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "# rollout nodes (1): n0; router at http://n0:29999" in out
    fleet = shlex.split([ln for ln in out.splitlines() if ln.startswith("fleet: ")][0][len("fleet: "):])
    assert fleet[0] == "srun" and "--nodelist=n0" in fleet and str(REPO / "scripts/launch_sglang_fleet.sh") in fleet
    assert "--container-image=/images/m2po.sqsh" in fleet and "--container-mounts=/models:/models" in fleet
    train = shlex.split([ln for ln in out.splitlines() if ln.startswith("train: ")][0][len("train: "):])
    assert "--nodelist=n1,n2" in train and "--ntasks=2" in train and "--container-image=/images/m2po.sqsh" in train
    assert "node 1 (n2): NODE_RANK=1 NNODES=2 MASTER_ADDR=n1" in out
    # the recipe's dry run as node 0 prints it: the router address reached the trainer's config
    assert "rollout.router_addr=http://n0:29999" in out and "OK: worst stage" in out
    assert not list(tmp_path.glob("argv.*"))  # nothing launched


@pytest.mark.parametrize("case,env,args,said", [
    ("no allocation", {"SLURM_JOB_NODELIST": ""}, ["scripts/run_qwen3_8b.sh"], "no Slurm allocation"),
    ("no recipe", {}, ["scripts/run_nothing.sh"], "recipe"),
    ("all rollout", {"ROLLOUT_NODES": "2"}, ["scripts/run_qwen3_8b.sh"], "leaves no training node"),
])
def test_mistakes_are_one_line(tmp_path, case, env, args, said):
    r = _sbatch(tmp_path, _slurm_env(tmp_path, ["a", "b"], **env), *args)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, (case, r.stderr)


REHEARSAL = ["scripts/run_qwen3_30b_a3b.sh", "--rehearse", "--kill", "none", "--steps", "4", "--kill-after", "2"]


@pytest.mark.slow  # a recipe rehearsal, stopped after its step-2 checkpoint and run again
@pytest.mark.timeout(1500)
def test_moe_recipe_rehearsal_requeued_as_a_slurm_job_resumes_from_its_checkpoint(tmp_path):
    """The Qwen3-30B-A3B recipe's rehearsal (the tiny Qwen3-MoE at TP=2 x PP=2 with EP=2 and whole
    experts over 2 x 2 processes, CPU engines from the fleet script), submitted to a real local
    Slurm (tests/slurm_local.py: slurmctld, one slurmd, munge) as ``sbatch scripts/slurm/m2po.sbatch
    scripts/run_qwen3_30b_a3b.sh --rehearse --kill none``. Once its step-2 checkpoint exists the job
    is requeued (``scontrol requeue``: Slurm stops it with SIGTERM, as for a failed node under
    --requeue); the rehearsal stops every process it started, Slurm runs the same command again, and
    it resumes from the newest checkpoint (step 2's, or step 3's when the stop reached the trainer
    during step 3, which it finishes and saves first) at the same layout (a full resume needs the EP
    it was saved with, actor/checkpoint.py) and ends ``rehearsal ok``. Where no local Slurm can run (not root, no
    slurm-wlm) the same stop and rerun happen by hand (SIGTERM, the same command), so the rehearsal's
    own claims are proven either way. (This was the separate 30B-A3B rehearsal with a node SIGKILLed;
    the node kill stays rehearsed by the 32B recipe's, tests/test_rehearsal.py.)"""
    from slurm_local import LocalSlurm, missing
    from waiting import wait_until

    work, out = tmp_path / "rehearsal", tmp_path / "job.out"
    latest = work / "shared" / "run" / "checkpoints" / "latest"
    args = [*REHEARSAL, "--workdir", str(work)]
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "DATA_TRAIN", "ROUTER_ADDR", "RUN_DIR")}
    env.update(PYTHON=sys.executable, PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    at_checkpoint = lambda: latest.is_file() and latest.read_text().strip() == "step_000002"  # noqa: E731
    if missing() is None:
        with LocalSlurm(tmp_path / "slurm") as slurm:
            job = slurm.sbatch(["--nodes=1", f"--output={out}", str(SBATCH), *args], cwd=REPO, env=env)

            def ended(allowed=("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "COMPLETING")):
                st = slurm.job(job).get("JobState", "?")
                return None if st in allowed else f"job {job} is {st}:\n" + (
                    out.read_text(errors="replace")[-4000:] if out.exists() else slurm.logs())

            wait_until(at_checkpoint, what="the rehearsal's step-2 checkpoint", timeout=600, hopeless=ended)
            r = slurm.run("scontrol", "requeue", job)
            assert r.returncode == 0, r.stdout + r.stderr
            wait_until(lambda: slurm.job(job).get("JobState") == "COMPLETED", what=f"job {job} completed after "
                       "the requeue", timeout=900, hopeless=lambda: ended(("PENDING", "RUNNING", "CONFIGURING",
                                                                           "REQUEUED", "COMPLETING", "COMPLETED")))
            assert int(slurm.job(job).get("Restarts", 0)) == 1, slurm.job(job)
    else:  # the same stop and rerun without Slurm
        import signal

        with open(out, "wb") as f:
            first = subprocess.Popen(["bash", str(REPO / REHEARSAL[0]), *args[1:]], cwd=tmp_path, env=env,
                                     stdout=f, stderr=subprocess.STDOUT)
            try:
                wait_until(at_checkpoint, what="the rehearsal's step-2 checkpoint", timeout=600,
                           hopeless=lambda: first.poll() is not None and f"the rehearsal exited ({first.poll()})")
                first.send_signal(signal.SIGTERM)
                assert first.wait(120) == 143
            finally:
                first.kill()
            second = subprocess.run(["bash", str(REPO / REHEARSAL[0]), *args[1:]], cwd=tmp_path, env=env, stdout=f,
                                    stderr=subprocess.STDOUT, timeout=900)
        assert second.returncode == 0, out.read_text(errors="replace")[-6000:]
    text = out.read_text(errors="replace")
    assert "stopped by SIGTERM: every process it started was stopped" in text, text[-4000:]
    # The stop comes once the step-2 checkpoint exists; the trainer ends the step it is in before it
    # exits (SIGTERM: finish the step, checkpoint, exit), so the rerun resumes from step 2 or, when
    # the stop reached it during step 3, from step 3's checkpoint: whichever was the newest.
    resumed = re.search(r"resumes from (step_00000[23])\b", text)
    assert "continuing the rehearsal" in text and resumed, text[-4000:]
    ckpt = resumed.group(1)
    last = text.strip().splitlines()[-1]
    assert last.startswith("rehearsal ok qwen3-30b-a3b steps=4 updates=16 nodes=2x2 TP=2 PP=2 EP=2 ETP=1 "
                           "sequence_parallel=True recompute=none distributed_optimizer=True"), text[-4000:]
    assert f"resumed_from={ckpt}" in last and "staleness=0..11" in last, last
    assert "(an earlier attempt stopped from outside, this one resumed)" in last, last
    node0 = (work / "node0" / "train_2.log").read_text(errors="replace")
    assert f"resumed from {work / 'shared' / 'run' / 'checkpoints' / ckpt}" in node0
