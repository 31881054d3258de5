"""`m2po convert`: HF -> Megatron checkpoint -> HF is bit-exact, through the CLI entry points."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "actor"))  # actor_testlib
import actor_testlib as lib  # noqa: E402
from megatron_m2po.standins.dist_testing import run_distributed


def _convert(rank, world_size, root):
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False  # see test_actor._checkpoint_resume
    from megatron_m2po.cli import main

    hf = lib.make_tiny_hf("qwen3", os.path.join(root, "hf"), seed=21)
    ck, out = os.path.join(root, "ck"), os.path.join(root, "out")
    rc1 = main(["convert", "hf-to-mcore", "--hf", hf, "--out", os.path.join(ck, "init")])
    torch.distributed.barrier()
    rc2 = main(["convert", "mcore-to-hf", "--ckpt", ck, "--out", out])
    a, b = lib.read_safetensors_dir(hf), lib.read_safetensors_dir(out)
    return rc1, rc2, sorted(set(a) ^ set(b)), all(torch.equal(a[k], b[k]) for k in a)


def test_convert_roundtrip_is_bit_exact(tmp_path):
    (res,) = run_distributed(_convert, 1, args=(str(tmp_path),), timeout_s=150)
    assert res == (0, 0, [], True)
