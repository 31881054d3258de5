"""The CPU emulation layer: torch-level redirections and Megatron-Core running on gloo.

Everything runs in spawned processes: ``enable()`` patches torch for the whole process and must
not leak into the pytest process.
"""

import torch

from megatron_m2po.standins.dist_testing import run_distributed


def _torch_level(rank, world_size):
    from megatron_m2po.standins import cpu_platform as cpu

    cpu.enable()
    cpu.enable()  # idempotent
    out = {}
    out["empty"] = str(torch.empty(3, device="cuda").device)
    out["int_dev"] = str(torch.zeros(2, device=torch.cuda.current_device()).device)
    out["dev_obj"] = str(torch.ones(2, device=torch.device("cuda", 0)).device)
    out["to"] = str(torch.ones(2).to("cuda").device) + str(torch.ones(2).to(0).device)
    out["to_kw"] = str(torch.ones(2).to(device="cuda:0", dtype=torch.float64).dtype)
    out["cuda"] = str(torch.ones(2).cuda().device)
    out["module_cuda"] = str(next(torch.nn.Linear(2, 2).cuda().parameters()).device)
    out["type"] = [torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type(),
                   torch.ones(1, dtype=torch.float16).type()]
    out["type_conv"] = torch.ones(1).type(torch.float64).dtype == torch.float64
    out["pin"] = str(torch.ones(2).pin_memory().device)
    torch.cuda.manual_seed(7)
    a = torch.rand(3)
    st = torch.cuda.get_rng_state()
    b = torch.rand(3)
    torch.cuda.set_rng_state(st)
    out["rng_restore"] = torch.equal(b, torch.rand(3))
    torch.manual_seed(7)  # torch.manual_seed calls cuda.manual_seed_all: no recursion
    out["rng_seed"] = torch.equal(a, torch.rand(3))
    torch.cuda.synchronize()
    out["mem"] = torch.cuda.memory_allocated() + torch.cuda.max_memory_allocated()
    with torch.cuda.stream(torch.cuda.Stream()):
        pass
    return out


def test_torch_level_redirections():
    (out,) = run_distributed(_torch_level, 1, timeout_s=60)
    assert out["empty"] == out["int_dev"] == out["dev_obj"] == out["cuda"] == out["module_cuda"] == "cpu"
    assert out["to"] == "cpucpu" and out["to_kw"] == "torch.float64" and out["pin"] == "cpu"
    assert out["type"] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", "torch.cuda.HalfTensor"]
    assert out["type_conv"] and out["rng_restore"] and out["rng_seed"] and out["mem"] == 0


def _refuses_on_cuda(rank, world_size):
    from megatron_m2po.standins import cpu_platform as cpu

    torch.cuda.is_available = lambda: True  # pretend a GPU machine
    try:
        cpu.enable()
    except RuntimeError as e:
        return str(e)
    return None


def test_refuses_when_cuda_available():
    (msg,) = run_distributed(_refuses_on_cuda, 1, timeout_s=60)
    assert msg is not None and "CUDA" in msg


def _megatron_tp2(rank, world_size):
    from megatron_m2po.standins import cpu_platform as cpu

    cpu.enable()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
                            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                            hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
                            tensor_model_parallel_size=2)
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), vocab_size=64,
                     max_sequence_length=32, position_embedding_type="rope")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    logits = model(ids, torch.arange(8).expand(2, 8), None)  # [B, S, V/TP]
    logits.float().sum().backward()
    grads_ok = all(p.grad is not None or getattr(p, "main_grad", None) is not None
                   for p in model.parameters())
    ps.destroy_model_parallel()
    return tuple(logits.shape), bool(torch.isfinite(logits).all()), grads_ok


def test_megatron_gpt_forward_backward_tp2_on_gloo():
    out = run_distributed(_megatron_tp2, 2, timeout_s=120)
    for shape, finite, grads in out:
        assert shape == (2, 8, 32) and finite and grads


def _collective_audit(rank, world_size):
    """What NCCL refuses on GPUs, the CPU platform refuses too (standins/collective_audit.py)."""
    import torch.distributed as dist

    from megatron_m2po.algo.metrics import Metric, reduce_metrics
    from megatron_m2po.standins import cpu_platform as cpu

    cpu.enable()

    def refused(fn):
        try:
            fn()
        except RuntimeError as e:
            return "No backend type associated with device type cpu" in str(e)
        return False

    out = {}
    host = torch.tensor([1.0])
    out["host_default"] = refused(lambda: dist.all_reduce(host))
    out["derived"] = refused(lambda: dist.all_reduce(host.double() * 2))
    out["stacked"] = refused(lambda: dist.broadcast(torch.stack([host, host]), src=0))
    out["cpu_call"] = refused(lambda: dist.all_reduce(torch.ones(1, device="cuda").cpu()))
    out["gather_list"] = refused(lambda: dist.all_gather([torch.ones(1, device="cuda")] * world_size, host))
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend if rank == 0 else dist.irecv, torch.zeros(1), peer)]
    out["p2p"] = refused(lambda: dist.batch_isend_irecv(ops))
    # what production does: accelerator tensors on the NCCL groups, host tensors on gloo groups
    acc = [torch.ones(1, device="cuda"), torch.zeros(2, device=torch.cuda.current_device()),
           torch.tensor([3], device="cuda"), host.cuda(), host.to("cuda"), host.to(device="cuda:0"),
           torch.ones(2, device=torch.cuda.current_device()) * host]
    for t in acc:
        dist.all_reduce(t)
    gloo = dist.new_group([0, 1], backend="gloo")
    dist.all_reduce(torch.tensor([1.0]), group=gloo)
    sub = dist.new_group([0, 1])  # inherits the default backend: NCCL on GPUs
    out["inherit"] = refused(lambda: dist.all_reduce(torch.tensor([1.0]), group=sub))
    module = torch.nn.Linear(2, 2, device="cpu")  # created on the host, then moved as Megatron does
    for p in module.cuda().parameters():
        dist.broadcast(p.data, src=0)
    m = reduce_metrics({"x": Metric(float(rank), "mean", 1.0)}, group=dist.group.WORLD)
    out["metrics"] = m["x"]
    return out


def _reused_bucket(rank, world_size):
    """A colocated bucket leased, given back and leased again (HostBuckets) stays the device tensor
    it was: broadcast on the default group as ``weights/colocated.py`` ``_exchange_bucket`` does."""
    import torch.distributed as dist

    from megatron_m2po.standins import cpu_platform as cpu
    from megatron_m2po.weights.colocated import _device
    from megatron_m2po.weights.colocated_bucket import HostBuckets

    cpu.enable()
    pool = HostBuckets()
    dev = _device()  # the exchange's device: the host here, where the pool keeps buckets
    for _ in range(3):
        flat = pool.lease(64, dev, 128)
        flat.fill_(rank)
        dist.broadcast(flat, src=0)
        pool.give_back(flat)
    return int(flat[0])


def test_a_reused_colocated_bucket_is_a_device_tensor():
    assert run_distributed(_reused_bucket, 2, timeout_s=120) == [0, 0]


def test_collectives_refuse_host_tensors_on_accelerator_groups():
    """A host tensor in a collective on a group that is NCCL on GPUs fails here as it fails there;
    tensors placed as production places them pass (metrics, .cuda(), device=..., gloo groups)."""
    for out in run_distributed(_collective_audit, 2, timeout_s=120):
        assert out.pop("metrics") == 0.5
        assert all(out.values()), out


def _any_rank_on_platform(rank, world_size):
    from megatron_m2po.standins import cpu_platform as cpu
    from megatron_m2po.parallel.rank0 import any_rank

    cpu.enable()
    return any_rank(rank == 1), any_rank(False)


def test_any_rank_runs_on_an_accelerator_group():
    """parallel/rank0.any_rank is called by the training loop every step on the default group, which
    is NCCL on GPUs: its tensor must be on the group's device."""
    assert run_distributed(_any_rank_on_platform, 2, timeout_s=120) == [(True, False), (True, False)]
