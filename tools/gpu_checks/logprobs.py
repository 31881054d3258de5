"""Row 2: the fused log-prob against naive logits: agreement, memory and time."""

from __future__ import annotations

import time

import torch

from .report import Row

CHUNK = 2048               # row 2's chunk rows: the actor's default (parallel.logprob_chunk_rows)
LOGPROB_AGREE = 1e-3       # row 2: fused vs naive log-probs / entropies, absolute (fp32 arithmetic)


def _logprob_methods():
    from megatron_m2po.parallel.logprobs import fused_logprobs_entropy

    def fused(h, w, t, chunk):  # as the actor runs it (parallel.logprob_tf32 defaults to true)
        return fused_logprobs_entropy(h, w, t, chunk_rows=chunk, tf32=True)

    def fused_fp32(h, w, t, chunk):
        return fused_logprobs_entropy(h, w, t, chunk_rows=chunk, tf32=False)

    def naive_fp32(h, w, t, chunk):
        logsm = torch.log_softmax(h.float() @ w.float().T, dim=-1)
        return logsm.gather(1, t[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)

    def naive_bf16(h, w, t, chunk):
        logsm = torch.log_softmax((h @ w.T).float(), dim=-1)
        return logsm.gather(1, t[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)

    return {"fused": fused, "fused fp32 matmuls": fused_fp32, "naive fp32 logits": naive_fp32,
            "naive bf16 logits": naive_bf16}


def measure_logprob(method, T: int, H: int, V: int, chunk: int, device: torch.device, repeats: int) -> dict:
    """Peak memory above the inputs (CUDA), best-of time, and the outputs of forward + backward."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(T, H, generator=g) * 0.5).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(device, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    g1, g2 = torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device)
    cuda = device.type == "cuda"
    times, peak, outs = [], None, None
    for rep in range(repeats + 1):  # the first run warms up kernels and the allocator
        hidden.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logp, ent = method(hidden, weight, targets, chunk)
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        if cuda:
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
        if cuda and rep == 1:
            peak = torch.cuda.max_memory_allocated() - base
        outs = (logp.detach().float().cpu(), ent.detach().float().cpu())
        del logp, ent
    del hidden, weight
    if cuda:
        torch.cuda.empty_cache()
    return {"time_s": min(times), "peak_bytes": peak, "logp": outs[0], "entropy": outs[1]}


def row_logprobs(smoke: bool) -> list[Row]:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shapes = ([("tiny", 256, 64, 1000, 64)] if smoke else
              [("Qwen2.5-1.5B, TP=1", 8192, 1536, 151936, CHUNK), ("Qwen2.5-32B, one TP=8 rank", 16384, 5120, 19008, CHUNK)])
    rows = []
    for label, T, H, V, chunk in shapes:
        res = {name: measure_logprob(fn, T, H, V, chunk, device, 1 if smoke else 3)
               for name, fn in _logprob_methods().items()}
        f, ref = res["fused"], res["naive fp32 logits"]
        agree = max(float((ref["logp"] - res[n]["logp"]).abs().max()) for n in res if n.startswith("fused"))
        agree_e = max(float((ref["entropy"] - res[n]["entropy"]).abs().max()) for n in res if n.startswith("fused"))
        shape = f"{label}: T={T} H={H} V/TP={V}, chunk {chunk}"
        ok = agree <= LOGPROB_AGREE and agree_e <= LOGPROB_AGREE
        rows.append(Row("fused log-prob (TF32 and fp32 matmuls) = naive fp32", shape,
                        f"max |dlogp| {agree:.1e}, max |dentropy| {agree_e:.1e}", f"<= {LOGPROB_AGREE:g}",
                        "PASS" if ok else "FAIL", dict(logp=agree, entropy=agree_e)))
        if device.type == "cuda":
            mem = ", ".join(f"{n} {r['peak_bytes'] / 2**30:.2f} GiB" for n, r in res.items())
            less = min(r["peak_bytes"] for n, r in res.items() if not n.startswith("fused")) / max(f["peak_bytes"], 1)
            rows.append(Row("fused log-prob memory (fwd+bwd, peak above inputs)", shape,
                            f"{mem} ({less:.1f}x less)", "fused < every naive",
                            "PASS" if less > 1 else "FAIL",
                            {n: r["peak_bytes"] for n, r in res.items()}))
        else:
            rows.append(Row("fused log-prob memory (fwd+bwd, peak above inputs)", shape,
                            "skipped: needs the CUDA allocator's peak statistics "
                            "(CPU peak RSS: tools/benchmarks/logprob_memory.py)", "-", "SKIP"))
        tm = ", ".join(f"{n} {r['time_s'] * 1e3:.1f} ms" for n, r in res.items())
        rows.append(Row(f"fused log-prob time ({device.type}, best of {1 if smoke else 3})", shape,
                        f"{tm} (fused/naive-bf16 {f['time_s'] / res['naive bf16 logits']['time_s']:.2f}x)",
                        "reported", "INFO", {n: r["time_s"] for n, r in res.items()}))
    return rows
