"""Tiny random HF models built locally (no downloads) for the actor tests."""

from __future__ import annotations

import os

import numpy as np
import torch

KINDS = ("qwen2", "qwen3", "llama", "qwen3_moe")


def make_tiny_hf(kind: str, out_dir: str, *, seed: int = 0, tie: bool = False, vocab: int = 128,
                 layers: int = 2) -> str:
    """Save a ``layers``-layer, hidden-64, GQA (4 heads / 2 kv heads) random model of ``kind`` in ``out_dir``
    (``qwen3_moe``: 4 experts, top-2, expert intermediate size 32)."""
    import transformers as tr

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie)
    if kind == "qwen2":
        cfg, cls = tr.Qwen2Config(**common), tr.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg, cls = tr.Qwen3Config(head_dim=16, **common), tr.Qwen3ForCausalLM
    elif kind == "llama":
        cfg, cls = tr.LlamaConfig(**common), tr.LlamaForCausalLM
    elif kind == "qwen3_moe":  # every layer MoE: 4 experts of intermediate 32, top-2, renormalised
        cfg = tr.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
        cls = tr.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():  # random norms and biases so the mapping of every tensor is exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def init_megatron(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """CPU emulation + Megatron parallel state on the already initialised gloo group."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megatron_m2po.standins import cpu_platform as cpu

    cpu.enable()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def read_safetensors_dir(d: str) -> dict:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(f))
    return out


def hf_logprobs(hf_dir: str, prompt_ids, response_ids, temperature: float = 1.0):
    """Reference per-token log-probs of the response tokens from HF transformers (fp32)."""
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor(list(prompt_ids) + list(response_ids))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    p = len(prompt_ids)
    rows = torch.arange(p - 1, p - 1 + len(response_ids))
    return lp[rows, torch.tensor(response_ids)].float().numpy()


def make_samples(n: int, *, seed: int = 0, vocab: int = 128, prompt=(2, 6), response=(3, 9), version: int = 0):
    """Random samples with variable prompt / response lengths (behav log-probs filled in later)."""
    import numpy as np

    from megatron_m2po.actor.batch import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(*prompt)), int(rng.integers(*response))
        mask = np.ones(r, np.uint8)
        if r > 3:
            mask[-1] = 0  # exercise response tokens that are not trained on
        out.append(Sample(uid=f"s{i}", prompt_ids=rng.integers(0, vocab, p), response_ids=rng.integers(0, vocab, r),
                          behav_logprobs=np.zeros(r, np.float32),
                          advantages=np.float32(rng.standard_normal()), loss_mask=mask,
                          versions=np.full(r, version)))
    return out


def actor_config(hf_dir: str, *, tp: int = 1, pp: int = 1, mbs: int = 2, loss: str = "m2po", lr: float = 1e-3,
                 dist_opt: bool = False):
    from megatron_m2po.config import Config

    cfg = Config()
    cfg.model.hf_path = hf_dir
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    cfg.parallel.micro_batch_size = mbs
    cfg.parallel.use_distributed_optimizer = dist_opt
    cfg.algo.loss = loss
    cfg.optim.lr = lr
    cfg.optim.weight_decay = 0.0
    cfg.rollout.temperature = 1.0
    return cfg


def _inner_optimizers(actor) -> list:
    """The torch optimizers under Megatron's wrappers (their params are the fp32 main weights, or
    this rank's shards of them with the distributed optimizer)."""
    return [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]


def snapshot(actor):
    """The actor's training state: weights, optimizer state (fp32 master weights and Adam moments,
    whole or this rank's shard with the distributed optimizer, read from the torch optimizers
    because Megatron's distributed ``state_dict`` leaves the moments out), LR schedule, version and
    the previous update's metrics; :func:`restore` puts it back, so that two ways of doing one
    update can start from the same state."""
    import copy

    inner = _inner_optimizers(actor)
    return ([p.detach().clone() for m in actor.model for p in m.parameters()],
            [[p.detach().clone() for g in o.param_groups for p in g["params"]] for o in inner],
            [copy.deepcopy(o.state_dict()) for o in inner], copy.deepcopy(actor.scheduler.state_dict()),
            actor.version, copy.deepcopy(actor.mask_hint))


def restore(actor, snap) -> None:
    import copy

    params, mains, opts, sched, version, hint = snap
    with torch.no_grad():
        for p, v in zip((p for m in actor.model for p in m.parameters()), params):
            p.copy_(v)
        for o, main, st in zip(_inner_optimizers(actor), mains, opts):
            for p, v in zip((p for g in o.param_groups for p in g["params"]), main):
                p.copy_(v)
            o.load_state_dict(copy.deepcopy(st))
    actor.scheduler.load_state_dict(copy.deepcopy(sched))
    actor.version, actor.mask_hint = version, copy.deepcopy(hint)


class Recorder:
    """The actor's :class:`~megatron_m2po.actor.global_mask.TokenRecord` s by update (installs
    itself with ``actor.observe_tokens``): this rank's micro-batches, as the loss used them."""

    def __init__(self, actor) -> None:
        self.updates: dict[int, list] = {}
        actor.observe_tokens(self)

    def __call__(self, rec) -> None:
        self.updates.setdefault(rec.update, []).append(rec)

    def last(self) -> int:
        """The last update recorded (its weight version before the step)."""
        return max(self.updates)

    def mask(self, update: int) -> dict[int, bool]:
        """``{canonical token index: keep}`` of this rank's tokens in ``update`` ({} where it
        recorded none: not the last pipeline stage)."""
        out: dict[int, bool] = {}
        for r in self.updates.get(update, []):
            assert r.keep is not None, f"update {update}: the loss took no mask"
            out.update(zip(r.mb.token_index.tolist(), r.keep.tolist()))
        return out

    def strategy(self, update: int):
        """The update's global-mask strategy (the same in each of its records)."""
        (s,) = {r.strategy for r in self.updates[update]}
        return s


def numpy_pairs(tensors):
    """``(name, array)`` pairs (tensors do not outlive the rank that returns them); None stays None."""
    return None if tensors is None else [(n, t.numpy()) for n, t in tensors]


def lora_adapter_grads(actor, samples):
    """Gradients of ``sum(logp * loss_mask)`` over ``samples`` w.r.t. every LoRA adapter (experts'
    too), finalised as an update finalises them, in peft names (rank 0). Overwrites the adapters
    with them."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_m2po.actor.batch import BatchPlan
    from megatron_m2po.actor.lora import adapter_modules, expert_adapter_modules
    from megatron_m2po.weights.lora_export import peft_adapter_tensors

    mine = actor.shards(BatchPlan.of(samples))[actor.dp_rank]
    mbs = actor.make_microbatches(samples, [[i] for i in mine])

    def loss_fn(mb, model, hidden):
        logp, _ = actor.token_logprobs(mb, model, hidden, with_entropy=False)
        return -(logp * mb.loss_mask).sum(), torch.tensor(mb.num_tokens, dtype=torch.int), None

    for m in actor.model:
        m.zero_grad_buffer()
    actor.run_schedule(mbs, loss_fn, forward_only=False)
    finalize_model_grads(actor.model, None, pg_collection=actor.pg)
    with torch.no_grad():
        for m in [*adapter_modules(actor.chunks), *expert_adapter_modules(actor.chunks)]:
            for p in m.parameters():
                p.copy_(-p.main_grad)  # d/dθ sum(logp)
    return numpy_pairs(peft_adapter_tensors(actor.chunks))


def peft_reference(hf_dir: str, adapter_dir: str, samples):
    """Log-probs and ``d sum(logp * loss_mask) / d adapters`` (peft names) of HF peft: the adapter
    directory loaded with ``PeftModel.from_pretrained`` on the HF model of ``hf_dir``."""
    import peft
    import transformers as tr

    base = tr.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    total, logps = 0.0, []
    for s in samples:
        ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]))[None]
        lp = torch.log_softmax(model(ids).logits[0].double(), -1)
        p = len(s.prompt_ids)
        tok = lp[torch.arange(p - 1, p - 1 + len(s.response_ids)), torch.tensor(s.response_ids)]
        logps.append(tok.detach().float().numpy())
        total = total + (tok * torch.tensor(s.loss_mask, dtype=torch.float64)).sum()
    total.backward()
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if "lora_" in n}
    return logps, grads


def random_lora_b(actor, seed: int) -> None:
    """Every LoRA B random, the whole matrix from a seeded generator (per layer and projection; per
    global expert for expert adapters), then this rank's part, so that every layout holds the same
    non-zero adapters."""
    from megatron_m2po.actor.lora import adapter_modules, expert_adapter_modules

    with torch.no_grad():
        for m in adapter_modules(actor.chunks):
            for j, part in enumerate(m.targets):
                b = m.pair(part)[1]
                rows = b.shape[0] * (m.tp if m.kind == "column" else 1)
                g = torch.Generator().manual_seed(seed * 1000 + m.layer * 10 + j)
                whole = 0.05 * torch.randn(rows, b.shape[1], generator=g)
                b.copy_(whole.chunk(m.tp, 0)[m.tp_group.rank()] if m.kind == "column" else whole)
        for m in expert_adapter_modules(actor.chunks):
            for i in range(m.num_local_experts):
                for k, pair in enumerate(m.PAIRS):
                    b = m.pair(pair, i)[1]
                    g = torch.Generator().manual_seed(seed * 1000 + m.layer * 100 + (m.first_expert + i) * 2 + k + 50)
                    b.copy_(0.05 * torch.randn(b.shape, generator=g))
