"""LoRA adapter pushes: a new peft adapter per weight version, loaded next to the engines' base.

With ``model.lora.rank > 0`` and ``model.lora.push=adapter`` the engines keep the base model they
started from and serve each request under the adapter its ``lora_path`` names (SGLang 0.5.23,
``--enable-lora``; the CPU worker follows it, standins/cpu_worker_lora.py). A push of version
``v`` (rank 0, :class:`AdapterPush`):

1. writes the adapters (``weights/lora_export.py`` ``peft_adapter_tensors``: every rank takes part)
   as a peft directory ``<sync_dir>/lora/v<v>`` (atomic rename: an engine never reads half of one);
2. ``/load_lora_adapter {lora_name: "m2po_v<v>", lora_path}`` on every engine, then
   ``/update_weight_version`` so each engine reports the version it now serves;
3. makes ``m2po_v<v>`` the adapter of every new request (:meth:`AdapterPush.current`, which the
   generation client reads per request: rollout/client.py ``adapter``), and unloads the names
   older than the last :attr:`keep` in the background.

No pause, no cache flush, no drain is needed for exactness: loading an adapter does not touch the
base weights, a request keeps the adapter it started with to its end (SGLang fixes ``lora_id``
per request), and SGLang's radix cache is keyed by adapter. The client tags every token of a
request with the version of the adapter it named, which is exact even for requests in flight
across a push; an ``/unload_lora_adapter`` answers only after the requests that use the name have
finished (0.5.23 ``lora_drainer``), so it never cuts one short.

Version 0 is the base model itself (B = 0 at peft's initialisation): no adapter, no ``lora_path``.
A relaunched engine is refit by loading the current version's directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.weights.transport import SyncStats

log = logging.getLogger(__name__)

__all__ = ["ADAPTER_PREFIX", "adapter_name", "adapter_version", "lora_push_mode", "engine_args", "AdapterPush", "write_adapter_dir"]

ADAPTER_PREFIX = "m2po_v"


def adapter_name(version: int) -> str:
    """The engines' name of the adapter of weight version ``version``."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def adapter_version(name: Optional[str]) -> Optional[int]:
    """The weight version an adapter name stands for (None for another name)."""
    if not name or not name.startswith(ADAPTER_PREFIX) or not name[len(ADAPTER_PREFIX):].isdigit():
        return None
    return int(name[len(ADAPTER_PREFIX):])


def lora_push_mode(cfg: Any) -> Optional[str]:
    """How a LoRA run's weights reach the engines: None without LoRA, else ``model.lora.push`` as
    ``Config.validate`` resolved it (``adapter`` or ``merged``; config.py ``_check_lora_push``)."""
    lora = cfg.model.lora
    if lora.rank <= 0:
        return None
    if lora.push not in ("adapter", "merged"):
        raise ValueError(f"model.lora.push={lora.push!r} is not resolved: validate the config (Config.validate)")
    return lora.push


def engine_args(rank: int, targets: list[str], keep: int = 2) -> list[str]:
    """The SGLang 0.5.23 server flags an engine needs to serve the pushed adapters: LoRA on, the
    rank and target modules (without initial ``--lora-paths`` 0.5.23 requires both:
    ``lora_manager.py``), ``keep`` adapters in one batch (requests in flight across a push run under
    the previous one) and twice that loaded (unloads answer only when their requests ended;
    ``arg_groups/lora_hook.py`` allows at most double ``--max-loras-per-batch``)."""
    return ["--enable-lora", "--max-lora-rank", str(int(rank)), "--lora-target-modules", *targets,
            "--max-loras-per-batch", str(int(keep)), "--max-loaded-loras", str(2 * int(keep))]


def write_adapter_dir(tensors: list[tuple[str, torch.Tensor]], config: dict, out: Path) -> int:
    """``adapter_model.safetensors`` + ``adapter_config.json`` into ``out`` through a temporary
    directory renamed into place; returns the bytes of the tensors."""
    from safetensors.torch import save_file

    from megatron_m2po.weights.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return sum(t.numel() * t.element_size() for _, t in tensors)


class AdapterPush:
    """Rank 0's adapter pushes to the engines (module docstring).

    ``sync_dir``: where ``lora/v<version>`` directories go (engines must read it: a shared
    filesystem for engines on other nodes); ``config``: the peft ``adapter_config.json``
    (``lora_export.peft_config``); ``client_for(url)``: an :class:`~megatron_m2po.rollout.client.SGLangClient`
    of one engine; ``bg``: rank 0's :class:`~megatron_m2po.utils.background_loop.BackgroundLoop`
    (loads run to their end on it; unloads are left running there, as each answers only when its
    requests ended); ``keep``: versions kept loaded on every engine (the newest and the one before,
    which requests in flight across a push may use); directories older than every loaded version
    are deleted.
    """

    can_refit_alone = True

    def __init__(self, sync_dir: str | Path, config: dict, *, client_for, bg, timeout_s: float = 300.0,
                 keep: int = 2, in_memory: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the current adapter stays loaded")
        # model.lora.adapter_transport=memory: /load_lora_adapter_from_tensors with shared-memory
        # handles instead of a directory; the current version's tensors stay here for a refit.
        self.in_memory = bool(in_memory)
        self._tensors: dict[int, list] = {}
        self.dir = Path(sync_dir) / "lora"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config, self.client_for, self.bg = dict(config), client_for, bg
        self.timeout_s, self.keep = float(timeout_s), int(keep)
        self.version = 0
        self.loaded: dict[str, list[int]] = {}  # url -> versions loaded there, oldest first

    @property
    def current(self) -> Optional[tuple[str, int]]:
        """``(adapter name, version)`` every new request uses; None at version 0 (the base)."""
        return (adapter_name(self.version), self.version) if self.version > 0 else None

    def path_of(self, version: int) -> Path:
        return self.dir / f"v{int(version)}"

    def push(self, tensors: list[tuple[str, torch.Tensor]], version: int, urls: list[str]) -> SyncStats:
        """Write version ``version``'s adapter and load it on every engine of ``urls``; then it is
        :attr:`current`. Raises :class:`WeightSyncError` naming the engines that did not load it."""
        t0 = time.perf_counter()
        if not tensors:
            raise WeightSyncError("the actor has no LoRA adapters to push: model.lora.rank is 0 on the trainer")
        if self.in_memory:
            self._tensors = {int(version): [(n, t.detach().cpu().contiguous()) for n, t in tensors]}
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        else:
            nbytes = write_adapter_dir(tensors, self.config, self.path_of(version))
        self._load(version, list(urls))
        self.version = int(version)
        self._unload_old(list(urls))
        self._prune()
        return SyncStats(version=int(version), bytes=nbytes, seconds=time.perf_counter() - t0, n_tensors=len(tensors),
                         engines=len(urls))

    def refit(self, url: str, version: int) -> None:
        """A relaunched engine loads the current adapter (nothing at version 0)."""
        self.loaded.pop(url, None)
        if version > 0:
            self._load(version, [url])

    def on_engines_restarted(self, urls: list[str]) -> None:
        for url in urls:
            self.loaded.pop(url, None)  # a new process holds no adapter

    def _load(self, version: int, urls: list[str]) -> None:
        name = adapter_name(version)
        path = "<shared memory>" if self.in_memory else str(self.path_of(version))
        todo = [u for u in urls if version not in self.loaded.get(u, [])]

        async def one(url: str):
            c = self.client_for(url)
            try:
                if self.in_memory:
                    await self._load_tensors(c, name, version)
                else:
                    await c.load_lora_adapter(name, path, timeout_s=self.timeout_s)
                await c.update_weight_version(str(version))
            finally:
                await c.close()

        errors = []
        for url in todo:  # engines load one after another: each reads the same small directory
            try:
                self.bg.run(one(url), timeout=self.timeout_s + 30)
                self.loaded.setdefault(url, []).append(int(version))
            except Exception as e:  # noqa: BLE001 -- named in the error below
                errors.append(f"{url}: {e}")
        if errors:
            raise WeightSyncError(f"loading LoRA adapter {name} ({path}) failed on {len(errors)} engine(s):\n  "
                                  + "\n  ".join(errors))

    async def _load_tensors(self, c, name: str, version: int) -> None:
        """One serialization of the adapter per engine TP rank (0.5.23 ``LoadLoRAAdapterFromTensorsReqInput``);
        the tensors stay referenced here until the engine answered (and for a refit)."""
        from megatron_m2po.weights.colocated_bucket import serialize_named_tensors

        tensors = self._tensors.get(int(version))
        if tensors is None:
            raise WeightSyncError(f"no tensors of LoRA version {version} in memory to load (a refit after a restart "
                                  "of the trainer): the next push loads the current one")
        tp = int((await c.get_server_info()).get("tp_size") or 1)
        # One pickling per rank, as SGLang's engine.py _serialize_tensors_per_rank: each rank's
        # unpickling releases the shared-memory reference one pickling took (torch reductions.py), so
        # a payload repeated for every rank released the segment while later loads still needed it.
        payloads = [serialize_named_tensors(tensors) for _ in range(tp)]
        await c.load_lora_adapter_from_tensors(name, self.config, payloads, timeout_s=self.timeout_s)

    def _unload_old(self, urls: list[str]) -> None:
        """Unload the versions older than the last ``keep``, without waiting: each answers once the
        requests that use it ended (new requests stop finding the name at once)."""
        for url in urls:
            versions = self.loaded.get(url, [])
            old, self.loaded[url] = versions[:-self.keep], versions[-self.keep:]
            for v in old:
                self.bg.submit(self._unload(url, adapter_name(v))).add_done_callback(self._unloaded)

    @staticmethod
    def _unloaded(fut) -> None:
        if fut.exception() is not None:  # a left-over adapter costs memory, not correctness
            log.warning("unloading a LoRA adapter failed: %s", fut.exception())

    async def _unload(self, url: str, name: str) -> Any:
        c = self.client_for(url)
        try:
            return await c.unload_lora_adapter(name, timeout_s=None)
        except Exception as e:
            raise WeightSyncError(f"{url}: /unload_lora_adapter {name}: {e}") from None
        finally:
            await c.close()

    def _prune(self) -> None:
        """Delete adapter directories older than every loaded version (a refit needs the current one)."""
        floor = min([min(v) for v in self.loaded.values() if v] + [self.version])
        for p in self.dir.glob("v*"):
            suffix = p.name[1:]
            if suffix.isdigit() and int(suffix) < floor:
                shutil.rmtree(p, ignore_errors=True)
