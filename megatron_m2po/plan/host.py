"""Host (CPU) memory of one node: what the trainer page-locks, beside its processes.

GPU memory is not the only memory a layout can run out of. Two features keep copies of GPU state in
host memory, page-locked so that the copies run asynchronously (locked memory cannot be swapped
out or given back while the run lives):

* **the frozen reference** of the KL term (``algo.kl.coef > 0`` without LoRA; ``actor/reference.py``):
  a copy of the stage's base weights, ``params x param_bytes`` per trainer process (under LoRA the
  reference is the base with the adapters disabled: no copy);
* **the offloaded trainer** of colocated mode (``rollout.colocate=true``; ``actor/offload.py``):
  while the engines generate, the parameters and the optimizer's fp32 main parameters and Adam
  states wait in host buffers (the gradient buffers are freed, not copied): the stage's weights and
  optimizer states per trainer process.

Both are allocated at exactly their size (``utils/pinned.py``: torch's pinned allocator would round
each allocation up to a power of two, up to twice the figure). Besides them every process on the
node -- a trainer rank, an engine rank -- holds its own pageable memory (the CUDA runtime's host
side, NCCL's host buffers, the Python heap of torch and Megatron-Core or SGLang): an allowance of
:data:`PROCESS_GIB` each (``--host-process-gib``), a stated estimate, not a measurement.

Per node the plan takes the worst stage's figures for every trainer process on the node (a node
can hold one stage only; the bound is exact then) and refuses a layout whose total exceeds the
node's RAM (``--host-mem-gib``, default :data:`NODE_GIB`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NODE_GIB", "PROCESS_GIB", "HostMemory", "host_memory"]

GiB = 1024 ** 3

NODE_GIB = 1024.0
"""Default RAM of a training node (GiB): 8-GPU H100 / H200 nodes carry 1-2 TiB (DGX H100: 2 TiB);
the lower end, so that the default check is the cautious one."""

PROCESS_GIB = 4.0
"""Pageable host memory allowed per GPU process (a trainer rank or an engine rank), GiB."""


@dataclass(frozen=True)
class HostMemory:
    """One node's host memory: ``parts`` (bytes, summed over the node's processes) and the budget."""

    parts: dict[str, float] = field(default_factory=dict)
    budget: float = NODE_GIB * GiB
    trainer_procs: int = 8
    engine_procs: int = 0

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def pinned(self) -> float:
        return sum(v for k, v in self.parts.items() if k != "processes")

    @property
    def ok(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        shown = ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.parts.items() if v)
        return (f"host memory per node: {self.total / GiB:.1f} GiB of {self.budget / GiB:.0f} GiB "
                f"({shown} GiB; {self.trainer_procs} trainer + {self.engine_procs} engine processes)")

    def refusal(self) -> str:
        fixes = []
        if self.parts.get("offloaded trainer state (pinned)"):
            fixes.append("parallel.use_distributed_optimizer=true or more data parallel (shards the optimizer "
                         "states that colocated mode offloads)")
        if self.parts.get("reference copy (pinned)"):
            fixes.append("model.lora.rank > 0 (the reference is the base with adapters disabled: no copy) or "
                         "algo.kl.coef=0")
        if self.parts.get("teacher copy (pinned)"):
            fixes.append("a smaller teacher (algo.distill.teacher) or algo.distill.coef=0")
        fixes += ["more tensor / pipeline parallelism (smaller stages)", "a node with more RAM (--host-mem-gib)"]
        return (f"{self.describe().replace('host memory per node: ', 'host memory per node needs ', 1)}: "
                f"more than the node's RAM; use " + ", or ".join(fixes))


def host_memory(*, reference_bytes: float, weights: float, optimizer: float, offload: bool, trainer_procs: int,
                engine_procs: int, node_gib: float = NODE_GIB, process_gib: float = PROCESS_GIB,
                teacher_bytes: float = 0.0) -> HostMemory:
    """The node's host memory for a stage's figures (bytes per trainer process; module docstring)."""
    parts = {
        "reference copy (pinned)": reference_bytes * trainer_procs,
        **({"teacher copy (pinned)": teacher_bytes * trainer_procs} if teacher_bytes else {}),
        "offloaded trainer state (pinned)": (weights + optimizer) * trainer_procs if offload else 0.0,
        "processes": (trainer_procs + engine_procs) * process_gib * GiB,
    }
    return HostMemory(parts=parts, budget=node_gib * GiB, trainer_procs=trainer_procs, engine_procs=engine_procs)
