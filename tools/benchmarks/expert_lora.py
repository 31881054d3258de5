"""The MoE expert adapters' cost (``actor/lora.py`` ``ExpertLoRA``), side by side in one run: the
experts' two grouped linears alone (their base GEMMs as ``torch._grouped_mm``, as Transformer
Engine's grouped GEMM runs them), then with the adapters as two grouped GEMMs per linear, then with
one pair of matmuls per expert (the path for devices and dtypes ``torch._grouped_mm`` does not
serve). Forward + backward of fc1 -> SwiGLU -> fc2 over routed tokens, with gradients for the
input and the adapters only (the base is frozen under LoRA).

    python tools/benchmarks/expert_lora.py                       # a Qwen3-30B-A3B layer on CUDA
    python tools/benchmarks/expert_lora.py --tokens 2048 --experts 32 --hidden 512 --ffn 256   # CPU-sized

Prints milliseconds per forward + backward (median of ``--repeats``) of each and the adapters'
overhead over the base, looped against grouped.
Measured on one H100 (torch 2.11 + cu130, bf16; 16,384 tokens x top-8 over 128 experts, hidden
2048, ffn 768): the base experts 12.2 ms; rank 16: + adapters grouped 16.3 ms (1.33x the base),
looped 97.1 ms (7.9x; loop / grouped 5.95x); rank 8: 16.3 ms against 109.4 ms. In a two-layer
Qwen3-30B-A3B-shaped actor step (16k tokens, same GPU): 1.00 s with attention adapters only,
1.22 s with expert adapters grouped, 4.44 s looped (docs/design.md, LoRA).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class _GroupedLinear(nn.Module):
    """``(x, m_splits) -> (out, None)`` over ``[n, out, in]`` frozen weights, as the experts' grouped
    linears are called (``TEGroupedLinear``); one grouped GEMM where torch has it."""

    def __init__(self, n: int, fout: int, fin: int, **kw) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, fout, fin, **kw) * fin ** -0.5, requires_grad=False)
        self.weight0 = self.weight

    def forward(self, x, m_splits):
        if hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
            offs = torch.tensor(list(itertools.accumulate(m_splits)), dtype=torch.int32).to(x.device)
            return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offs), None
        return torch.cat([xi @ w.t() for xi, w in zip(torch.split(x, m_splits), self.weight)]), None


class _Experts(nn.Module):
    def __init__(self, n: int, hidden: int, ffn: int, **kw) -> None:
        super().__init__()
        self.num_local_experts = n
        self.linear_fc1 = _GroupedLinear(n, 2 * ffn, hidden, **kw)
        self.linear_fc2 = _GroupedLinear(n, hidden, ffn, **kw)

    def forward(self, x, m_splits):
        h, _ = self.linear_fc1(x, m_splits)
        gate, up = h.chunk(2, -1)
        out, _ = self.linear_fc2(torch.nn.functional.silu(gate) * up, m_splits)
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    from megatron_m2po.actor.lora import ExpertLoRA, grouped_gemm_serves

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kw = dict(device=dev, dtype=dtype)
    torch.manual_seed(0)
    experts = _Experts(args.experts, args.hidden, args.ffn, **kw)
    hf = SimpleNamespace(hidden_size=args.hidden, moe_intermediate_size=args.ffn)
    lora = ExpertLoRA(experts, rank=args.rank, scaling=2.0, dropout=0.0, layer=0, seed=0, hf=hf, ep_rank=0)
    with torch.no_grad():
        for pair in lora.PAIRS:
            getattr(lora, f"{pair}_B").normal_(0, 0.02)
    routed = torch.randint(0, args.experts, (args.tokens * args.topk,), generator=torch.Generator().manual_seed(1))
    m_splits = torch.bincount(routed, minlength=args.experts).tolist()
    x = torch.randn(len(routed), args.hidden, **kw, requires_grad=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        out = experts(x, m_splits)
        out.float().square().mean().backward()

    def timed(enabled: bool, grouped) -> float:
        lora.enabled, lora.grouped = enabled, grouped
        for _ in range(2):
            step()
        times = []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    serves = grouped_gemm_serves(x, lora.gate_up_A, lora.gate_up_B)
    base = timed(False, None)
    grouped = timed(True, True) if serves else float("nan")
    looped = timed(True, False)
    print(f"{args.experts} experts, {args.tokens} tokens x top-{args.topk}, hidden {args.hidden}, ffn {args.ffn}, "
          f"rank {args.rank}, {dev.type} {str(dtype).replace('torch.', '')}; torch._grouped_mm serves: {serves}")
    print(f"base experts alone          {base:9.2f} ms")
    print(f"+ adapters, grouped GEMMs   {grouped:9.2f} ms   (+{grouped - base:.2f} ms, {grouped / base:.2f}x the base)")
    print(f"+ adapters, loop per expert {looped:9.2f} ms   (+{looped - base:.2f} ms, {looped / base:.2f}x the base)")
    print(f"loop / grouped: {looped / grouped:.2f}x")


if __name__ == "__main__":
    main()
