"""Peak memory and time of token log-prob + entropy, forward + backward: fused vs naive.

    python tools/benchmarks/logprob_memory.py                       # Qwen2.5-32B per TP=8 rank
    python tools/benchmarks/logprob_memory.py --scale 0.25          # T, H, V/TP, chunk x 0.25
    python tools/benchmarks/logprob_memory.py --device cuda

Shapes default to one tensor-parallel rank of Qwen2.5-32B at TP = 8: H = 5120,
V/TP = 152064 / 8 = 19008, T in {4k, 16k, 32k} response tokens, bf16 inputs.

- naive: fp32 logits ``[T, V/TP]`` = ``h.float() @ W.float().T`` (/ temperature), log_softmax,
  gather of the targets, entropy ``-(p * logp).sum(-1)``; autograd does the backward.
- fused: ``megatron_m2po.parallel.logprobs.fused_logprobs_entropy`` (chunked, recomputing).
Both run the same loss ``sum(g1 * logp) + sum(g2 * entropy)`` and produce the gradients of
``hidden`` and ``weight``; both do their matmuls in fp32.

Each configuration runs in a fresh subprocess. Peak memory is measured there: on CPU as the
kernel's peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs`` right before
the call) minus the resident set size at that moment (inputs allocated, a small warm-up call
done, glibc's mmap threshold at 1 MiB so freed buffers leave the RSS); on CUDA as
``torch.cuda.max_memory_allocated()`` minus the memory allocated before the call. The peak
includes the gradients produced (``grad_hidden``, ``grad_weight``), which either method must
create.

``--scale s`` multiplies T, H, V/TP, chunk_rows and the fused tile width by ``s``: every memory
term (T*V, V*H, T*H, chunk*V, tile) then scales by s^2, so the memory ratio is the full-size one, while the FLOPs scale by
s^3. The time ratio is only approximately preserved (elementwise work per matmul FLOP grows as
H shrinks); report the scale with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _rss_reset_and_read() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _worker(a: argparse.Namespace) -> dict:
    import torch

    from megatron_m2po.parallel import logprobs as lp_mod
    from megatron_m2po.parallel.logprobs import fused_logprobs_entropy

    lp_mod._V_BLOCK = a.v_block
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    dtype = getattr(torch, DTYPES[a.dtype])
    g = torch.Generator(device="cpu").manual_seed(0)
    T, H, V = a.tokens[0], a.hidden, a.vocab_shard

    def make(rows):
        hidden = (torch.randn(rows, H, generator=g) * 0.5).to(dev, dtype).requires_grad_()
        weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(dev, dtype).requires_grad_()
        targets = torch.randint(0, V, (rows,), generator=g).to(dev)
        g1 = torch.randn(rows, generator=g).to(dev)
        g2 = torch.randn(rows, generator=g).to(dev)
        return hidden, weight, targets, g1, g2

    def naive(hidden, weight, targets, g1, g2):
        z = hidden.float() @ weight.float().T
        if a.temperature != 1.0:
            z = z / a.temperature
        logsm = torch.log_softmax(z, dim=-1)
        del z
        logp = logsm.gather(1, targets[:, None]).squeeze(1)
        ent = -(logsm.exp() * logsm).sum(-1)
        del logsm
        ((logp * g1).sum() + (ent * g2).sum()).backward()

    def fused(hidden, weight, targets, g1, g2):
        logp, ent = fused_logprobs_entropy(hidden, weight, targets, chunk_rows=a.chunk_rows,
                                           temperature=a.temperature)
        ((logp * g1).sum() + (ent * g2).sum()).backward()

    fn = naive if a.method == "naive" else fused
    fn(*make(min(T, 64)))  # warm-up: kernels, allocator, thread pools
    inputs = make(T)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times, cpu_times = [], []
    for rep in range(a.repeats):
        for t in inputs[:2]:
            t.grad = None
        sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_reset_and_read()
        t0, c0 = time.perf_counter(), time.process_time()
        fn(*inputs)
        sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if rep == 0:
            if dev.type == "cuda":
                peak = torch.cuda.max_memory_allocated() - base
            else:
                peak = _status_bytes("VmHWM") - base
    # On a shared CPU the process's CPU time is the fairer clock (wall time includes waiting for
    # cores other people use); on CUDA the wall time after synchronize is the GPU time.
    clock = cpu_times if dev.type == "cpu" else times
    return {"peak_bytes": peak, "time_s": min(clock), "wall_s": min(times), "times": times,
            "cpu_times": cpu_times}


def _run_one(a: argparse.Namespace, method: str, T: int, H: int, V: int, chunk: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--method", method,
           "--tokens", str(T), "--hidden", str(H), "--vocab-shard", str(V),
           "--chunk-rows", str(chunk), "--v-block", str(a.v_block_scaled), "--dtype", a.dtype, "--device", a.device,
           "--threads", str(a.threads), "--temperature", str(a.temperature),
           "--repeats", str(a.repeats)]
    # Buffers >= 1 MiB come from mmap and go back to the OS when freed, so RSS follows live
    # memory (glibc's default dynamic threshold does the same for buffers > 32 MiB, i.e. for
    # every big buffer at full size; this keeps scaled-down runs honest too).
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["?"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--vocab-shard", type=int, default=152064 // 8)
    p.add_argument("--chunk-rows", type=int, default=1024)
    p.add_argument("--v-block", type=int, default=2048, help="vocab rows per fused tile")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply T, H, V/TP, chunk_rows and v-block (memory ratio preserved)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="time = best of N (peak: first run)")
    p.add_argument("--methods", nargs="+", default=["naive", "fused"], choices=["naive", "fused"])
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="fused", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._worker:
        print(json.dumps(_worker(a)))
        return 0

    s = a.scale
    H = max(1, round(a.hidden * s))
    V = max(1, round(a.vocab_shard * s))
    chunk = max(1, round(a.chunk_rows * s))
    a.v_block_scaled = max(1, round(a.v_block * s))
    print(f"device={a.device} dtype={a.dtype} threads={a.threads} scale={s} "
          f"H={H} V/TP={V} chunk_rows={chunk} v_block={a.v_block_scaled} "
          f"temperature={a.temperature}", flush=True)
    hdr = (f"{'T(full)':>8} {'T':>6} | {'naive MiB':>10} {'fused MiB':>10} {'mem x':>6} | "
           f"{'naive s':>8} {'fused s':>8} {'time x':>6}")
    if a.device == "cpu":
        print("times: process CPU seconds (single-threaded; the machine is shared), best of "
              f"{a.repeats}", flush=True)
    print(hdr + "\n" + "-" * len(hdr), flush=True)
    rows = []
    for t_full in a.tokens:
        T = max(1, round(t_full * s))
        res = {m: _run_one(a, m, T, H, V, chunk) for m in a.methods}
        row = {"T_full": t_full, "T": T, "H": H, "V_shard": V, "chunk_rows": chunk, **{
            f"{m}_{k}": v for m, r in res.items() for k, v in r.items()}}
        rows.append(row)
        if any("error" in r for r in res.values()):
            print(f"{t_full:>8} {T:>6} | " + "; ".join(f"{m}: {r['error']}" for m, r in res.items()
                                                       if "error" in r), flush=True)
            continue
        mib = {m: r["peak_bytes"] / 2 ** 20 for m, r in res.items()}
        if len(res) == 2:
            print(f"{t_full:>8} {T:>6} | {mib['naive']:>10.0f} {mib['fused']:>10.0f} "
                  f"{mib['naive'] / max(mib['fused'], 1e-9):>6.1f} | "
                  f"{res['naive']['time_s']:>8.2f} {res['fused']['time_s']:>8.2f} "
                  f"{res['fused']['time_s'] / res['naive']['time_s']:>6.2f}", flush=True)
        else:
            m = a.methods[0]
            print(f"{t_full:>8} {T:>6} | {m}: {mib[m]:.0f} MiB, {res[m]['time_s']:.2f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
