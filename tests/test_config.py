import ast
from pathlib import Path

import pytest

import megatron_m2po
from megatron_m2po.config import (AgenticConfig, AlgoConfig, Config, ConfigError, ParallelConfig, RewardConfig,
                                  RolloutConfig, StoreConfig, TrainerConfig, config_to_dict, dump_config, load_config)


def test_defaults_validate():
    cfg = load_config(None)
    assert cfg.algo.loss == "m2po" and cfg.algo.m2po.threshold == 0.04
    assert cfg.trainer.num_updates_per_step == 4  # paper: 256 prompts, mini-batch 64


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  m2po:\n    threshold: 0.03\ntrainer:\n  mode: sync\n")
    cfg = load_config(p, ["algo.m2po.threshold=0.02", "rollout.external_addrs=http://a:1,http://b:2",
                          "model.hf_path=007", "algo.grpo.dual_clip=3"])
    assert cfg.algo.m2po.threshold == 0.02
    assert cfg.trainer.mode == "sync"
    assert cfg.rollout.external_addrs == ["http://a:1", "http://b:2"]
    assert cfg.model.hf_path == "007"
    assert cfg.algo.grpo.dual_clip == 3.0


def test_roundtrip_dump(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-6"])
    p = tmp_path / "d.yaml"
    p.write_text(dump_config(cfg))
    assert config_to_dict(load_config(p)) == config_to_dict(cfg)


@pytest.mark.parametrize("override, message", [
    ("algo.m2po.treshold=0.1", "did you mean algo.m2po.threshold"),
    ("algo.m2po.threshold=-0.1", "algo.m2po.threshold=-0.1 is out of range: must be >= 0.0"),
    ("trainer.mode=offpolicy", "trainer.mode='offpolicy' is not one of"),
    ("parallel.tensor_parallel=two", "parallel.tensor_parallel='two' must be an integer"),
    ("algo.tis=yes please", "algo.tis='yes please' must be true or false"),
    ("algo", "must look like section.key=value"),
    ("trainer.prompts_per_update=48", "must be a multiple of"),
    ("algo.grpo.eps_low=1.5", "algo.grpo.eps_low=1.5 is out of range: must be < 1.0"),
])
def test_bad_values_name_key_value_and_range(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("algo:\n  nope: 1\n")
    with pytest.raises(ConfigError, match="unknown config key algo.nope"):
        load_config(bad)


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, ["trainer.mode=stale_k", "trainer.stale_k=300", "store.max_staleness=256"])
    with pytest.raises(ConfigError, match="tis=true needs"):
        load_config(None, ["algo.tis=true"])
    with pytest.raises(ConfigError, match="sequence_parallel"):
        load_config(None, ["parallel.sequence_parallel=true"])


@pytest.mark.parametrize("overrides, message", [
    (["algo.routing_replay=rollout", "model.tiny_family=qwen3_moe", "rollout.use_router=false"],
     "needs rollout.return_routed_experts=true"),
    (["algo.routing_replay=rollout", "rollout.return_routed_experts=true", "rollout.use_router=false"],
     "needs an MoE model; model.hf_path=tiny with model.tiny_family='qwen2' is dense"),
    (["rollout.return_routed_experts=true"], "sglang-router 0.3.2 drops return_routed_experts"),
    (["rollout.return_routed_experts=true", "rollout.use_router=false", "rollout.router_addr=http://h:1"],
     "Set rollout.use_router=false and rollout.router_addr=null"),
])
def test_routing_replay_cross_field_checks(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, overrides)
    ok = load_config(None, ["algo.routing_replay=rollout", "rollout.return_routed_experts=true",
                            "rollout.use_router=false", "model.tiny_family=qwen3_moe", "rollout.num_engines=4"])
    assert ok.algo.routing_replay == "rollout"  # several engines: the client dispatches (rollout/dispatch.py)
    # full recompute with pipeline parallelism: the recomputes replay the backward FIFO (actor/routing_replay.py)
    ok = load_config(None, ["algo.routing_replay=rollout", "rollout.return_routed_experts=true",
                            "rollout.use_router=false", "model.tiny_family=qwen3_moe", "parallel.recompute=full",
                            "parallel.pipeline_parallel=2", "parallel.virtual_pipeline_parallel=2"])
    assert (ok.parallel.recompute, ok.parallel.pipeline_parallel) == ("full", 2)


def test_sglang_teacher_rules():
    """The teacher engines score from the raw logits: a sampling temperature other than 1 is refused by
    name; both placements at temperature 1 are accepted."""
    base = ["algo.distill.teacher=/t", "algo.distill.coef=1", "algo.distill.mode=sglang"]
    with pytest.raises(ConfigError, match="rollout.temperature=0.7: SGLang scores input tokens from the raw logits"):
        load_config(None, [*base, "rollout.temperature=0.7"])
    assert load_config(None, [*base, "algo.distill.placement=loss"]).algo.distill.placement == "loss"
    ok = load_config(None, [*base, "algo.distill.teacher_addrs=[http://t:1]"])
    assert ok.algo.distill.teacher_addrs == ["http://t:1"]


# Each section lives next to the code that reads it and checks its own fields; Config.validate adds
# only the rules that span sections.
SETTINGS_MODULES = ["actor/settings.py", "algo/settings.py", "algo/loss_settings.py", "rollout/settings.py",
                    "store/settings.py", "data/settings.py", "rewards/settings.py", "trainer/settings.py"]


@pytest.mark.parametrize("section, message", [
    (ParallelConfig(sequence_parallel=True), "parallel.sequence_parallel=true needs parallel.tensor_parallel > 1"),
    (ParallelConfig(tensor_parallel=0), "parallel.tensor_parallel=0 is out of range: must be >= 1"),
    (AlgoConfig(tis=True), "algo.tis=true needs algo.recompute_behav_logprobs=true"),
    (AlgoConfig(loss="nope"), "algo.loss='nope'"),
    (RolloutConfig(launcher="external"), "rollout.launcher=external needs rollout.external_addrs"),
    (RolloutConfig(agentic=AgenticConfig(max_turns=0)), "rollout.agentic.max_turns=0 is out of range"),
    (RewardConfig(url="http://h:1/score"), "reward.url='http://h:1/score' is only read with reward.fn=http"),
    (StoreConfig(serve_port=70000), "store.serve_port=70000 is out of range: must be <= 65535"),
    (TrainerConfig(prompts_per_step=10, prompts_per_update=4), "trainer.prompts_per_step=10 must be a multiple of"),
])
def test_each_section_checks_its_own_fields(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        section.validate()


def test_config_adds_only_the_rules_across_sections():
    rollout, trainer = RolloutConfig(source="external"), TrainerConfig(mode="sync")
    rollout.validate()
    trainer.validate()  # each fine on its own, refused together
    with pytest.raises(ConfigError, match="rollout.source=external needs trainer.mode=async"):
        Config(rollout=rollout, trainer=trainer).validate()


@pytest.mark.parametrize("path", SETTINGS_MODULES)
def test_settings_modules_import_only_the_machinery(path):
    """Any layer may import a section, so a settings module imports (at module level) only the stdlib,
    the machinery of utils/settings.py and other settings modules."""
    tree = ast.parse((Path(megatron_m2po.__file__).parent / path).read_text())
    ours = [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("megatron_m2po")]
    ours += [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names if a.name.startswith("megatron_m2po")]
    assert all(m == "megatron_m2po.utils.settings" or m.endswith("settings") for m in ours), ours


def test_config_reexports_the_sections_from_their_homes():
    from megatron_m2po import config
    from megatron_m2po.rollout import settings as rollout_settings
    from megatron_m2po.utils import settings as machinery

    assert config.RolloutConfig is rollout_settings.RolloutConfig and config.ConfigError is machinery.ConfigError


@pytest.mark.parametrize("overrides, push", [
    ([], "adapter"),
    (["rollout.colocate=true", "trainer.mode=sync"], "merged"),
    (["rollout.source=external", "trainer.mode=async"], "merged"),
    (["model.lora.push=merged"], "merged"),
])
def test_lora_push_auto_is_resolved_once_at_validation(overrides, push):
    """``model.lora.push=auto`` is resolved by ``Config.validate`` (config.py ``_check_lora_push``,
    the one place its rule is written); every reader (``lora_push_mode``: the trainer, the rollout
    service) sees the resolved value, and the resolved config dumps and reloads to itself."""
    from megatron_m2po.weights.lora_push import lora_push_mode

    cfg = load_config(None, ["model.lora.rank=8", *overrides])
    assert cfg.model.lora.push == push and lora_push_mode(cfg) == push
    assert config_to_dict(load_config(None, ["model.lora.rank=8", f"model.lora.push={push}", *overrides[:2]])) == \
        config_to_dict(cfg)
    assert load_config(None).model.lora.push == "auto" and lora_push_mode(load_config(None)) is None  # no LoRA
    unresolved = Config()
    unresolved.model.lora.rank = 8
    with pytest.raises(ValueError, match="not resolved"):
        lora_push_mode(unresolved)
