"""Measure the planner's efficiency assumptions on one GPU (``m2po plan --search``, docs/planner.md).

    python tools/benchmarks/cost_model_terms.py            # on a GPU: Qwen2.5-32B shapes
    python tools/benchmarks/cost_model_terms.py --quick    # tiny shapes, any device (a smoke run)

Prints, side by side with the ``CostModel`` value each one stands for:

* ``attn_eff``: causal flash attention (``torch.nn.functional.scaled_dot_product_attention``,
  bf16, head dim 128, GQA) forward + backward over one sequence of L tokens, with the query and
  KV heads one GPU holds at TP = 2 / 4 / 8; FLOPs counted as the planner counts them (forward
  ``2 q L^2`` over the causal half, backward 2.5 forwards) over the GPU's dense bf16 peak;
* a context-parallel ring step's attention (``L / (2 cp)`` queries against ``L / cp`` keys, no mask:
  the work of an off-diagonal step of TE's p2p ring) as a fraction of the same;
* ``gemm_eff``: the forward + backward GEMMs of one Qwen2.5-32B layer (QKV, output projection,
  SwiGLU up + gate, down) for T tokens at TP = 2 / 4 / 8 (each GPU's slice of the weights).

The planner takes these as assumptions (``attn_eff`` 0.40, ``gemm_eff`` 0.55, one value for every
TP); this says how far one GPU is from them. Not measured here: TE's kernels (cuDNN attention),
communication, several GPUs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 (CostModel.peak_tflops)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 5120, 40, 8, 128, 27648  # Qwen2.5-32B


def _time(fn, warmup: int = 10, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def attention(L: int, tp: int, dev, dtype, causal: bool = True, lq: int | None = None) -> float:
    """Seconds of forward + backward attention: ``lq`` queries (default L) against L keys."""
    h, g = HEADS // tp, KV_HEADS // tp
    lq = lq or L
    q = torch.randn(1, h, lq, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(1, g, L, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, g, L, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn(1, h, lq, HEAD_DIM, device=dev, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(do)
    return _time(step)


def layer_gemms(T: int, tp: int, dev, dtype) -> tuple[float, float]:
    """(seconds, FLOPs) of one layer's GEMMs forward + backward on one GPU's TP slice."""
    shapes = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp), (HEADS * HEAD_DIM // tp, HIDDEN),
              (HIDDEN, 2 * FFN // tp), (FFN // tp, HIDDEN)]
    xs = [torch.randn(T, k, device=dev, dtype=dtype) for k, _ in shapes]
    ws = [torch.randn(k, n, device=dev, dtype=dtype) for k, n in shapes]
    gs = [torch.randn(T, n, device=dev, dtype=dtype) for _, n in shapes]

    def step():
        for x, w, gy in zip(xs, ws, gs):
            x @ w                # forward
            gy @ w.t()           # input gradient
            x.t() @ gy           # weight gradient
    flops = sum(3 * 2 * T * k * n for k, n in shapes)
    return _time(step), flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on any device)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lengths = (512, 1024) if a.quick else (8192, 16384, 32768)
    tokens = (256,) if a.quick else (4096, 8192, 16384)
    peak = PEAK_TFLOPS * 1e12
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}; fractions of {PEAK_TFLOPS:.0f} TFLOP/s (CostModel.peak_tflops)")
    print("attention fwd+bwd, causal, one sequence   (planner attn_eff = 0.40)")
    for tp in (2, 4, 8):
        for L in lengths:
            s = attention(L, tp, dev, dtype)
            flops = 3.5 * 2 * (HEADS // tp) * HEAD_DIM * L * L  # forward 2 q L^2 (causal half), x 3.5
            print(f"  tp={tp} L={L:6d}: {s * 1e3:8.2f} ms  eff {flops / s / peak:.3f}")
    print("CP ring step: L/(2cp) queries against L/cp keys, no mask (fwd+bwd)")
    for cp in (2, 4):
        for L in lengths:
            c = L // (2 * cp)
            s = attention(2 * c, 4, dev, dtype, causal=False, lq=c)
            flops = 3.5 * 2 * 2 * (HEADS // 4) * HEAD_DIM * c * 2 * c
            print(f"  tp=4 cp={cp} L={L:6d}: {s * 1e6:8.1f} us  eff {flops / s / peak:.3f}")
    print("one layer's GEMMs fwd+bwd                  (planner gemm_eff = 0.55 for every TP)")
    for tp in (2, 4, 8):
        for T in tokens:
            s, flops = layer_gemms(T, tp, dev, dtype)
            print(f"  tp={tp} T={T:6d}: {s * 1e3:8.2f} ms  eff {flops / s / peak:.3f}")


if __name__ == "__main__":
    main()
