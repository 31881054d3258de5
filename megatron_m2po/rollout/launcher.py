"""How engines are started: the launcher protocol, the local (subprocess) launcher, fleet errors.

``EngineFleet`` (:mod:`.engines`) builds an :class:`EngineSpec` per engine and hands it to a
:class:`Launcher`; :class:`LocalLauncher` starts it as a child process, and
:class:`~megatron_m2po.rollout.ray_launcher.RayLauncher` as a Ray actor. Both raise
:class:`FleetError` when an engine cannot be started.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

__all__ = ["FleetError", "EngineSpec", "EngineHandle", "Launcher", "LocalHandle", "LocalLauncher", "child_setup",
           "sglang_python"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_setup() -> None:
    """In an engine (or router) child before exec: its own session, so ``stop`` kills its whole
    tree, and ``PR_SET_PDEATHSIG = SIGKILL``, so it dies with the process that started it --
    a trainer killed with SIGKILL leaves no engine or router behind. The signal fires when the
    *thread* that forked the child exits: start children from long-lived threads only."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: stop() still kills the session
        pass


class FleetError(RuntimeError):
    """An engine or the router could not be started, reached or validated."""


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
        raise FleetError(f"SGLANG_PYTHON={p} is not an executable file: point it at the python of the venv "
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
    """Engines as child processes in their own session that die with this process (``child_setup``)."""

    def launch(self, spec: EngineSpec) -> LocalHandle:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as logf:
            logf.write(f"\n=== launch {' '.join(spec.cmd)}\n".encode())
            logf.flush()
            proc = subprocess.Popen(spec.cmd, env={**os.environ, **spec.env}, stdout=logf,
                                    stderr=subprocess.STDOUT, preexec_fn=child_setup)
        return LocalHandle(url=spec.url, log_path=spec.log_path, proc=proc)
