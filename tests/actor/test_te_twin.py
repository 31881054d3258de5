"""The CPU build is the GPU build's twin: the module tree, parameter names, checkpoint keys and the
input a hook on a fused linear receives are those of Transformer Engine's layer spec.

The expected tree below is written from megatron-core 0.16.1's spec functions and Transformer
Engine 2.9.0's modules, not from the code under test:

* ``models/gpt/gpt_layer_specs.py`` ``get_gpt_layer_with_transformer_engine_spec``: ``input_layernorm``
  left at ``IdentityOp``, ``linear_qkv=backend.column_parallel_layer_norm_linear()``
  (``TELayerNormColumnParallelLinear``), ``core_attention`` ``TEDotProductAttention``,
  ``linear_proj`` ``TERowParallelLinear``, ``pre_mlp_layernorm`` ``TENorm`` only with experts
  (else ``IdentityOp``), q / k norms ``TENorm``; ``get_mlp_module_spec_for_backend``: the dense
  ``linear_fc1`` fused with its norm; ``moe_module_specs.py``: experts ``TEGroupedMLP``;
  ``transformer/transformer_block.py``: the final norm ``LayerNormImpl = TENorm``.
* TE 2.9.0 ``module/layernorm_linear.py``: ``layer_norm_weight`` (``layer_norm_bias`` only for
  LayerNorm), ``weight``, ``bias`` only when ``bias=True`` (``module/linear.py`` keeps an empty
  plain tensor otherwise); every TE module also has an ``_extra_state`` entry (FP8 metadata), which
  the CPU twin has not (left out of the comparison).

On today's local spec (before the twin) every assertion on names fails: the norms are separate
``input_layernorm`` / ``pre_mlp_layernorm`` modules with a ``weight``.
"""

import os

import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

# the twin's class -> the TE class it stands for on GPU (actor/te_twin.py's table)
TWIN_OF = {"LayerNormColumnParallelLinear": "TELayerNormColumnParallelLinear",
           "RowParallelLinear": "TERowParallelLinear", "RMSNorm": "TENorm",
           "PackedDotProductAttention": "TEDotProductAttention", "LocalGroupedMLP": "TEGroupedMLP"}

LAYER_MODULES = {  # relative to decoder.layers.{i}
    "input_layernorm": "IdentityOp",
    "self_attention.linear_qkv": "TELayerNormColumnParallelLinear",
    "self_attention.core_attention": "TEDotProductAttention",
    "self_attention.linear_proj": "TERowParallelLinear",
}
DENSE_MODULES = {"pre_mlp_layernorm": "IdentityOp", "mlp.linear_fc1": "TELayerNormColumnParallelLinear",
                 "mlp.linear_fc2": "TERowParallelLinear"}
QK_NORMS = {"self_attention.q_layernorm": "TENorm", "self_attention.k_layernorm": "TENorm"}
MOE_MODULES = {"pre_mlp_layernorm": "TENorm", "mlp.experts": "TEGroupedMLP"}

ATTENTION_PARAMS = ["self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
                    "self_attention.linear_qkv.weight"]
DENSE_PARAMS = ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]


def expected(kind: str) -> tuple[dict, list]:
    modules, params = dict(LAYER_MODULES), list(ATTENTION_PARAMS)
    if kind == "qwen2":  # q / k / v biases
        params.append("self_attention.linear_qkv.bias")
    if kind in ("qwen3", "qwen3_moe"):
        modules.update(QK_NORMS)
        params += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    if kind == "qwen3_moe":
        modules.update(MOE_MODULES)
        params += ["pre_mlp_layernorm.weight", "mlp.router.weight"]
        params += [f"mlp.experts.linear_fc{j}.weight{e}" for j in (1, 2) for e in range(4)]
    else:
        modules.update(DENSE_MODULES)
        params += DENSE_PARAMS
    return modules, sorted(params)


def _trees(rank, world_size, root):
    lib.init_megatron(1, 1)
    from megatron_m2po.actor import model as M
    from megatron_m2po.actor.te_twin import fused_norm
    from megatron_m2po.config import Config

    out = {}
    for kind in ("qwen2", "qwen3", "qwen3_moe"):
        d = lib.make_tiny_hf(kind, os.path.join(root, kind), seed=3)
        cfg = Config()
        cfg.model.hf_path = d
        (m,), _bridge = M.build_model(cfg)
        layer = m.decoder.layers[0]
        modules = {n: type(mod).__name__ for n, mod in layer.named_modules() if n}
        params = sorted(n for n, _ in layer.named_parameters())
        ckpt = sorted(k for k in m.sharded_state_dict() if not k.endswith("_extra_state"))
        # what a forward hook on linear_qkv receives, and what its GEMM multiplies
        seen = {}
        qkv = layer.self_attention.linear_qkv
        h = qkv.register_forward_hook(lambda mod, args, output: seen.update(x=args[0].detach().clone()))
        ids = torch.randint(0, 128, (1, 6))
        with torch.no_grad():
            m(ids, torch.arange(6)[None], None)
            h.remove()
            x = seen["x"]
            hf = lib.read_safetensors_dir(d)
            w = hf["model.layers.0.input_layernorm.weight"]
            ref = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)  # HF Qwen RMSNorm, fp32
            normed_err = float((fused_norm(qkv, x) - ref).abs().max())
            # the residual stream of the first layer is the embedding: un-normalised
            emb = m.embedding.word_embeddings.weight[ids[0]]
            raw_err = float((x[:, 0] - emb).abs().max())
        out[kind] = dict(modules=modules, params=params, ckpt=ckpt, final=type(m.decoder.final_layernorm).__name__,
                         normed_err=normed_err, raw_err=raw_err)
    return out


def test_cpu_tree_is_transformer_engines_tree(tmp_path):
    (out,) = run_distributed(_trees, 1, args=(str(tmp_path),), timeout_s=120)
    for kind, got in out.items():
        want_modules, want_params = expected(kind)
        te_view = {n: TWIN_OF.get(t, t) for n, t in got["modules"].items() if n in want_modules}
        assert te_view == want_modules, kind
        assert got["params"] == want_params, kind
        assert TWIN_OF.get(got["final"]) == "TENorm"
        # checkpoint keys: TE's names, the norms inside the fused linears
        layer_keys = [k for k in got["ckpt"] if k.startswith("decoder.layers.")]
        assert not [k for k in layer_keys if "input_layernorm" in k], kind
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in got["ckpt"], kind
        # a hook on linear_qkv sees the residual stream, as under TE; fused_norm gives the GEMM's input
        assert got["raw_err"] == 0.0 and got["normed_err"] < 1e-6, kind
