"""Row 10: the MoE expert adapters' grouped GEMMs, forward and backward, against the per-expert loop.

``actor/lora.py`` ``ExpertLoRA`` adds ``s B_e A_e x`` to each expert's rows with two
``torch._grouped_mm`` calls where :func:`~megatron_m2po.actor.lora.grouped_gemm_serves` says torch
serves them (on CUDA: bf16 on Hopper, its CUTLASS kernel ``ATen/native/cuda/Blas.cpp``
``_grouped_mm_cuda``; on CPU: torch's own implementation), else with one pair of matmuls per
expert. The forward of the two was compared on an H100; what trains is the backward through
``_grouped_mm`` (its autograd formula, ``tools/autograd/derivatives.yaml`` ``_grouped_mm``: the
gradient of each operand is another grouped GEMM over the same offsets), which no CPU test sees on
the GPU kernel. This row runs the production hook (``ExpertLoRA._hook`` on a Qwen3-30B-A3B-shaped
layer's experts: 128 experts, hidden 2048, ffn 768, rank 32, 16,384 routed token copies with some
experts empty) both ways on the same bf16 inputs and the same upstream gradient, and compares the
output and the gradients of ``x``, ``A`` and ``B`` (both pairs: ``gate_up`` and ``down``) with an
fp32 computation of the loop from the same bf16 values.

Criterion: each path's relative RMS error against the fp32 loop; the grouped path's at most twice
the loop's, plus 2^-10 (both round to bf16; accumulation orders differ, a wrong offset, transposed
operand or dropped expert is off by O(1)). A negative control gives half of one expert's rows to the next
expert (a wrong offset) and must fail it. Where the grouped GEMM does not serve (an
older GPU, another dtype), the row says so (SKIP): the loop then trains, and it is what every CPU
test checks. ``--cpu-smoke``: 16 experts, hidden 64, ffn 32, rank 8, fp32 on CPU's ``_grouped_mm``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from .report import Row

EXPERT_LORA_CHECK = "expert LoRA grouped GEMM fwd+bwd vs per-expert loop"
SLACK = 2.0 ** -10  # added to twice the loop's error: the two paths' rounding differ by about this


def _splits(tokens: int, experts: int, gen: torch.Generator) -> list[int]:
    """Token copies per expert, uneven, the first expert and one in the middle empty (routing leaves
    experts without tokens; the offsets then repeat)."""
    w = torch.rand(experts, generator=gen) ** 2
    w[0] = w[experts // 2] = 0
    counts = (w / w.sum() * tokens).floor().long()
    counts[1] += tokens - int(counts.sum())
    return [int(c) for c in counts]


def _experts(n: int, hidden: int, ffn: int, device, dtype):
    """What ExpertLoRA reads of Megatron's experts module: ``num_local_experts``, the fc1 weight's
    device and dtype, and the two linears it hooks."""
    lin = lambda: SimpleNamespace(weight0=torch.empty(1, device=device, dtype=dtype),  # noqa: E731
                                  register_forward_hook=lambda *a, **k: None)
    return SimpleNamespace(num_local_experts=n, linear_fc1=lin(), linear_fc2=lin())


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt().clamp_min(1e-30))


def _run(lora, pair: str, x: torch.Tensor, splits: list[int], grad_out: torch.Tensor, grouped: bool,
         shift: bool = False):
    """The hook's output and the gradients of x, A, B, and the backward's seconds; ``shift``: the
    negative control (half the rows of the first expert with tokens counted to the next one)."""
    lora.grouped = grouped
    a, b = getattr(lora, f"{pair}_A"), getattr(lora, f"{pair}_B")
    a.grad = b.grad = None
    xg = x.detach().clone().requires_grad_(True)
    fout = b.shape[1]
    base = torch.zeros(x.shape[0], fout, device=x.device, dtype=x.dtype)
    s = splits
    if shift:
        s = list(splits)
        i = next(j for j in range(len(s) - 1) if s[j] > 1)
        s[i], s[i + 1] = s[i] - s[i] // 2, s[i + 1] + s[i] // 2
    out, _ = lora._hook(pair, (xg, s), {}, (base, None))
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out.backward(grad_out)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return out.detach(), xg.grad, a.grad.clone(), b.grad.clone(), time.perf_counter() - t0


def _reference(lora, pair: str, x: torch.Tensor, splits: list[int], grad_out: torch.Tensor):
    """The loop in fp32 from the same bf16 values (autograd for the gradients)."""
    a = getattr(lora, f"{pair}_A").detach().float().requires_grad_(True)
    b = getattr(lora, f"{pair}_B").detach().float().requires_grad_(True)
    xf = x.detach().float().requires_grad_(True)
    out = torch.cat([(xi @ ai.t()) @ (bi * lora.scaling).t()
                     for xi, ai, bi in zip(torch.split(xf, splits), a.unbind(0), b.unbind(0))], 0)
    out.backward(grad_out.float())
    return out.detach(), xf.grad, a.grad, b.grad


def row_expert_lora(smoke: bool) -> list[Row]:
    from megatron_m2po.actor.lora import ExpertLoRA, grouped_gemm_serves

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n, hidden, ffn, rank, tokens = (128, 2048, 768, 32, 16384) if not smoke else (16, 64, 32, 8, 512)
    shape = f"{n} experts, hidden {hidden}, ffn {ffn}, rank {rank}, {tokens} token copies, {str(dtype)[6:]}"
    gen = torch.Generator().manual_seed(0)
    hf = SimpleNamespace(hidden_size=hidden, moe_intermediate_size=ffn)
    lora = ExpertLoRA(_experts(n, hidden, ffn, device, dtype), rank=rank, scaling=2.0, dropout=0.0, layer=0, seed=0,
                      hf=hf, ep_rank=0)
    with torch.no_grad():  # B leaves 0 once training starts: random B, so every gradient is non-zero
        for pair in ExpertLoRA.PAIRS:
            getattr(lora, f"{pair}_B").copy_(torch.randn(getattr(lora, f"{pair}_B").shape, generator=gen) * 0.05)
    splits = _splits(tokens, n, gen)
    rows: list[Row] = []
    for pair, (fin, fout) in (("gate_up", (hidden, 2 * ffn)), ("down", (ffn, hidden))):
        x = torch.randn(tokens, fin, generator=gen).to(device=device, dtype=dtype)
        grad_out = torch.randn(tokens, fout, generator=gen).to(device=device, dtype=dtype)
        a, b = getattr(lora, f"{pair}_A"), getattr(lora, f"{pair}_B")
        if not grouped_gemm_serves(x, a, b):
            cap = torch.cuda.get_device_capability() if cuda else None
            rows.append(Row(f"{EXPERT_LORA_CHECK}: {pair}", shape,
                            f"grouped GEMM does not serve here ({device.type}, {dtype}, capability {cap}): the "
                            "per-expert loop trains, as on CPU", "-", "SKIP"))
            continue
        ref = _reference(lora, pair, x, splits, grad_out)
        loop = _run(lora, pair, x, splits, grad_out, grouped=False)
        grouped = _run(lora, pair, x, splits, grad_out, grouped=True)
        shifted = _run(lora, pair, x, splits, grad_out, grouped=True, shift=True)
        names = ("out", "dx", "dA", "dB")
        err_loop = {k: _rel(t, r) for k, t, r in zip(names, loop[:4], ref)}
        err_grp = {k: _rel(t, r) for k, t, r in zip(names, grouped[:4], ref)}
        err_ctl = {k: _rel(t, r) for k, t, r in zip(names, shifted[:4], ref)}
        ok = all(err_grp[k] <= 2 * err_loop[k] + SLACK for k in names)
        teeth = any(err_ctl[k] > 2 * err_loop[k] + SLACK for k in names)
        result = ", ".join(f"{k} {err_grp[k]:.1e} (loop {err_loop[k]:.1e})" for k in names)
        rows.append(Row(f"{EXPERT_LORA_CHECK}: {pair}", shape,
                        f"rel RMS vs fp32 loop: {result}; backward {grouped[4] * 1e3:.1f} ms grouped, "
                        f"{loop[4] * 1e3:.1f} ms loop",
                        "grouped <= 2x loop + 2^-10, each", "PASS" if ok else "FAIL",
                        {"grouped": err_grp, "loop": err_loop, "control": err_ctl,
                         "backward_s": {"grouped": grouped[4], "loop": loop[4]}}))
        rows.append(Row(f"negative control: {pair} half an expert's rows given to the next", shape,
                        ", ".join(f"{k} {err_ctl[k]:.1e}" for k in names), "some > 2x loop + 2^-10",
                        "PASS" if teeth else "FAIL"))
    return rows


__all__ = ["EXPERT_LORA_CHECK", "row_expert_lora"]
