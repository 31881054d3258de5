"""The Qwen2.5-32B recipe rehearsed end to end on CPU through the script its users run:
``scripts/run_qwen2.5_32b.sh --rehearse`` -- 2 simulated nodes x 2 processes (torchrun via
scripts/train.sh, each node in its own working directory), CPU engines started by
scripts/launch_sglang_fleet.sh behind the real sglang-router, the trainer attached by
``rollout.router_addr`` alone; node 1 is SIGKILLed after the step-4 checkpoint and the run
resumes from it; in the resumed run a worker dies too and torchrun restarts the group. The recipe
runs context parallel, so this rehearses CP=2 (x TP=2). The other recipes' rehearsals run by hand
(same command, their script)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from leftovers import Tree
from megatron_m2po.rehearsal import family_of, plan
from megatron_m2po.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _script_env() -> dict[str, str]:
    """The environment a launch script gets here: this Python (``PYTHON``; scripts/train.sh would
    otherwise take the checkout's ``.venv`` or ``python3``, not the interpreter running the suite)
    and this checkout on ``PYTHONPATH``."""
    return {**os.environ, "PYTHON": sys.executable,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_qwen25_32b_recipe_rehearsal_survives_a_node_and_then_a_worker(tmp_path):
    """``scripts/run_qwen2.5_32b.sh --rehearse --kill node+worker``, shortened to 4 steps: node 1 is
    SIGKILLed after the step-2 checkpoint, node 0 stops on its own, both nodes are relaunched and
    resume from it; the two steps after the resume train at the rehearsal's full staleness (8..11).

    In the relaunched run (scripts/train.sh with MAX_RESTARTS=1: torchrun --max-restarts, c10d
    rendezvous) global rank 3 also SIGKILLs itself after its first step, and torchrun restarts both
    nodes' workers, which resume from the same checkpoint and finish with nobody relaunching
    anything. Without a fresh store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, set by train.sh)
    the restarted workers read the dead group's peer addresses and fail ("Gloo connectFullMesh
    failed ... Connection refused"). Nothing outlives the rehearsal: not the killed worker's
    Megatron checkpoint writer (docs/design.md §5, "Nothing outlives the trainer"), nor anything
    else its tree started. (One rehearsal for both kills: the worker kill was a rehearsal of its
    own, ``--kill worker``, which stays available.)"""
    work = tmp_path / "rehearsal"
    env = _script_env()
    for k in ("MODEL_PATH", "DATA_TRAIN", "ROUTER_ADDR", "RUN_DIR", "MAX_RESTARTS", "M2PO_FAULT"):
        env.pop(k, None)
    tree = Tree(env)
    try:
        proc = tree.run(["bash", str(ROOT / "scripts" / "run_qwen2.5_32b.sh"), "--rehearse", "--workdir", str(work),
                         "--steps", "4", "--kill-after", "2", "--kill", "node+worker"], cwd=tmp_path, timeout=1400)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        last = proc.stdout.strip().splitlines()[-1]
        # the recipe runs context parallel (TP=4 x CP=2 x PP=2 at 16k): rehearsed as TP=2 x CP=2
        assert last.startswith("rehearsal ok qwen2.5-32b steps=4 updates=16 nodes=2x2 TP=2 PP=1 CP=2"), last
        par = load_config(ROOT / "examples" / "qwen2.5-32b.yaml").parallel  # the recipe's features, kept
        assert (f"sequence_parallel=True recompute={par.recompute} distributed_optimizer=True packing={par.packing} "
                f"max_tokens_per_microbatch={par.max_tokens_per_microbatch} dtype=bfloat16") in last, last
        assert "launcher=external" in last
        assert "resumed_from=step_000002 (node 1 SIGKILLed after it, then a worker, torchrun restarted the group)" \
            in last and "staleness=0..11" in last, last  # steps 2-3 at 8..11
        # Nothing shared between the nodes but the shared directory; both nodes ran in their own.
        assert sorted(p.name for p in work.iterdir()) == ["fleet", "node0", "node1", "shared"]
        assert not (work / "node0" / "runs").exists() and not (work / "node1" / "runs").exists()
        logs = "".join(p.read_text(errors="replace") for p in work.glob("node*/train_2.log"))
        assert "m2po fault point worker_dies@1: SIGKILL to process" in logs
        # rank 0 of the relaunched group, then of the group torchrun restarted
        assert logs.count("INFO megatron_m2po.trainer.loop: resumed from") == 2
        tree.wait_gone("the rehearsal finished", timeout=30)
    finally:
        tree.kill()


def test_rehearsal_plan_keeps_the_recipe_and_names_each_substitution(tmp_path):
    # recipes with context parallelism (the 32B ones) are rehearsed at TP=2 x CP=2, PP=1
    for name, family, pp in (("qwen2.5-32b", "qwen2", 1), ("qwen2.5-32b-32k", "qwen2", 1), ("qwen3-32b", "qwen3", 1),
                             ("qwen3-8b", "qwen3", 1), ("qwen2.5-math-7b", "qwen2", 1)):
        path = ROOT / "examples" / f"{name}.yaml"
        recipe = load_config(path)
        assert family_of(recipe) == family
        p = plan(path, shared=tmp_path / "shared", model_dir="/tiny", family=family, steps=8, kill_after=4,
                 extra=[], router_addr="http://127.0.0.1:1")
        c = p.cfg
        assert (c.parallel.tensor_parallel, c.parallel.pipeline_parallel) == (2, pp)
        assert c.parallel.context_parallel == (2 if recipe.parallel.context_parallel > 1 else 1), name
        for key in ("sequence_parallel", "recompute", "use_distributed_optimizer", "micro_batch_size", "packing",
                    "max_tokens_per_microbatch", "balance_data_parallel"):
            assert getattr(c.parallel, key) == getattr(recipe.parallel, key), (name, key)
        assert (c.model.dtype, c.algo, c.optim, c.reward) == (recipe.model.dtype, recipe.algo, recipe.optim,
                                                               recipe.reward)
        assert c.data.template == recipe.data.template
        # Engines are started as the recipe starts them: by the trainer (local) or beside it (external).
        assert c.rollout.launcher == recipe.rollout.launcher
        if recipe.rollout.launcher == "local":
            assert (c.rollout.engine, c.rollout.engine_gpu_ids, c.rollout.router_addr) == ("cpu_worker", [], None)
        else:
            assert c.rollout.router_addr == "http://127.0.0.1:1"
        U = recipe.trainer.num_updates_per_step
        assert c.trainer.num_updates_per_step == U and c.trainer.stale_k == 2 * U
        assert c.store.max_staleness == 3 * U - 1
        assert Path(c.trainer.run_dir).is_absolute() and Path(c.trainer.run_dir).parent == tmp_path / "shared"
        assert all(why for _, why in p.overrides.values())


def test_distillation_recipe_rehearsal_plan_substitutes_the_teacher(tmp_path):
    """The distillation recipe keeps its distillation (coef, mode, placement) with the tiny base of
    another family standing in for its teacher (the student's tokenizer, other weights), named as
    a substitution; without a stand-in teacher the plan refuses."""
    from megatron_m2po.rehearsal import TEACHER_FAMILY, RehearsalError

    path = ROOT / "examples" / "qwen3-8b-distill.yaml"
    recipe = load_config(path)
    assert family_of(recipe) == "qwen3" and TEACHER_FAMILY["qwen3"] == "qwen2" and recipe.algo.distill.coef > 0
    p = plan(path, shared=tmp_path / "shared", model_dir="/tiny", family="qwen3", steps=8, kill_after=4,
             extra=[], router_addr="http://127.0.0.1:1", teacher_dir="/tiny-teacher")
    d = p.cfg.algo.distill
    assert (d.teacher, d.coef, d.mode, d.placement) == ("/tiny-teacher", recipe.algo.distill.coef,
                                                        recipe.algo.distill.mode, recipe.algo.distill.placement)
    assert "stands in for /models/Qwen3-32B" in p.overrides["algo.distill.teacher"][1]
    with pytest.raises(RehearsalError, match="needs a teacher_dir"):
        plan(path, shared=tmp_path / "shared", model_dir="/tiny", family="qwen3", steps=8, kill_after=4,
             extra=[], router_addr="http://127.0.0.1:1")


def test_rehearsal_plan_with_context_parallel(tmp_path):
    """A recipe rehearsed with context parallelism runs TP=2 x CP=2 over the 4 processes (PP=1),
    the recipe's other features kept; the CP size is named as a substitution."""
    path = ROOT / "examples" / "qwen2.5-32b.yaml"
    recipe = load_config(path)
    p = plan(path, shared=tmp_path / "shared", model_dir="/tiny", family="qwen2", steps=8, kill_after=4,
             extra=["parallel.context_parallel=4"], router_addr="http://127.0.0.1:1")
    c = p.cfg.parallel
    assert (c.tensor_parallel, c.pipeline_parallel, c.context_parallel) == (2, 1, 2)
    assert (c.sequence_parallel, c.packing, c.cp_comm_type) == (recipe.parallel.sequence_parallel,
                                                                recipe.parallel.packing, "p2p")
    assert "parallel.context_parallel" in p.overrides and p.overrides["parallel.context_parallel"][1]


def test_moe_recipe_rehearsal_plan_keeps_expert_parallelism(tmp_path):
    """The Qwen3-30B-A3B recipe (EP=8) is rehearsed with the tiny Qwen3-MoE at EP=2: TP=2 (the recipe
    has TP), whole experts (the recipe's expert_tensor_parallel=1), PP=2 (the recipe pipelines; etp x
    EP x PP = 4 divides the 4 processes), no virtual stages (none in the recipe); each substitution
    named."""
    path = ROOT / "examples" / "qwen3-30b-a3b.yaml"
    recipe = load_config(path)
    assert family_of(recipe) == "qwen3_moe"
    p = plan(path, shared=tmp_path / "shared", model_dir="/tiny", family="qwen3_moe", steps=8, kill_after=4,
             extra=[], router_addr="http://127.0.0.1:1")
    c = p.cfg.parallel
    assert (c.tensor_parallel, c.pipeline_parallel, c.expert_parallel, c.expert_tensor_parallel,
            c.virtual_pipeline_parallel) == (2, 2, 2, 1, None)
    for key in ("sequence_parallel", "recompute", "use_distributed_optimizer", "packing", "max_tokens_per_microbatch",
                "moe_token_dispatcher"):
        assert getattr(c, key) == getattr(recipe.parallel, key), key
    for key in ("parallel.expert_parallel", "parallel.expert_tensor_parallel"):
        assert p.overrides[key][1], key
    assert recipe.parallel.virtual_pipeline_parallel is None and "parallel.virtual_pipeline_parallel" not in p.overrides
    assert p.cfg.model.moe == recipe.model.moe and p.cfg.rollout.launcher == "external"
    # the names a Qwen3 MoE goes by; dense Qwen3 stays dense
    for name, fam in (("/m/Qwen3-30B-A3B", "qwen3_moe"), ("/m/Qwen3-235B-A22B-Instruct-2507", "qwen3_moe"),
                      ("/m/qwen3-moe-tiny", "qwen3_moe"), ("/m/Qwen3-32B", "qwen3"), ("/m/Qwen3-8B-Base", "qwen3")):
        assert family_of(load_config(None, [f"model.hf_path={name}"])) == fam, name


def test_a_rehearsal_that_passed_keeps_the_logs_it_pointed_to(tmp_path):
    """Without --keep a passed rehearsal used to delete its whole temporary work directory, logs
    included, after printing where they were; now only what its lines never pointed to goes."""
    from megatron_m2po.rehearsal import prune_workdir

    kept = ["fleet.log", "train_0.log", "train_1.log", "logs/router.out", "logs/engine_0.log",
            "shared/run/engines/engine_0.log", "shared/run/metrics.jsonl", "shared/run/config.yaml"]
    gone = ["shared/run/checkpoints/step_000004/__0_0.distcp", "shared/run/checkpoints/latest",
            "shared/run/rollouts.sqlite", "shared/run/trace.json", "shared/weights/v1/model.safetensors"]
    for rel in kept + gone:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "node0").mkdir()
    size = prune_workdir(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == sorted(kept)
    assert size == sum(len(rel) for rel in kept)
    assert not (tmp_path / "shared" / "weights").exists() and not (tmp_path / "node0").exists()
