"""The disk transport: stages write safetensors shards into a shared directory, engines load it.

``DiskWeightSync``: stages write HF safetensors shards into ``<sync_dir>/v<version>.tmp``; the
controller names them ``model-0000k-of-0000n.safetensors``, writes ``model.safetensors.index.json``
and the config/tokenizer files copied from the base model, renames the directory to ``v<version>``
(atomic on one filesystem: engines never see half a checkpoint), then on every engine:
``/pause_generation``, ``/update_weights_from_disk {model_path, weight_version, flush_cache}``,
``/continue_generation``. A retried push of a version whose directory is complete reuses it. The
engines' load gets a timeout that follows the pushed bytes (:mod:`megatron_m2po.rollout.push_timeout`:
at least ``timeout_s``, longer for a model that a slow disk needs minutes to read).

The directory is the layout of :mod:`.version_dir`. The interface, the pause and the cache flush
every push asks for are the shared part's (:mod:`.transport`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from megatron_m2po.rollout.push_timeout import disk_push_timeout_s
from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.weights.fp8 import DEFAULT_BLOCK, write_fp8_config
from megatron_m2po.weights.stage import PushPlan, StageResult, run_stage
from megatron_m2po.weights.transport import SyncStats, WeightSync, push_stats
from megatron_m2po.weights.version_dir import complete_version_dir, fill_version_dir, seal_version_dir

__all__ = ["DiskWeightSync"]


class DiskWeightSync(WeightSync):
    """HF safetensors shards through a shared directory, then ``/update_weights_from_disk``.

    ``base_model_dir`` supplies config/tokenizer files copied next to the weights so every
    version directory is a complete HF model (a restarted engine can also launch from it).
    ``keep_last`` version directories are kept; older ones are deleted after a push. A stage holds
    at most ``shard_mb`` of host memory at a time. The engines' load times out after
    :func:`~megatron_m2po.rollout.push_timeout.disk_push_timeout_s` of the pushed bytes at ``min_gbps`` (at least
    ``timeout_s``).
    """

    def __init__(self, engine_urls: list[str], sync_dir: str, *, base_model_dir: Optional[str] = None,
                 timeout_s: float = 300.0, pause_mode: Optional[str] = "retract", keep_last: int = 2,
                 shard_mb: float = 4096.0, fp8: bool = False, fp8_block: tuple[int, int] = DEFAULT_BLOCK,
                 flush_cache: Optional[bool] = None, min_gbps: float = 0.2) -> None:
        if fp8 and not base_model_dir:
            raise ValueError("DiskWeightSync(fp8=True) needs base_model_dir: the FP8 marker goes into the "
                             "config.json copied from it")
        if shard_mb <= 0:
            raise ValueError(f"shard_mb={shard_mb}: must be > 0")
        super().__init__(engine_urls, timeout_s=timeout_s, pause_mode=pause_mode, flush_cache=flush_cache,
                         fp8=fp8, fp8_block=fp8_block)
        self.sync_dir, self.base_model_dir = Path(sync_dir), base_model_dir
        self.keep_last, self.shard_bytes = max(keep_last, 1), int(shard_mb * 2**20)
        disk_push_timeout_s(0, timeout_s, min_gbps)  # refuses a floor <= 0 now, not at the first push
        self.min_gbps = min_gbps
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.latest_dir: Optional[str] = None
        self._skip_update = False

    can_refit_alone = True  # from the latest complete version directory

    def refit(self, url: str, version: int) -> None:
        if self.latest_dir is None:
            raise RuntimeError(f"engine {url} was restarted at weight version {version}, but there is no on-disk "
                               "copy of that version to refit it from")
        self.push(self.latest_dir, version, engine_urls=[url])

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None, *,
              reuse: bool = True) -> PushPlan:
        self._t0 = time.perf_counter()
        reuse = (complete_version_dir(self.sync_dir, version) if reuse else None) or ""
        tmp = self.sync_dir / f"v{version}.tmp"
        if not reuse:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        return PushPlan("disk", int(version), self._urls(engine_urls), n_stages, self.timeout_s, fp8=self.fp8,
                        fp8_block=self.fp8_block, tmp_dir=str(tmp), shard_bytes=self.shard_bytes, reuse_dir=reuse)

    def _from_dir(self, path: str, plan: PushPlan):
        if not plan.reuse_dir:
            shutil.rmtree(plan.tmp_dir, ignore_errors=True)
        plan.reuse_dir = path  # an HF directory is pushed as it is
        return iter(())

    def finish(self, plan: PushPlan, results: list[StageResult]) -> SyncStats:
        errors = [r.error for r in results if r.error]
        if errors:
            shutil.rmtree(plan.tmp_dir, ignore_errors=True)
            raise WeightSyncError(f"writing version {plan.version} failed:\n  " + "\n  ".join(errors))
        path = plan.reuse_dir or self._assemble(plan, results)
        nbytes = (sum(r.bytes for r in results) if not plan.reuse_dir
                  else sum(f.stat().st_size for f in Path(path).glob("*.safetensors")))
        self.latest_dir = path  # complete: a restarted engine can be refit from it
        written = time.perf_counter()
        load_timeout = disk_push_timeout_s(nbytes, self.timeout_s, self.min_gbps)
        if not self._skip_update:
            urls = plan.urls
            try:
                self._pause(urls)
                self._each(urls, lambda c: c.update_weights_from_disk(
                    path, weight_version=str(plan.version), flush_cache=self._may_flush, timeout_s=load_timeout),
                    "update_weights_from_disk", timeout_s=load_timeout)
            except WeightSyncError as e:
                raise self._failed(plan, [f"{e} (the load's timeout: {load_timeout:.0f} s for {nbytes / 1e9:.2f} GB at "
                                          f"rollout.weight_sync_min_gbps={self.min_gbps:g})"]) from None
            finally:
                self._continue_quietly(urls)
        loaded = time.perf_counter()
        self._prune(path)
        stats = push_stats(plan, results, time.perf_counter() - self._t0)
        stats.bytes = nbytes
        stats.write_s, stats.load_s, stats.timeout_s = written - self._t0, loaded - written, load_timeout
        if plan.reuse_dir:
            stats.n_tensors = -1
        return stats

    def _assemble(self, plan: PushPlan, results: list[StageResult]) -> str:
        """Name the stages' files in stage order, write the index and the HF files, publish."""
        tmp, final = Path(plan.tmp_dir), self.sync_dir / f"v{plan.version}"
        try:
            fill_version_dir(tmp, [f for r in results for f in r.files], self.base_model_dir)
        except ValueError as e:
            raise WeightSyncError(f"version {plan.version}: {e}") from None
        if plan.fp8:
            write_fp8_config(tmp, plan.fp8_block, [s for r in results for s in r.skipped])
        return seal_version_dir(tmp, final, plan.version)

    def export(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[str, int, int]:
        """Write ``v<version>`` atomically without telling any engine; returns (dir, bytes, n_tensors)."""
        self._skip_update = True
        try:
            plan = self.begin(version, 1, [], reuse=False)
            stats = self.finish(plan, [run_stage(plan, 0, weights)])
        finally:
            self._skip_update = False
        return self.latest_dir, stats.bytes, stats.n_tensors

    def _prune(self, keep: str) -> None:
        versions = sorted((int(p.name[1:]), p) for p in self.sync_dir.glob("v*")
                          if p.is_dir() and p.name[1:].isdigit())
        for _, p in versions[:-self.keep_last]:
            if str(p) != keep:
                shutil.rmtree(p, ignore_errors=True)
