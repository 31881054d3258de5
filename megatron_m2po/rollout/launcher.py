"""How engines are started: the launcher protocol, the local (subprocess) launcher, fleet errors.

``EngineFleet`` (:mod:`.engines`) builds an :class:`EngineSpec` per engine and hands it to a
:class:`Launcher`; :class:`LocalLauncher` starts it as a child process, and
:class:`~megatron_m2po.rollout.ray_launcher.RayLauncher` as a Ray actor. Both raise
:class:`FleetError` when an engine cannot be started.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Protocol

from megatron_m2po.utils import lifeline
from megatron_m2po.utils.errors import UserError

__all__ = ["FleetError", "EngineSpec", "EngineHandle", "Launcher", "LocalHandle", "LocalLauncher",
           "sglang_python", "engine_env", "DROPPED_ENV_VARS", "DROPPED_ENV_PREFIXES"]

log = logging.getLogger("m2po.launcher")

# What a trainer process has in its environment that an engine must not inherit:
# - torchrun's per-worker variables (torch/distributed/elastic/agent/server/local_elastic_agent.py
#   ``_start_workers``). With TORCHELASTIC_USE_AGENT_STORE=True, torch's tcp:// rendezvous
#   (distributed/rendezvous.py ``_create_c10d_store``) makes even rank 0 a client of the agent's
#   store, so the engine's own ``init_process_group`` (SGLang: distributed/parallel_state.py
#   ``init_distributed_environment``) waits on a store nobody hosts; RANK / WORLD_SIZE / MASTER_*
#   would feed any ``env://`` init the trainer's world.
# - scripts/train.sh's trainer-only settings: CUDA_DEVICE_MAX_CONNECTIONS=1 (serialises the engine's
#   kernel queues), PYTORCH_CUDA_ALLOC_CONF (SGLang sizes its memory pools itself),
#   TORCH_NCCL_ASYNC_ERROR_HANDLING / NCCL_ASYNC_ERROR_HANDLING / ..._BLOCKING_WAIT (a failed weight
#   broadcast would kill the engine instead of failing the update).
# - placement and threads, which the launcher sets per engine: CUDA_VISIBLE_DEVICES (the engine's
#   GPUs; a trainer rank's list is the trainer's), OMP_NUM_THREADS (torchrun sets 1 for its N
#   processes on the node).
# Everything else (PATH, HF caches, NCCL_SOCKET_IFNAME / NCCL_IB_* / GLOO_SOCKET_IFNAME, SGLANG_*,
# M2PO_WEIGHT_SYNC_ADDR) passes through: it describes the node, not the trainer.
# scripts/launch_sglang_fleet.sh drops the same set (tests/rollout/test_engine_env.py checks both agree).
DROPPED_ENV_VARS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT",
    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
})
DROPPED_ENV_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")


def engine_env(spec_env: Mapping[str, str], *, base: Optional[Mapping[str, str]] = None,
               keep: Iterable[str] = ()) -> dict[str, str]:
    """The environment of an engine child: ``base`` (default ``os.environ``) without the trainer's
    variables (:data:`DROPPED_ENV_VARS`, names starting with :data:`DROPPED_ENV_PREFIXES`), then
    ``spec_env`` (the launcher's own settings for this engine: its GPUs, its threads) on top.

    ``keep``: dropped names to pass through anyway (a Ray actor keeps the ``CUDA_VISIBLE_DEVICES``
    Ray assigned it). What was dropped is logged at debug level."""
    base = os.environ if base is None else base
    keep = frozenset(keep)
    dropped = sorted(k for k in base if k not in keep and (k in DROPPED_ENV_VARS or k.startswith(DROPPED_ENV_PREFIXES)))
    env = {k: v for k, v in base.items() if k not in dropped}
    env.update(spec_env)
    if dropped:
        log.debug("engine environment: not inherited from the launcher: %s", ", ".join(dropped))
    return env


class FleetError(RuntimeError):
    """An engine or the router could not be started, reached or validated."""


class FleetSetupError(FleetError, UserError):
    """What the user configured or pointed at is wrong (external engines that fail validation or
    are not healthy, a router address that is not an sglang-router, no engines): ``m2po`` ends with
    the message, no traceback."""


def sglang_python() -> str:
    """The interpreter that runs ``sglang.launch_server``: ``$SGLANG_PYTHON`` when set, else this one.

    The image installs SGLang in its own venv (``/opt/sglang``, ``SGLANG_PYTHON=/opt/sglang/bin/python``)
    because it pins another torch than the trainer; ``python -m sglang.launch_server`` with the
    trainer's interpreter would not find SGLang there. Ray actors run the same command on their
    node, so the path must exist on every node (it does in the image)."""
    p = os.environ.get("SGLANG_PYTHON", "")
    if not p:
        return sys.executable
    if not (os.path.isfile(p) and os.access(p, os.X_OK)):
        raise FleetSetupError(f"SGLANG_PYTHON={p} is not an executable file: point it at the python of the venv "
                         "SGLang is installed in (the image: /opt/sglang/bin/python), or unset it to use "
                         f"{sys.executable}")
    return p


@dataclass
class EngineSpec:
    """What a launcher needs to start one engine."""

    index: int
    host: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class EngineHandle(Protocol):
    url: str
    log_path: Optional[Path]

    def alive(self) -> bool: ...
    def stop(self, timeout_s: float = 10.0) -> None: ...


class Launcher(Protocol):
    def launch(self, spec: EngineSpec) -> EngineHandle: ...


@dataclass
class LocalHandle:
    url: str
    log_path: Optional[Path]
    proc: Optional[subprocess.Popen] = None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


class LocalLauncher:
    """Engines as child processes in the environment :func:`engine_env` builds (the trainer's own
    variables left out). Each is in its own session (a Ctrl-C at the terminal reaches the trainer,
    which finishes its step with the engines still up, and stops them itself) and dies
    with this process by any signal, SIGKILL included (:func:`megatron_m2po.utils.lifeline.popen`:
    ``PR_SET_PDEATHSIG``, forked on a thread that lives as long as the process). An SGLang
    server's own subprocesses die with it in turn (SGLang 0.5.23 ``srt/utils/common.py``
    ``kill_itself_when_parent_died``, called by its scheduler and detokenizer)."""

    def launch(self, spec: EngineSpec) -> LocalHandle:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as logf:
            logf.write(f"\n=== launch {' '.join(spec.cmd)}\n".encode())
            logf.flush()
            proc = lifeline.popen(spec.cmd, env=engine_env(spec.env), stdout=logf, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        return LocalHandle(url=spec.url, log_path=spec.log_path, proc=proc)
