"""The offline drift (experiment/drift.py) in miniature: two checkpoints of a tiny model written by
the actor, read back by one actor and exported to HF bit-exactly; KL of a policy against itself is
exactly 0 and against a moved one positive; a k without checkpointed pairs is refused by name."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "actor"))
import actor_testlib as lib  # noqa: E402
from megatron_m2po.experiment.drift import checkpoint_versions, response_kl, run_drift  # noqa: E402
from megatron_m2po.standins.dist_testing import run_distributed  # noqa: E402


def _write_checkpoints(root):
    """``m2po convert hf-to-mcore`` of a and b, as an on-policy run's checkpoints at versions 0 and 8."""
    for name, version in (("a", 0), ("b", 8)):
        out = os.path.join(root, "run", "checkpoints", f"step_{version:06d}")
        r = subprocess.run([sys.executable, "-m", "megatron_m2po.cli", "convert", "hf-to-mcore", "--hf",
                            os.path.join(root, name), "--out", out], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        meta = json.loads(open(os.path.join(out, "actor.json")).read())
        meta["version"] = version  # an on-policy run's checkpoint after `version` updates
        open(os.path.join(out, "actor.json"), "w").write(json.dumps(meta))


def _drift(rank, world_size, root, ks):
    prompts = [[5, 9, 14, 3], [7, 2, 11, 30, 4], [1, 2, 3]]
    return run_drift(os.path.join(root, "run"), ks, every=8, prompts=prompts, samples=2, seed=0,
                     max_new_tokens=6, out_dir=os.path.join(root, "drift"))


@pytest.mark.slow  # two `m2po convert` runs, an actor and sampling: an end-to-end run of the command
def test_drift_from_checkpoints(tmp_path):
    from pathlib import Path

    lib.make_tiny_hf("qwen2", str(tmp_path / "a"), seed=1)
    b = lib.make_tiny_hf("qwen2", str(tmp_path / "b"), seed=1)
    from safetensors.torch import load_file, save_file  # b: a moved a little, as 8 updates would

    f = next(Path(b).glob("*.safetensors"))
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(2)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}, str(f),
              metadata={"format": "pt"})
    _write_checkpoints(str(tmp_path))
    assert sorted(checkpoint_versions(tmp_path / "run" / "checkpoints")) == [0, 8]
    (res,) = run_distributed(_drift, 1, args=(str(tmp_path), [8]), timeout_s=180)
    (row,) = res["k"]["8"]["pairs"]
    assert row["v"] == 8 and row["tokens"] > 0 and row["kl"] > 0
    # the exports are the models the checkpoints were written from
    for name, v in (("a", 0), ("b", 8)):
        want = load_file(str(next((tmp_path / name).glob("*.safetensors"))))
        got = {}
        for p in (tmp_path / "drift" / "hf" / f"v{v}").glob("*.safetensors"):
            got.update(load_file(str(p)))
        assert all(torch.equal(got[k], want[k]) for k in want), name
    # a policy against itself: every sampled token's log-ratio is exactly 0
    a = tmp_path / "drift" / "hf" / "v0"
    kl, n = response_kl(a, a, [[5, 9, 14, 3]], samples=3, seed=1, max_new_tokens=5)
    assert n > 0 and kl == 0.0
    assert json.loads((tmp_path / "drift" / "drift.json").read_text())["k"]["8"]["mean_kl"] == row["kl"]
    with pytest.raises(Exception, match=r"no version pair v, v - k is checkpointed for k in \[4\]"):
        run_distributed(_drift, 1, args=(str(tmp_path), [4]), timeout_s=60)
