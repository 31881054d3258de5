"""A per-node ledger of what the CPU stand-ins hold on each (emulated) GPU, against a per-GPU budget.

On a GPU node the trainer and colocated SGLang engines share each GPU's memory: an engine that
resumes its weights while the trainer still holds its optimizer states runs out of memory (the
peers' most reported colocated failure, docs/PITFALLS). CPU runs have no device memory to run out
of, so the stand-ins record here what they would hold, and a record that takes a GPU past its
budget raises :class:`GpuBudgetExceeded` -- the CPU analogue of a CUDA out-of-memory error, at the
same moment.

Off unless ``M2PO_STANDIN_GPU_LEDGER`` names a directory. Then every process of the node (the CPU
worker, the trainer's ranks) records into one JSON file there, ``<node>.json``, under an exclusive
``fcntl`` lock on ``<node>.lock`` (read, change, write to a temporary file, rename):

- the node is ``M2PO_STANDIN_NODE`` (default: the host name), so a rehearsal that plays several
  nodes on one machine keeps one ledger per node;
- the budget is ``M2PO_STANDIN_GPU_BUDGET_BYTES`` bytes per GPU (unset: no limit, records only);
- an entry is ``owner -> (bytes, pid)`` per GPU; ``record(gpu, owner, 0)`` drops it. Entries of a
  process that has exited are dropped at the next access (its memory went with it, as a killed
  process's device memory does).

Example::

    from megatron_m2po.standins import memory_ledger
    memory_ledger.record(0, "trainer/rank0/optimizer", 3 << 30)   # no-op when the ledger is off
    memory_ledger.resident(0)  # {"trainer/rank0/optimizer": 3221225472, "cpu_worker@...:weights": ...}
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional

LEDGER_ENV = "M2PO_STANDIN_GPU_LEDGER"  # directory of the ledgers; the ledger is off unless set
BUDGET_ENV = "M2PO_STANDIN_GPU_BUDGET_BYTES"  # bytes one GPU holds (unset: no limit)
NODE_ENV = "M2PO_STANDIN_NODE"  # this process's node (default: the host name)


class GpuBudgetExceeded(RuntimeError):
    """A record would take a GPU past its budget (what CUDA answers with an out-of-memory error)."""

    def __init__(self, node: str, gpu: int, owner: str, nbytes: int, others: Mapping[str, int],
                 budget: int) -> None:
        held = ", ".join(f"{o}={b / 2**20:.1f} MiB" for o, b in sorted(others.items())) or "nothing"
        super().__init__(
            f"GPU {gpu} of node {node!r}: {owner} needs {nbytes / 2**20:.1f} MiB but {held} is already resident; "
            f"{(sum(others.values()) + nbytes) / 2**20:.1f} MiB > the budget of {budget / 2**20:.1f} MiB "
            f"({BUDGET_ENV}). Release or offload the others first (colocated engines: "
            "/release_memory_occupation; the trainer: offload before the engines resume)")
        self.node, self.gpu, self.owner, self.nbytes, self.budget = node, gpu, owner, nbytes, budget
        self.others = dict(others)


def _alive(pid: int) -> bool:
    """True while process ``pid`` runs (a zombie has released its memory: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class MemoryLedger:
    """The ledger file of one node (see the module docstring); safe across processes."""

    directory: Path
    node: str
    budget_bytes: Optional[int] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["MemoryLedger"]:
        """The ledger the environment names; None when ``M2PO_STANDIN_GPU_LEDGER`` is unset or empty."""
        directory = env.get(LEDGER_ENV)
        if not directory:
            return None
        budget = env.get(BUDGET_ENV)
        try:
            budget_bytes = int(budget) if budget else None
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={budget!r}: a number of bytes per GPU") from None
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"{BUDGET_ENV}={budget!r}: must be > 0")
        Path(directory).mkdir(parents=True, exist_ok=True)
        return cls(Path(directory), env.get(NODE_ENV) or socket.gethostname(), budget_bytes)

    @property
    def path(self) -> Path:
        return self.directory / f"{self.node}.json"

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        """The node's entries ``{gpu: {owner: [bytes, pid]}}`` under the lock; written back on exit."""
        with open(self.directory / f"{self.node}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                gpus = json.loads(self.path.read_text()) if self.path.exists() else {}
                for owners in gpus.values():
                    for owner in [o for o, (_, pid) in owners.items() if not _alive(pid)]:
                        del owners[owner]
                yield gpus
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps({g: o for g, o in gpus.items() if o}, sort_keys=True))
                os.replace(tmp, self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def record(self, gpu: int, owner: str, nbytes: int) -> None:
        """``owner`` now holds ``nbytes`` on ``gpu`` (0: nothing; its entry is dropped).

        Raises :class:`GpuBudgetExceeded` (and records nothing) when the owner grows and the GPU's
        total would pass the budget; shrinking is always recorded."""
        if nbytes < 0:
            raise ValueError(f"record({gpu}, {owner!r}, {nbytes}): bytes must be >= 0")
        with self._locked() as gpus:
            owners = gpus.setdefault(str(int(gpu)), {})
            before = owners.get(owner, [0, 0])[0]
            others = {o: b for o, (b, _) in owners.items() if o != owner}
            if self.budget_bytes is not None and nbytes > before and sum(others.values()) + nbytes > self.budget_bytes:
                raise GpuBudgetExceeded(self.node, int(gpu), owner, nbytes, others, self.budget_bytes)
            if nbytes:
                owners[owner] = [int(nbytes), os.getpid()]
            else:
                owners.pop(owner, None)

    def resident(self, gpu: int) -> dict[str, int]:
        """``{owner: bytes}`` held on ``gpu`` now (owners that hold nothing are absent)."""
        with self._locked() as gpus:
            return {o: b for o, (b, _) in gpus.get(str(int(gpu)), {}).items()}


def record(gpu: int, owner: str, nbytes: int) -> None:
    """:meth:`MemoryLedger.record` on the environment's ledger; nothing when the ledger is off."""
    ledger = MemoryLedger.from_env()
    if ledger is not None:
        ledger.record(gpu, owner, nbytes)


def resident(gpu: int) -> dict[str, int]:
    """:meth:`MemoryLedger.resident` on the environment's ledger; ``{}`` when the ledger is off."""
    ledger = MemoryLedger.from_env()
    return {} if ledger is None else ledger.resident(gpu)
