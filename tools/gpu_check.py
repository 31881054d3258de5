"""GPU check: what the CPU test suite cannot prove, on one or two CUDA GPUs in a few minutes.

    python tools/gpu_check.py                   # CUDA GPUs: every row (row 4 needs two)
    python tools/gpu_check.py --cpu-smoke       # CPU, tiny shapes: the machinery only (CI runs this)
    python tools/gpu_check.py --json out.json   # the rows as JSON too

Every row runs in the trainer's environment: the check re-executes itself through
``scripts/train.sh --exec`` (allocator, NCCL and CUDA settings, the NCCL preload) and prints it
under the header; ``--shell-env`` runs in the shell's instead.

It prints one table, a row per claim:

1. **actor numerics** -- the actor's CUDA path (Transformer Engine layer spec when
   ``transformer_engine`` is importable, its CPU twins otherwise: ``actor/te_twin.py``) in bf16
   computes the same token log-probs, entropies and gradient norm as the CPU fp32 path (the twin, the path
   every CPU test checks against HF transformers to 1e-5) on the same weights and batch: a random
   Qwen2-shaped model (GQA, qkv bias) whose weights are stored in bf16, so both paths start from
   identical values. The CPU fp32 reference runs in a subprocess with CUDA hidden and every
   GPU-only package blocked (``GPU_ONLY_MODULES``: Transformer Engine, and NVIDIA apex, amp_C and
   the other fused-kernel extensions an NGC image also has, which Megatron-Core would otherwise
   pick for the optimizer and gradient clipping and run on CPU tensors), exactly the code path of
   the CPU tests; it checks that Megatron chose torch AdamW and its local multi-tensor ops. Behaviour log-probs are
   each path's own log-probs plus the same fixed noise (std 0.05: M2 = 0.0025 < 0.04), so the
   M2PO mask keeps every token on both paths and no discrete decision can differ.

   Tolerance, and why: a bf16 path rounds every stored activation to 8 significant bits (a
   relative error of up to 2^-8) while the weights are identical and matmuls accumulate in fp32.
   How far that moves log-probs depends on the model and the batch (depth, scale of the logits),
   so the scale is measured, not assumed: the reference also computes its fp32 log-probs and
   entropies after a relative error of 2^-8 with random sign on every weight -- one bf16-sized
   rounding of every stored tensor of every layer, the same kind of perturbation as the bf16
   path's activation roundings. That deviation is the "unit". A correct bf16 path lands near one
   unit (round-to-nearest errors average less than 2^-8: CPU bf16 measured 0.5-0.8 units); the check asks for the RMS and the largest deviation each <= 4 units (room for the
   extra roundings in softmax, norms and residual adds, and for GPU kernels that differ from the
   CPU ones), and the M2PO gradient norm within 5 % (relative). A real defect (wrong RoPE, mask,
   GQA grouping, norm, bias mapping, vocab-parallel reduction) moves log-probs by a sizeable
   fraction of their spread: many units. A negative-control row shows the check has teeth on
   this very model: the fp32 path with its q/k/v biases dropped must land above 4 units (on CPU:
   15 at the smoke shapes, 31 at this row's GPU shapes, where CPU bf16 measured 0.6-0.8 units).

2. **fused log-prob vs naive, memory and time** -- ``megatron_m2po.parallel.logprobs`` (chunked,
   recomputing, never ``[T, V]`` logits) against materialised logits + ``log_softmax`` + entropy,
   forward + backward to the hidden states and the output weight, at one Qwen2.5-1.5B rank
   (T = 8192, H = 1536, V = 151936) and one Qwen2.5-32B TP=8 rank (T = 16384, H = 5120,
   V/TP = 19008), at the actor's default 2048 rows a chunk, with TF32 matmuls (the actor's
   ``parallel.logprob_tf32`` default) and with fp32 ones. Peak CUDA memory above the inputs (``max_memory_allocated``), best-of-3 time,
   and the log-probs of both methods (they must agree to 1e-3). Two naive variants: fp32 matmul
   (what tools/benchmarks/logprob_memory.py measures, same arithmetic as the fused kernel) and
   bf16 logits cast to fp32 (what Megatron RL stacks do).

3. **train-step throughput** -- tokens/s and MFU of one M2PO optimizer update of a
   Qwen2.5-1.5B-shaped model (28 layers, hidden 1536, GQA 12/2, SwiGLU 8960, vocab 151936,
   tied) with random weights on one GPU, TP = PP = DP = 1, bf16, 16 sequences of 512 prompt +
   1536 response tokens, one sequence per micro-batch, after one warm-up update. MFU counts the
   useful FLOPs only (3 x forward: matmuls, causal attention, the output layer on response
   rows); the M2PO mask pre-pass (one more forward) and the fused log-prob's recomputed logits
   are real work it does not credit. Peak FLOP/s: 989 TFLOP/s dense bf16 for H100 / H200 SXM
   (--peak-tflops for another GPU); compare with the planner's ``gemm_eff`` (docs/planner.md).
   ``--lora-rank R``: the same update with LoRA adapters of rank R on the frozen base (the
   default targets), for tokens/s and peak memory beside full weights (its MFU still counts
   3 x forward, though a frozen base computes no weight gradients).

4. **packed sequences at TP=2 + sequence parallel** -- the layout every recipe trains with:
   two ranks (processes started with torchrun's environment, NCCL), tensor parallel 2 with
   sequence parallelism, micro-batches packed under a token budget (THD: Transformer Engine's
   ``padding_causal`` attention with ``cu_seqlens``, its fused THD RoPE, the SP padding
   pseudo-sequence when a pack's length is odd), bf16, on row 1's model and batch, against row
   1's CPU fp32 reference (one process, unpacked) with row 1's tolerance: log-probs, entropies
   and the M2PO gradient norm. Needs 2 GPUs: with fewer the row is refused by name
   ("row 4 needs 2 GPUs, found K") and the exit status is 2.

5. **context parallel 2** -- row 4's machinery at ``parallel.context_parallel=2`` (TP=1): every
   packed sequence padded to a multiple of 2 x CP and split into Megatron's load-balanced chunks
   (rank r holds chunks r and 3 - r), Transformer Engine's CP attention over the pair with
   ``cp_comm_type=p2p`` (on CPU: ``actor/attention.py`` ``cp_causal_attention``), RoPE at the
   chunks' original positions, log-probs and loss on each rank's own tokens; against row 1's
   CPU fp32 reference with row 1's tolerance. Needs 2 GPUs, refused by name otherwise.

6. **MoE numerics** -- row 1's claim and tolerance on a random Qwen3-MoE-shaped model (4 layers,
   hidden 512, GQA 8/2 with QK norm, every layer MoE: 8 experts of size 512, top-2 renormalised,
   weights stored in bf16): the actor's CUDA bf16 path on one GPU at EP=1 (Transformer Engine
   spec when importable, its experts then ``TEGroupedMLP``; the twin's ``LocalGroupedMLP``
   otherwise) against the CPU fp32 reference, log-probs and entropies RMS and max <= 4 units
   (unit: the 2^-8 weight perturbation), the M2PO gradient norm within 5 %. Routing is replayed
   on both paths (``algo.routing_replay=rollout``) with the same expert ids, those HF
   transformers' fp32 forward picks: under bf16 a near-tied router score could swap a token's
   experts, a discrete flip no rounding tolerance covers (``gpu_checks/moe.py`` says why margins
   cannot prevent it). Negative control: the fp32 path with every replayed expert id shifted by
   one (e -> e+1 mod 8) must land above 4 units.

7. **MoE routing imbalance** -- what the planner's ``model.moe.routing_imbalance`` assumes (the
   hottest expert-parallel rank receives that multiple of the mean token copies: RL routes dropless
   with the load-balancing loss off). Prompts (``--moe-data``: a DeepScaleR .parquet / .jsonl; else
   the synthetic task) with the responses the model samples itself at T=1, one forward per
   sequence with a hook on every router (``mlp.gate``) counting each token's top-k experts,
   dispatch groups of 4,096 tokens, experts grouped into EP ranks as Megatron places them; per EP
   in 2, 4, 8 the worst layer's max-over-ranks / mean. With a pretrained checkpoint
   (``--moe-model /models/Qwen3-30B-A3B``, bf16 on one GPU) PASS when the worst layer is at most the
   planner's default, FAIL otherwise (re-plan with the measured value); the row's own random MoE and
   the tiny base (``--moe-model tiny``) have untrained routers: INFO.

8. **disk weight push bandwidth** -- ``--push-gb`` (16) of bf16 safetensors shards written at
   ``--push-dir`` (the filesystem of ``rollout.weight_sync_dir``) by the production writer until
   ``fsync``, dropped from the page cache, then read onto the GPU as an engine's load reads them:
   write and read GB/s, and what a 32B push (64 GB) takes at those rates against the timeout the
   push gets (``rollout/push_timeout.py``). PASS when the read is at least
   ``rollout.weight_sync_min_gbps``.

9. **colocated cycle** -- the actor (row 3's 1.5B shape, bf16, distributed optimizer) and an engine
   process (``gpu_checks/colocated_engine.py``: the base checkpoint on the same GPU under HF names,
   a 24 GiB KV pool, SGLang 0.5.23's routes and its reading of ``/update_weights_from_tensor``
   payloads, the CPU worker's code) time-share one GPU through colocated mode's own calls in
   ``trainer/colocated.py``'s order: engine release, ``actor.reload()``, one update, engine resumes
   weights, ``ColocatedWeightSync.push`` (CUDA IPC handles in flattened buckets), ``actor.offload()``,
   engine resumes KV; 3 cycles. PASS when after every push the engine holds the trainer's weights
   bit for bit (an integer digest of each tensor's bytes on both sides) and every offload leaves at
   most 1 % of the training state allocated; the seconds of each phase, the push's GB/s beside a
   plain device copy of the same bytes, and the GPU memory in use in each state are reported.

10. **expert LoRA backward through the grouped GEMM** -- ``actor/lora.py`` ``ExpertLoRA``'s hook on a
   Qwen3-30B-A3B-shaped layer's experts (128 experts, hidden 2048, ffn 768, rank 32, 16,384 routed
   token copies, two experts empty), bf16: the two ``torch._grouped_mm`` calls it makes on Hopper
   against its per-expert loop, output and the gradients of the input and both adapter matrices,
   each against an fp32 loop from the same bf16 values: PASS when the grouped path's relative RMS
   error is at most twice the loop's plus 2^-10, for ``gate_up`` and ``down``; a negative control
   (half of one expert's rows counted to the next) must fail that bound. SKIP, saying so, where the
   grouped GEMM does not serve (then the loop trains, as on CPU). Backward milliseconds of both.

11. **LoRA against HF peft on the GPU tree** -- the actor (row 1's model, bf16, Transformer Engine's
   spec where it imports: the input norms inside ``linear_qkv`` / ``linear_fc1``) with rank-8
   adapters on every default target and random ``B``, its response log-probs against HF peft in
   fp32 on CPU loading the adapters the actor exported (``write_peft_dir``), in row 1's units:
   PASS when RMS and max are each <= 4 units; negative control: peft with the adapters disabled
   must land above 4 units (an adapter on the un-normalised input moves log-probs by as much).

12. **what an offloaded trainer leaves on its GPU** -- two ranks (TP=2 + SP, NCCL, distributed
   optimizer, row 1's model in bf16), one update, ``actor.offload()``: the GPU memory each rank still
   holds beyond its CUDA context (``cudaMemGetInfo``) and torch's allocated / reserved bytes, in the
   trainer's environment (NVLink SHARP at NCCL's default) and with ``NCCL_NVLS_ENABLE`` flipped
   (INFO). PASS when the residue is within the planner's 3 GiB overhead and torch keeps <= 1 % of
   the update's bytes. Needs 2 GPUs, refused by name otherwise.

``--cpu-smoke`` runs the same code at tiny shapes on CPU (CUDA hidden and the GPU-only packages
blocked in every process, so it runs the same in the NGC image): row 1 compares CPU bf16 with the
CPU fp32 reference (same tolerance), row 2 checks agreement and time (the memory column needs the
CUDA allocator: skipped, with the reason), row 3 measures tokens/s (no MFU: no CPU peak), row 4
runs its two ranks on gloo with Megatron's local layer spec and the actor's packed attention (row 5: its CP attention)
(``actor/attention.py``), row 6 compares CPU bf16 with the CPU fp32 reference on a 2-layer MoE (hidden 64), row 7
counts routing on that MoE (INFO), row 8 writes and reads 64 MB (INFO), row 9 runs 3 colocated cycles of the tiny
model through host memory, row 10 compares CPU's ``_grouped_mm`` with the loop in fp32 at 16 experts, row 11 the CPU
bf16 twin with LoRA against peft, row 12 offloads two gloo ranks (torch's bytes only). It proves that the table, the comparisons and
the two-rank launch run, not any GPU claim.

Needs megatron-core and mbridge (the versions in constraints-cpu.txt); without them the actor
rows are skipped and the message says how to install them. Exit status: 0 all rows passed or
informational, 1 a check failed, 2 rows were skipped (a missing package, or too few GPUs).
"""

from __future__ import annotations
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Optional

# The rows live in tools/gpu_checks/ by concern (its __init__ lists them); this file is the CLI and
# names what tests and callers use (``gpu_check.compare``, ``gpu_check.Row``, ...).
ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tools"):  # the package and the rows (tools/gpu_checks/), also when run as a script
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# The rows run in the environment the trainer runs in: scripts/train.sh's (allocator, NCCL, CUDA
# settings, the NCCL preload), not the shell's. Run directly, the check re-executes itself through
# ``scripts/train.sh --exec`` before anything reads that environment (torch included); the worker
# subprocesses it starts inherit it. ``--shell-env`` keeps the shell's environment instead.
TRAINER_ENV_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "LD_PRELOAD", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
if (__name__ == "__main__" and os.environ.get("M2PO_TRAINER_ENV") != "1" and "--shell-env" not in sys.argv
        and not any(a.startswith("--_") for a in sys.argv)):
    os.execv("/bin/bash", ["bash", str(ROOT / "scripts" / "train.sh"), "--exec", sys.executable,
                           str(Path(__file__).resolve()), *sys.argv[1:]])

import torch  # noqa: E402

from gpu_checks.colocated import COLOCATED_CHECK, row_colocated  # noqa: E402
from gpu_checks.disk_push import DISK_PUSH_CHECK, row_disk_push  # noqa: E402
from gpu_checks.expert_lora import EXPERT_LORA_CHECK, row_expert_lora  # noqa: E402
from gpu_checks.lora import LORA_CHECK, peft_reference_worker, row_lora_peft  # noqa: E402
from gpu_checks.offload_memory import OFFLOAD_CHECK, offload_rank_worker, row_offload_memory  # noqa: E402
from gpu_checks.env import (GPU_ONLY_MODULES, block_gpu_only_modules, check_cpu_fallbacks,  # noqa: E402,F401
                            install_message, missing_packages, peak_tflops, spec_name)
from gpu_checks.imbalance import IMBALANCE_CHECK, row_routing_imbalance  # noqa: E402
from gpu_checks.logprobs import LOGPROB_AGREE, measure_logprob, row_logprobs  # noqa: E402,F401
from gpu_checks.models import (actor_outputs, make_batch, make_random_hf, make_random_qwen2,  # noqa: E402,F401
                               save_routed_experts)
from gpu_checks.moe import MOE_CHECK, row_moe_numerics  # noqa: E402,F401
from gpu_checks.numerics import (GRAD_NORM_TOL, MAX_TOL, RMS_TOL, _reference_worker, compare,  # noqa: E402,F401
                                 comparison_rows, row_actor_numerics, start_reference)
from gpu_checks.packed import (CP_CHECK, PACKED_CHECK, _packed_rank_worker, gpus_refusal, row_cp,  # noqa: E402,F401
                               row_packed_tp_sp, run_packed_ranks)
from gpu_checks.report import COLUMNS, Row, format_table, guarded, parse_table  # noqa: E402,F401
from gpu_checks.throughput import row_throughput, train_flops  # noqa: E402,F401

ROWS = {"numerics": 1, "logprobs": 2, "throughput": 3, "packed": 4, "cp": 5, "moe": 6,  # --only names -> row numbers
        "imbalance": 7, "disk_push": 8, "colocated": 9, "expert_lora": 10,
        "lora": 11, "offload_memory": 12}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n", 1)[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU; CUDA-only measurements are skipped with the reason (CI)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--shell-env", action="store_true",
                    help="run in the shell's environment, not scripts/train.sh's (the default: the trainer's)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU for the MFU")
    ap.add_argument("--work-dir", help="where the random models go (default: a temporary directory)")
    ap.add_argument("--moe-model", help="row 7: an HF MoE checkpoint to measure (or 'tiny'; default the row's random MoE)")
    ap.add_argument("--moe-data", help="row 7: prompts, a DeepScaleR .parquet / .jsonl (default the synthetic task)")
    ap.add_argument("--push-dir", help="row 8: directory on the weight-sync filesystem (default the work directory)")
    ap.add_argument("--push-gb", type=float, default=None, help="row 8: GB of shards to write and read (default 16)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="row 3: train LoRA adapters of this rank on the frozen base (default 0: full weights)")
    ap.add_argument("--bucket-mb", type=float, default=512.0,
                    help="row 9: the push's bucket size (rollout.weight_sync_bucket_mb, default 512)")
    ap.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS),
                    help="run only these rows (" + ", ".join(f"{k}: row {v}" for k, v in ROWS.items()) + ")")
    ap.add_argument("--_reference", nargs=3, metavar=("HF_DIR", "BATCH_JSON", "OUT_NPZ"), help=argparse.SUPPRESS)
    ap.add_argument("--_peft_reference", nargs=4, metavar=("HF_DIR", "ADAPTER_DIR", "BATCH_JSON", "OUT_NPZ"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--_offload_rank", nargs=4, metavar=("HF_DIR", "BATCH_JSON", "OUT", "SMOKE"), help=argparse.SUPPRESS)
    ap.add_argument("--_packed_rank", nargs=5, metavar=("HF_DIR", "BATCH_JSON", "OUT_NPZ", "SMOKE", "WHICH"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._reference:
        return _reference_worker(*a._reference)
    if a._packed_rank:
        return _packed_rank_worker(*a._packed_rank)
    if a._offload_rank:
        return offload_rank_worker(*a._offload_rank)
    if a._peft_reference:
        return peft_reference_worker(*a._peft_reference)
    if a.cpu_smoke:
        # CPU only, also on a GPU machine or in the NGC image: CUDA hidden before torch initialises
        # it, the GPU-only packages blocked before Megatron-Core picks its kernels.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        block_gpu_only_modules()
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu_smoke:
        print("tools/gpu_check.py: no CUDA device (torch.cuda.is_available() is False). Run it on a GPU "
              "machine, or pass --cpu-smoke to check the machinery at tiny shapes on CPU.", file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name() if cuda and not a.cpu_smoke else "cpu"
    missing = missing_packages()
    mc = _version("megatron-core")
    header = (f"gpu_check{' --cpu-smoke' if a.cpu_smoke else ''}: device={dev} torch={torch.__version__} "
              f"megatron-core={mc or 'missing'} layer-spec={spec_name()}\n"
              + ("environment: scripts/train.sh's: " if os.environ.get("M2PO_TRAINER_ENV") == "1" else
                 "environment: the shell's (--shell-env), not the trainer's: ")
              + " ".join(f"{k}={os.environ[k]}" for k in TRAINER_ENV_VARS if os.environ.get(k)))
    rows: list[Row] = []
    rc = 0

    def needing(absent: list[str], check: str, fn, *args) -> list[Row]:
        """The rows of ``fn(*args)``, or one SKIP row naming the packages ``absent``."""
        if absent:
            return [Row(check, "-", f"skipped: {', '.join(absent)} missing", "-", "SKIP")]
        return guarded(check, fn, *args)

    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "numerics" in a.only:
            rows += needing(missing, "actor bf16 vs CPU fp32", row_actor_numerics, a.cpu_smoke, work)
        if "logprobs" in a.only:
            rows += guarded("fused log-prob vs naive", row_logprobs, a.cpu_smoke)
        if "throughput" in a.only:
            rows += needing(missing, "train step (M2PO update)", row_throughput, a.cpu_smoke, work,
                            peak_tflops(a.peak_tflops) if not a.cpu_smoke else None, a.lora_rank)
        if "packed" in a.only:
            rows += needing(missing, PACKED_CHECK, row_packed_tp_sp, a.cpu_smoke, work)
        if "cp" in a.only:
            rows += needing(missing, CP_CHECK, row_cp, a.cpu_smoke, work)
        if "moe" in a.only:
            rows += needing(missing, MOE_CHECK, row_moe_numerics, a.cpu_smoke, work)
        if "imbalance" in a.only:
            rows += needing([m for m in missing if m == "transformers"], IMBALANCE_CHECK, row_routing_imbalance,
                            a.cpu_smoke, work, a.moe_model, a.moe_data)
        if "disk_push" in a.only:
            rows += guarded(DISK_PUSH_CHECK, row_disk_push, a.cpu_smoke, work, a.push_dir, a.push_gb)
        if "colocated" in a.only:
            rows += needing(missing, COLOCATED_CHECK, row_colocated, a.cpu_smoke, work, a.bucket_mb)
        if "expert_lora" in a.only:
            rows += needing(missing, EXPERT_LORA_CHECK, row_expert_lora, a.cpu_smoke)
        if "lora" in a.only:
            no_peft = importlib.util.find_spec("peft") is None
            rows += needing(missing + ["peft"] * no_peft, LORA_CHECK, row_lora_peft, a.cpu_smoke, work)
        if "offload_memory" in a.only:
            rows += needing(missing, OFFLOAD_CHECK, row_offload_memory, a.cpu_smoke, work)
    print(format_table(rows, header), flush=True)
    if missing:
        print("\n" + install_message(missing), file=sys.stderr)
        rc = 2
    if any(r.verdict == "SKIP" and r.result.startswith("refused:") for r in rows):
        rc = 2
    if any(r.verdict == "FAIL" for r in rows):
        rc = 1
    if a.json:
        Path(a.json).write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2,
                                           default=float))
    return rc


def _version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
