"""Contract of the loss registry: a loss registered by a plugin module (``algo.plugins``) is chosen
by ``algo.loss``, gets its own settings (``algo.loss_options``) and trains through the real
MegatronActor; misspelt losses and plugins that fail to import are clear config errors."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_m2po.config import ConfigError, load_config
from megatron_m2po.standins.dist_testing import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "actor"))  # actor_testlib

PLUGIN = ["algo.plugins=loss_plugin_example", "algo.loss=scaled_pg_example"]


def test_plugin_loss_is_registered_with_its_settings():
    cfg = load_config(None, PLUGIN + ["algo.loss_options.scale=2.5"])
    from megatron_m2po.algo.losses import LOSSES, loss_settings

    spec = LOSSES["scaled_pg_example"]
    assert cfg.algo.loss == "scaled_pg_example" and cfg.algo.plugins == ["loss_plugin_example"]
    assert loss_settings(spec, cfg.algo).scale == 2.5
    assert not spec.needs_global_mask_prepass(loss_settings(spec, cfg.algo))
    with pytest.raises(ConfigError, match=r"unknown config key algo\.loss_options\.scael; did you mean "
                                          r"algo\.loss_options\.scale"):
        load_config(None, PLUGIN + ["algo.loss_options.scael=2"])
    with pytest.raises(ConfigError, match=r"algo\.loss_options\.scale=-1\.0 is out of range: must be > 0\.0"):
        load_config(None, PLUGIN + ["algo.loss_options.scale=-1"])


def test_misspelt_loss_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"algo\.loss='grop': unknown policy loss 'grop'; available: .*"
                                          r"did you mean 'grpo'\?"):
        load_config(None, ["algo.loss=grop"])
    # a plugin loss without its plugin: the message says where plugin losses come from
    with pytest.raises(ConfigError, match=r"needs that module in algo\.plugins"):
        load_config(None, ["algo.loss=not_registered_anywhere"])


def test_plugin_that_fails_to_import(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"algo\.plugins: cannot import 'no_such_pkg\.losses' "
                                          r"\(ModuleNotFoundError"):
        load_config(None, ["algo.plugins=no_such_pkg.losses"])
    (tmp_path / "broken_loss_plugin.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot import 'broken_loss_plugin' \(RuntimeError: boom at import\)"):
        load_config(None, ["algo.plugins=broken_loss_plugin"])


def _train_with_plugin_loss(rank, world_size, root):
    import actor_testlib as lib
    import loss_plugin_example

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    d = os.path.join(root, "qwen2")
    lib.make_tiny_hf("qwen2", d, seed=3)
    out = {}
    for scale in (1.0, 2.0):
        cfg = load_config(None, PLUGIN + [
            f"algo.loss_options.scale={scale}", f"model.hf_path={d}", "parallel.micro_batch_size=2",
            "optim.lr=1e-3", "optim.weight_decay=0.0", "rollout.temperature=1.0"])
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=1))
        samples = lib.make_samples(4, seed=5)
        for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):
            s.behav_logprobs = (lp + 0.3 * np.random.default_rng(0).standard_normal(lp.shape)).astype(np.float32)
        before = {k: v.clone() for k, v in actor.iter_hf_weights()}
        calls = len(loss_plugin_example.CALLS)
        rec = lib.Recorder(actor)
        (m,) = actor.train_step(RolloutBatch(samples), 1)
        moved = max(float((v - before[k]).abs().max()) for k, v in actor.iter_hf_weights())
        out[scale] = (m, moved, len(loss_plugin_example.CALLS) - calls,
                      [r.strategy for r in rec.updates[0]])
        actor.close()
    return out


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_plugin_loss_trains_one_step_through_the_actor(tmp_path):
    (out,) = run_distributed(_train_with_plugin_loss, 1, args=(str(tmp_path),), timeout_s=180)
    for scale, (m, moved, calls, strategies) in out.items():
        assert calls == 2, (scale, calls)  # 4 samples, micro-batch 2: the plugin ran on both micro-batches
        # weights changed; no global mask (no pre-pass) for a loss that needs none, in both micro-batches
        assert moved > 0 and strategies == [None, None], (moved, strategies)
        assert m["example/scale"] == scale and not any(k.startswith("m2po/") for k in m)
    # the loss read its own setting: same data and weights, twice the scale -> twice the loss
    assert out[2.0][0]["loss/policy"] == pytest.approx(2 * out[1.0][0]["loss/policy"], rel=1e-5)


def test_the_torch_free_table_of_built_in_losses_is_the_registry():
    """Config validation of a built-in loss without plugins reads loss_settings.BUILTIN_LOSS_SETTINGS
    (so `m2po config` / `m2po plan` import no torch): the same names and settings classes as the
    registry's built-ins, and a config naming one validates without importing torch."""
    import subprocess
    import sys

    from megatron_m2po.algo import losses
    from megatron_m2po.algo.loss_settings import BUILTIN_LOSS_SETTINGS

    builtin = {name: spec.settings for name, spec in losses.LOSSES.items()
               if spec.objective.__module__ in ("megatron_m2po.algo.losses", "megatron_m2po.algo.offpolicy_losses")}
    assert BUILTIN_LOSS_SETTINGS == builtin
    code = ("import sys; from megatron_m2po.config import load_config; "
            "[load_config('examples/tiny_cpu.yaml', [f'algo.loss={n}']) for n in sys.argv[1:]]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code, *BUILTIN_LOSS_SETTINGS], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert r.returncode == 0, r.stderr
