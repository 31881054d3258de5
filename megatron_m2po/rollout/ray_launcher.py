"""Rollout engines as Ray actors (``rollout.launcher = "ray"``).

    launcher = RayLauncher.from_config(cfg.rollout)     # what EngineFleet picks for launcher=ray
    fleet = EngineFleet(cfg.rollout, model_path, launcher=launcher, refit_fn=...).start()

Each engine is one Ray actor (:class:`EngineProcess`) that starts the engine command of its
:class:`~megatron_m2po.rollout.launcher.EngineSpec` as a child process, reports where it
listens, answers liveness polls and kills the child on ``stop``. The actor asks Ray for the
resources the engine uses: ``num_gpus = rollout.engine_tp`` for SGLang (Ray then sets
``CUDA_VISIBLE_DEVICES`` for the actor and the engine inherits it; the GPU list the local
launcher would use is dropped), ``num_cpus = rollout.ray_cpus_per_engine`` for both kinds.

Cluster. :func:`ensure_ray` joins an existing cluster (``ray.init(address="auto")``) when
``RAY_ADDRESS`` is set, else starts a local one; a driver that already called ``ray.init``
is used as it is. A local cluster started by the trainer gets only the node's GPUs after the
trainer's (``local_gpus``, from ``rollout/placement.py`` ``ray_local_gpus``): Ray counts the GPUs in
``CUDA_VISIBLE_DEVICES`` of the process that starts it and gives each actor entries of that list,
so without it engine actors would land on the GPUs the torchrun ranks use.

Environment. The engine child gets the actor's environment without the trainer's variables
(``launcher.engine_env``: Ray's workers inherit the environment of the process that started the
cluster -- under torchrun, ``TORCHELASTIC_USE_AGENT_STORE`` and the rest), keeping the
``CUDA_VISIBLE_DEVICES`` Ray set for an actor with GPUs.

Addresses. With ``rollout.host`` a loopback address the engine binds it (one-node clusters,
tests). With ``rollout.host = "0.0.0.0"`` the engine binds every interface and is advertised
at its Ray node's IP, so engines can land on any node. The port comes from the fleet; when it
is taken on the actor's node the actor picks a free one. The fleet always uses the URL the
handle reports (a replacement may come up on another node).

Death. :meth:`RayHandle.alive` is the child's ``poll()`` through the actor: an engine that
exited, an actor that was killed (``ray.kill``, OOM) or lost with its node, or an actor that
does not answer within ``poll_timeout_s``, all count as dead, so
``EngineFleet.check_and_restart()`` replaces, refits and re-registers it. The child runs in
its own session and dies with the actor process (:func:`megatron_m2po.utils.lifeline.popen`:
``PR_SET_PDEATHSIG = SIGKILL``) instead of holding its port and GPU as an orphan (SGLang's own
subprocesses do the same toward the server process).

The trainer's death. A local cluster that :func:`ensure_ray` starts is fate-shared with the
process that starts it: Ray 2.x starts its head processes (GCS server, raylet, monitors) with ``PR_SET_PDEATHSIG``
(``ray/_private/services.py`` ``start_ray_process(fate_share=...)``, ``preexec_fn`` calling
``ray/_private/utils.py`` ``set_kill_on_parent_death_linux``; ``node.py`` turns it on where
``detect_fate_sharing_support``), and its workers, the engine actors, exit when their raylet
does. :func:`ensure_ray` starts it on a thread that lives as long as the trainer
(:func:`~megatron_m2po.utils.lifeline.on_lifetime_thread`): the signal follows the thread that
forked. On a cluster the trainer joined (``RAY_ADDRESS``), the engine actors are owned by the
trainer (not detached), and Ray ends an actor whose owner died. Ray's own per-node agents
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, children of the raylet) are slower: they see
the raylet die within ~2 s but exit only after trying, for 60 s, to report it to the GCS, which
died too (Ray 2.60 ``ray/_private/process_watcher.py`` ``report_raylet_error_logs``): a trainer
that starts a local cluster also starts a reaper (``utils/reaper.py``), which SIGKILLs them once the
trainer is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from megatron_m2po.rollout.launcher import EngineSpec, FleetError, engine_env
from megatron_m2po.utils import lifeline
from megatron_m2po.utils.net import free_port

if TYPE_CHECKING:
    from megatron_m2po.rollout.settings import RolloutConfig

log = logging.getLogger("m2po.ray_launcher")

_WILDCARD = ("0.0.0.0", "::", "")


def ensure_ray(address: Optional[str] = None, local_gpus: Optional[list[str]] = None, **init_kwargs: Any) -> None:
    """Connect to Ray once: ``address`` or ``RAY_ADDRESS`` -> that cluster, else a local one.

    ``init_kwargs`` go to ``ray.init`` (e.g. ``num_cpus``, ``object_store_memory`` for a local
    instance). ``local_gpus``: a local instance gets exactly these GPUs (``CUDA_VISIBLE_DEVICES``
    entries; ``[]``: none); None leaves Ray's own detection. No-op when this process is already connected.
    """
    import ray
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or "auto", **init_kwargs)
        return
    init_kwargs.setdefault("include_dashboard", False)
    from megatron_m2po.utils.reaper import start_reaper
    start_reaper()  # Ray's agents outlive their raylet by ~60 s (module docstring)
    # A local cluster's processes die with the thread that starts them (module docstring).
    if local_gpus is None:
        lifeline.on_lifetime_thread(ray.init, **init_kwargs)
        return
    # Ray reads the GPU list from this process's CUDA_VISIBLE_DEVICES when it starts the node, and
    # its raylet (and through it every worker) inherits the variable: actors get entries of it.
    # Set only for the start; this process's CUDA context, if any, was created before.
    init_kwargs.setdefault("num_gpus", len(local_gpus))
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(local_gpus)
    try:
        lifeline.on_lifetime_thread(ray.init, **init_kwargs)
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


def _with_flag(cmd: list[str], flag: str, value: str) -> list[str]:
    cmd = list(cmd)
    if flag in cmd:
        cmd[cmd.index(flag) + 1] = value
    return cmd


class EngineProcess:
    """Body of the Ray actor: one engine child process on the actor's node.

    The child is forked on a thread that lives as long as the actor process
    (:func:`~megatron_m2po.utils.lifeline.popen`), so ``PR_SET_PDEATHSIG`` fires when the actor dies.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str, host: str, port: int,
                 keep_env: tuple[str, ...] = ()) -> None:
        import ray
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        if not _port_free(host, port):
            port = free_port(host)
        self.port = port
        cmd = _with_flag(cmd, "--port", str(port))
        self.url = f"http://{self.node_ip if host in _WILDCARD else host}:{port}"
        self.log_path = Path(log_path)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== launch (ray actor on {self.node_ip}) {' '.join(cmd)}\n".encode())
            logf.flush()
            self.proc = lifeline.popen(cmd, env=engine_env(env, keep=keep_env), stdout=logf,
                                       stderr=subprocess.STDOUT, start_new_session=True)

    def info(self) -> dict:
        return {"url": self.url, "node_ip": self.node_ip, "node_id": self.node_id, "pid": self.proc.pid,
                "actor_pid": os.getpid(), "port": self.port}

    def poll(self) -> Optional[int]:
        """None while the engine runs, else its exit code."""
        return self.proc.poll()

    def stop(self, timeout_s: float = 10.0) -> Optional[int]:
        """SIGTERM the engine's session, SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        return self.proc.poll()

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the engine log (the log lives on the actor's node)."""
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@dataclass
class RayHandle:
    """``EngineHandle`` of an engine inside a Ray actor."""

    url: str
    log_path: Optional[Path]
    actor: Any
    node_ip: str
    pid: int
    poll_timeout_s: float = 10.0

    def alive(self) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        try:
            return ray.get(self.actor.poll.remote(), timeout=self.poll_timeout_s) is None
        except (RayError, GetTimeoutError) as e:  # killed, node lost, or not answering
            log.warning("engine actor at %s is gone: %s", self.url, type(e).__name__)
            return False

    def tail(self, n: int = 30) -> str:
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        try:
            return ray.get(self.actor.tail.remote(n), timeout=self.poll_timeout_s)
        except (RayError, GetTimeoutError) as e:
            return f"(engine actor unreachable: {type(e).__name__})"

    def stop(self, timeout_s: float = 10.0) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        try:
            ray.get(self.actor.stop.remote(timeout_s), timeout=2 * timeout_s + 5)
        except (RayError, GetTimeoutError):
            pass  # already dead; the kill below frees its resources either way
        try:
            ray.kill(self.actor, no_restart=True)
        except (RayError, ValueError):
            pass


class RayLauncher:
    """``Launcher`` that places each engine as a Ray actor with resource requests.

    Args:
        num_cpus: CPUs reserved per engine actor.
        num_gpus: GPUs per engine actor (SGLang: its tensor-parallel size; 0 for CPU workers).
        resources: extra custom Ray resources per actor (e.g. ``{"rollout_node": 1}``).
        address: Ray cluster address (default: ``RAY_ADDRESS`` if set, else a local instance).
        place_timeout_s: how long an actor may wait for resources before ``launch`` fails.
        poll_timeout_s: an actor that does not answer a liveness poll within this counts as dead.
        init_kwargs: extra ``ray.init`` arguments when this launcher connects.
        local_gpus: the GPUs (``CUDA_VISIBLE_DEVICES`` entries) of a local cluster this launcher
            starts (:func:`ensure_ray`); None: Ray's own detection.
    """

    def __init__(self, *, num_cpus: float = 1.0, num_gpus: float = 0.0, resources: Optional[dict] = None,
                 address: Optional[str] = None, place_timeout_s: float = 600.0, poll_timeout_s: float = 10.0,
                 init_kwargs: Optional[dict] = None, local_gpus: Optional[list[str]] = None) -> None:
        if num_cpus < 0 or num_gpus < 0:
            raise ValueError(f"RayLauncher: num_cpus={num_cpus}, num_gpus={num_gpus} must be >= 0")
        self.num_cpus, self.num_gpus = float(num_cpus), float(num_gpus)
        self.resources = dict(resources or {})
        self.address, self.init_kwargs = address, dict(init_kwargs or {})
        self.local_gpus = None if local_gpus is None else list(local_gpus)
        self.place_timeout_s, self.poll_timeout_s = place_timeout_s, poll_timeout_s
        self._remote = None

    @classmethod
    def from_config(cls, cfg: "RolloutConfig", **kw: Any) -> "RayLauncher":
        gpus = float(cfg.engine_tp) if cfg.engine == "sglang" else 0.0
        return cls(num_cpus=cfg.ray_cpus_per_engine, num_gpus=gpus, **kw)

    def _actor_class(self):
        if self._remote is None:
            import ray
            ensure_ray(self.address, self.local_gpus, **self.init_kwargs)
            # max_restarts=0: the fleet, not Ray, decides about restarts (it must refit first).
            self._remote = ray.remote(max_restarts=0)(EngineProcess)
        return self._remote

    def launch(self, spec: EngineSpec) -> RayHandle:
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        cls = self._actor_class()
        env = dict(spec.env)
        if self.num_gpus:
            env.pop("CUDA_VISIBLE_DEVICES", None)  # Ray assigns the actor's GPUs
        actor = cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                            name=None).remote(spec.cmd, env, str(spec.log_path), spec.host, spec.port,
                                              ("CUDA_VISIBLE_DEVICES",) if self.num_gpus else ())
        try:
            info = ray.get(actor.info.remote(), timeout=self.place_timeout_s)
        except GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise FleetError(
                f"engine {spec.index}: no Ray node could host it within {self.place_timeout_s:.0f}s (it asks for "
                f"num_cpus={self.num_cpus}, num_gpus={self.num_gpus}, resources={self.resources}; the cluster has "
                f"{ray.available_resources()} free of {ray.cluster_resources()}). Add nodes, lower "
                "rollout.ray_cpus_per_engine / rollout.engine_tp, or reduce rollout.num_engines") from None
        except RayError as e:
            ray.kill(actor, no_restart=True)
            raise FleetError(f"engine {spec.index}: its Ray actor failed to start: {e}") from None
        log.info("engine %d: Ray actor on node %s (pid %d) at %s", spec.index, info["node_ip"], info["pid"], info["url"])
        return RayHandle(url=info["url"], log_path=spec.log_path, actor=actor, node_ip=info["node_ip"],
                         pid=info["pid"], poll_timeout_s=self.poll_timeout_s)
