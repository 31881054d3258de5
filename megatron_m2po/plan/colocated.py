"""Colocated layouts (``rollout.colocate=true``): every GPU of the node time-shares two phases.

* **generating** -- the engine rank on the GPU holds SGLang's static memory (weights + KV pool)
  and its working set (activations, CUDA graphs, metadata), while the trainer is offloaded
  (``actor/offload.py``) and leaves only what offloading cannot free;
* **training** -- the trainer's usual peak (:func:`megatron_m2po.plan.memory.estimate`), while the
  engines have released their memory (``/release_memory_occupation``) and leave their residue;
* **pushing** -- the moment between them that holds both sides' weights (below).

Each must fit the GPU. The figures, with their sources (SGLang 0.5.23):

* SGLang sizes its static memory from the memory *free when it starts*: the KV pool is what is
  free after the weights load minus ``pre_model_load_memory * (1 - mem_fraction_static)``
  (``mem_cache/kv_cache_configurator.py`` ``_profile_available_bytes``), so weights + KV =
  ``engine_mem_fraction x free`` and the rest of the free memory is the engine's working set
  budget. Free = GPU - the offloaded trainer's residue - the engine's CUDA context.
* The working set SGLang itself reserves for activations and CUDA graphs
  (``arg_groups/memory_hook.py`` ``handle_gpu_memory_settings`` and ``reserve_for_graph_mb``):
  ``512 MiB + 1.5 MiB x max(chunked_prefill_size, 2048) + tp/8 GiB + 2 MiB x decode max_bs``,
  at least 10 GiB on GPUs over 60 GiB; ``chunked_prefill_size`` and the decode CUDA-graph
  ``max_bs`` by GPU memory from the same function's table (80 GiB: 8192 and 256, 512 from TP 4).
  The phase is refused when ``(1 - engine_mem_fraction) x free`` is smaller.
* What a released engine leaves: ``release_memory_occupation`` pauses the torch-memory-saver
  regions of the tags it is given (``managers/scheduler_components/weight_updater.py``; no tags =
  ``GPU_MEMORY_ALL_TYPES`` = kv_cache, weights, cuda_graph, ``constants.py``) and, with the KV
  cache, flushes it and empties the torch allocator cache (``flush_cache`` -> ``empty_cache``,
  ``managers/scheduler.py``). Left: the engine process's CUDA context (:data:`CUDA_CONTEXT_GIB`,
  not in SGLang's figures), SGLang's constant metadata (512 MiB, ``memory_hook.py``), the NCCL
  share ``tp/8`` GiB (``memory_hook.py``'s "adjustments for large parallel size") and, when the
  ``cuda_graph`` tag is not released, the graph pool (``2 MiB x max_bs``).
* **pushing** (between the two, ``trainer/colocated.py`` ``to_engines``): the trainer has offloaded
  its gradients and optimizer states (``actor.offload_states``) but not its weights (the handles
  point into its parameters), the engines have resumed their weights (not their KV pool): the
  trainer's weights and fixed overhead beside the engine's weights, plus the push's buckets: at most
  two packed buckets (``rollout.weight_sync_bucket_mb``) and one gathered tensor, the largest HF
  tensor whole (``weights/colocated.py`` ``run_colocated_stage``; measured on one H200 by
  ``tools/gpu_check.py --only colocated``: 1.1 GiB above the weights at 512 MiB buckets, 2.9 GiB
  at 2048 with 2.9 GiB of weights in all).
* What the offloaded trainer leaves: none of its training state (``actor/offload.py`` measures
  it: ``tests/actor/test_offload.py`` asserts 0 bytes of parameters, gradients, main parameters
  and Adam states after an offload); the fixed ``overhead`` of the layout (CUDA context, NCCL
  communicators, cuBLAS workspaces: none of them is freed by ``empty_cache``) stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["CUDA_CONTEXT_GIB", "EngineShare", "PhaseMemory", "ColocatedPhases", "phases"]

GiB = 1024 ** 3
MiB = 1024 ** 2

CUDA_CONTEXT_GIB = 0.5
"""One process's CUDA context on an H100 with CUDA 12 lazy module loading (about 500 MiB): outside
torch's allocator and outside SGLang's reserve."""


def sglang_capacity_defaults(gpu_mem_gib: float, tp: int) -> tuple[int, int]:
    """``(chunked_prefill_size, decode CUDA-graph max_bs)`` that SGLang 0.5.23 picks by GPU memory
    (``arg_groups/memory_hook.py`` ``handle_gpu_memory_settings``, its capacity table)."""
    mib = gpu_mem_gib * 1024
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


@dataclass(frozen=True)
class EngineShare:
    """One colocated engine rank's use of its GPU.

    Attributes:
        mem_fraction: ``rollout.engine_mem_fraction`` (SGLang ``--mem-fraction-static``).
        engine_tp: ``rollout.engine_tp``.
        gpu_mem_gib: the GPU's memory.
        release_cuda_graph: whether the release frees the CUDA-graph pool too (SGLang's default
            without tags; the trainer's push releases every tag).
    """

    mem_fraction: float
    engine_tp: int
    gpu_mem_gib: float
    release_cuda_graph: bool = True

    @property
    def graph_bytes(self) -> float:
        """The decode CUDA graphs' pool (``memory_hook.py`` ``reserve_for_graph_mb``: 2 MiB per batch size)."""
        return 2 * sglang_capacity_defaults(self.gpu_mem_gib, self.engine_tp)[1] * MiB

    def working_set_bytes(self) -> float:
        """What SGLang reserves beyond its static memory: activations, graphs, metadata, NCCL."""
        chunk, _ = sglang_capacity_defaults(self.gpu_mem_gib, self.engine_tp)
        mib = 512 + 1.5 * max(chunk, 2048) + self.engine_tp / 8 * 1024
        total = mib * MiB + self.graph_bytes
        return max(total, 10 * GiB) if self.gpu_mem_gib > 60 else total

    def residue_bytes(self) -> float:
        """What the engine leaves on the GPU once released (module docstring)."""
        left = CUDA_CONTEXT_GIB * GiB + 512 * MiB + self.engine_tp / 8 * GiB
        return left + (0.0 if self.release_cuda_graph else self.graph_bytes)


@dataclass(frozen=True)
class PhaseMemory:
    """One phase's bytes on a shared GPU: ``parts`` name every term; ``total`` is their sum."""

    name: str
    parts: dict[str, float]
    budget: float

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def ok(self) -> bool:
        return self.total <= self.budget


@dataclass(frozen=True)
class ColocatedPhases:
    """The two phases of a shared GPU (the worst trainer stage), and the engine's figures."""

    generating: PhaseMemory
    training: PhaseMemory
    pushing: PhaseMemory
    share: EngineShare
    max_mem_fraction: float   # the largest engine_mem_fraction whose working set still fits
    kv_bytes: float           # the engine rank's KV pool (static memory - its weights)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> PhaseMemory:
        return max(self.generating, self.training, self.pushing, key=lambda p: p.total)


def phases(trainer_total: float, trainer_residue: float, engine_weight_bytes: float, share: EngineShare,
           *, trainer_weights: float = 0.0, push_bytes: float = 0.0, budget: Optional[float] = None) -> ColocatedPhases:
    """The phases of one shared GPU.

    ``trainer_total``: the worst stage's training peak (``StageMemory.total``); ``trainer_residue``:
    what the offloaded trainer leaves (its fixed overhead); ``engine_weight_bytes``: one engine
    rank's weights (the model's bytes over ``engine_tp``); ``trainer_weights``: the worst stage's
    weights (its gradients and optimizer states left before the push); ``push_bytes``: the push's
    buffers on a GPU (:func:`push_buffer_bytes`)."""
    gpu = share.gpu_mem_gib * GiB if budget is None else budget
    ctx = CUDA_CONTEXT_GIB * GiB
    free = gpu - trainer_residue - ctx
    static = share.mem_fraction * free
    work = share.working_set_bytes()
    gen = PhaseMemory("generating", {
        "trainer residue (offloaded)": trainer_residue, "engine CUDA context": ctx,
        "engine weights": engine_weight_bytes, "engine KV pool": max(static - engine_weight_bytes, 0.0),
        "engine working set": work}, gpu)
    train = PhaseMemory("training", {"trainer peak": trainer_total,
                                     "released engine residue": share.residue_bytes()}, gpu)
    push = PhaseMemory("pushing", {
        "trainer weights (states offloaded)": trainer_weights, "trainer residue (overhead)": trainer_residue,
        "push buckets": push_bytes, "engine weights (resumed)": engine_weight_bytes,
        "released engine residue": share.residue_bytes()}, gpu)
    max_frac = max(0.0, 1.0 - work / free) if free > 0 else 0.0
    notes = []
    if static <= engine_weight_bytes:
        notes.append(f"engine_mem_fraction={share.mem_fraction:g} of {free / GiB:.1f} GiB free holds no KV cache "
                     f"beyond the engine's weights ({engine_weight_bytes / GiB:.1f} GiB)")
    return ColocatedPhases(gen, train, push, share, max_frac, max(static - engine_weight_bytes, 0.0), notes)


def push_buffer_bytes(bucket_bytes: float, largest_tensor_bytes: float, weight_bytes: float) -> float:
    """The colocated push's memory on a GPU beyond the trainer's state: two packed buckets (no more
    than the weights in all) and one gathered tensor (module docstring, "pushing")."""
    return min(2 * bucket_bytes, weight_bytes) + largest_tensor_bytes


def to_dict(ph: ColocatedPhases) -> dict:
    """``m2po plan --json``'s ``colocated`` entry (bytes)."""
    return {"generating": dict(ph.generating.parts, total=ph.generating.total, budget=ph.generating.budget),
            "training": dict(ph.training.parts, total=ph.training.total, budget=ph.training.budget),
            "pushing": dict(ph.pushing.parts, total=ph.pushing.total, budget=ph.pushing.budget),
            "max_engine_mem_fraction": ph.max_mem_fraction, "kv_bytes": ph.kv_bytes, "notes": list(ph.notes)}


def print_phases(con, ph: ColocatedPhases) -> None:
    """The two phases as ``m2po plan`` prints them (a rich console)."""
    from rich.table import Table

    t = Table(title=f"colocated: one shared GPU's phases (GiB of {ph.generating.budget / GiB:.1f})")
    t.add_column("phase")
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for p in (ph.generating, ph.training, ph.pushing):
        for i, (k, v) in enumerate(p.parts.items()):
            t.add_row(p.name if i == 0 else "", k, f"{v / GiB:.2f}")
        t.add_row("", f"[bold]{p.name} total[/]" + ("" if p.ok else " [red](does not fit)[/]"),
                  f"[bold]{p.total / GiB:.2f}[/]")
    con.print(t)
    s = ph.share
    con.print(f"engine: SGLang mem_fraction_static={s.mem_fraction:g} (KV pool {ph.kv_bytes / GiB:.1f} GiB; at most "
              f"{ph.max_mem_fraction:.2f} leaves its working set room), TP={s.engine_tp}; released engines keep "
              f"{s.residue_bytes() / GiB:.2f} GiB (CUDA context, metadata, NCCL"
              + ("" if s.release_cuda_graph else ", CUDA graphs") + "; docs/planner.md)", highlight=False)
    for n in ph.notes:
        con.print(f"[yellow]warning:[/] {n}")


# ------------------------------------------------------------------------------------------------
# Generation time, for `m2po plan --search`'s colocated-vs-disaggregated comparison
# ------------------------------------------------------------------------------------------------

HOST_GBS = 25.0
"""Achieved pinned host <-> device copy bandwidth per GPU (PCIe Gen5 x16: 64 GB/s peak, ~25-50
achieved with 8 GPUs sharing the host's memory): the offload and reload of colocated mode."""


@dataclass(frozen=True)
class GenerationEstimate:
    """A step's rollouts on ``engines`` engines: decode as a memory-bandwidth roofline.

    Each decode iteration of an engine rank reads its weights and the KV of its running sequences
    once: ``(weights + batch x mean context x KV bytes per token) / HBM bandwidth``; ``batch`` is
    what its KV pool holds at full length (SGLang admits requests while the pool has room), at
    most its share of the step's sequences; the step takes ``max(tokens / batch, max_new)``
    iterations (the longest response bounds it). Prefill (compute-bound, the prompt once) and the
    scheduler's per-iteration host time are left out: a lower bound, the same for both placements."""

    seconds: float
    engines: int
    batch: float
    iter_s: float
    kv_bytes: float


def kv_bytes_per_token(layers: int, kv_size: int, engine_tp: int) -> float:
    """bf16 K and V of one token on one engine rank (KV heads split over its TP, at least one)."""
    return 2 * layers * kv_size * 2 / engine_tp


def generation_time(*, layers: int, kv_size: int, weight_bytes: float, sequences: int, prompt_len: int,
                    max_new: int, mean_frac: float, gpus: int, engine_tp: int, kv_bytes: float,
                    hbm_gbs: float) -> GenerationEstimate:
    """:class:`GenerationEstimate` of ``sequences`` rollouts on ``gpus // engine_tp`` engines whose
    ranks hold ``weight_bytes`` of weights and a ``kv_bytes`` KV pool each."""
    engines = max(gpus // engine_tp, 0)
    if engines == 0 or kv_bytes <= 0:
        return GenerationEstimate(float("inf"), engines, 0.0, float("inf"), kv_bytes)
    per_tok = kv_bytes_per_token(layers, kv_size, engine_tp)
    mean_new = mean_frac * max_new
    seqs = sequences / engines
    batch = max(1.0, min(seqs, kv_bytes / (per_tok * (prompt_len + max_new))))
    iter_s = (weight_bytes + batch * (prompt_len + mean_new / 2) * per_tok) / (hbm_gbs * 1e9)
    iters = max(seqs * mean_new / batch, float(max_new))
    return GenerationEstimate(iters * iter_s, engines, batch, iter_s, kv_bytes)


def switch_seconds(copied_bytes: float, host_gbs: float = HOST_GBS) -> float:
    """A colocated step's offload + reload: the trainer's copied state out and back over the host link."""
    return 2 * copied_bytes / (host_gbs * 1e9)
