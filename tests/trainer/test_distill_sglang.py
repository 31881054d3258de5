"""On-policy distillation with the teacher on SGLang engines (``algo.distill.mode=sglang``), end to end
through the CPU worker, killed in the middle of a step and resumed with the same command.

What no other test shows: the teacher engines' scores land in the store's ``teacher`` column for
every trajectory the trainer consumed, equal to an independent HF forward of the teacher over the same
tokens; the scores written before a SIGKILL are the ones the resumed run trains on (bytes unchanged,
and each step's ``distill/teacher_logprob`` is the mean of its stored values over its trained tokens);
on-policy updates keep trainer and engines equal. The teacher is the tiny base with perturbed weights
(the student's tokenizer, a different policy), built here in seconds; the scoring request itself is
held to SGLang's semantics in tests/rollout_service/test_teacher.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

import launcher

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("distill_sglang")]

STEPS, PROMPTS, U = 3, 4, 2


def _perturbed_teacher(out: Path) -> Path:
    """The tiny base's files, every float weight moved by 5 % of its own spread (fixed seed)."""
    from safetensors.torch import load_file, save_file

    from megatron_m2po.config import load_config
    from megatron_m2po.utils.hf_dir import resolve_model_path

    base = Path(resolve_model_path(load_config(str(EXAMPLE), []).model))
    shutil.copytree(base, out)
    gen = torch.Generator().manual_seed(7)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        for k, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                tensors[k] = t + 0.05 * t.float().std() * torch.randn(t.shape, generator=gen).to(t.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return out


def _teacher_column(db: Path) -> dict[str, tuple[str, bytes | None]]:
    c = sqlite3.connect(str(db))
    try:
        return {uid: (gid, blob) for uid, gid, blob in c.execute(
            "SELECT t.uid, g.group_id, t.teacher FROM trajectories t JOIN groups g ON g.seq=t.group_seq "
            "WHERE g.state='consumed'")}
    finally:
        c.close()


def test_teacher_scores_are_stored_exact_and_survive_a_kill(tmp_path):
    teacher = _perturbed_teacher(tmp_path / "teacher")
    run = tmp_path / "run"
    argv = ["train", str(EXAMPLE), f"trainer.run_dir={run}", f"trainer.num_steps={STEPS}",
            f"trainer.prompts_per_step={PROMPTS}", f"trainer.prompts_per_update={PROMPTS // U}", "trainer.mode=sync",
            "rollout.num_engines=1", "rollout.n_samples_per_prompt=4", "logging.progress=false",
            "checkpoint.export_hf_at_end=false", "checkpoint.save_every_steps=1", "trainer.eval_every_steps=0",
            f"algo.distill.teacher={teacher}", "algo.distill.coef=1", "algo.distill.mode=sglang"]
    env = launcher.base_env(M2PO_FAULT=f"train_update@{U + 1}")  # step 2's first update: its lease is open
    rc, log = launcher.run_cli(argv, log=tmp_path / "first.log", env=env)
    assert rc == -signal.SIGKILL and "m2po fault point train_update" in log, log[-3000:]
    db = run / "rollouts.sqlite"
    c = sqlite3.connect(str(db))
    before = dict(c.execute("SELECT uid, teacher FROM trajectories WHERE teacher IS NOT NULL"))
    c.close()
    # step 2's groups were leased and scored when the kill came
    assert sum(u.startswith("s000001") for u in before) == PROMPTS * 4, sorted(before)[:5]

    rc, log = launcher.run_cli(argv, log=tmp_path / "second.log", env=launcher.base_env())
    assert rc == 0, log[-5000:]
    stored = _teacher_column(db)
    assert len(stored) == STEPS * PROMPTS * 4 and all(b is not None for _, b in stored.values())
    assert all(stored[u][1] == b for u, b in before.items()), "a resumed step rescored what was stored"

    # the stored values are the teacher's: an independent HF forward of the same tokens
    from transformers import AutoModelForCausalLM

    from megatron_m2po.store import sqlite as store_db

    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    c = sqlite3.connect(str(db))
    try:
        seqs = [seq for (seq,) in c.execute("SELECT seq FROM groups WHERE state='consumed' ORDER BY seq")]
        trajs = {t.uid: t for g in store_db.load_groups(c, seqs) for t in g.trajectories}
    finally:
        c.close()
    worst = 0.0
    for t in trajs.values():
        ids = torch.tensor(np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64))[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        p = t.prompt_ids.size
        ref = lp[p - 1:-1].gather(1, ids[0, p:, None])[:, 0].numpy()
        worst = max(worst, float(np.abs(ref - t.teacher_logprobs).max()))
    assert worst < 1e-4, worst

    # each step trained on its stored numbers; on-policy updates keep trainer and engines equal
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {int(r["train/step"]): r for r in recs if "train/step" in r}
    assert sorted(steps) == list(range(STEPS))
    for s, r in steps.items():
        mine = [t for t in trajs.values() if t.group_id.startswith(f"s{s:06d}")]
        tea = np.concatenate([t.teacher_logprobs[t.loss_mask > 0] for t in mine]).astype(np.float64)
        beh = np.concatenate([t.behav_logprobs[t.loss_mask > 0] for t in mine]).astype(np.float64)
        assert r["distill/teacher_logprob"] == pytest.approx(tea.mean(), abs=1e-5)
        assert r["distill/reverse_kl"] == pytest.approx((beh - tea).mean(), abs=1e-5)
    onpolicy = [r["update/policy/kl_k3"] for r in recs if r.get("update/staleness/max") == 0]
    assert onpolicy and max(onpolicy) < 1e-5, onpolicy
