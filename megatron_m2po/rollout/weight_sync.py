"""Trainer side of weight sync: push new weights to the rollout engines and tag the version.

Two paths, same call: ``sync.push(weights, version, engine_urls=None) -> SyncStats`` where
``weights`` is an iterator of ``(hf_name, full_tensor)`` (``MegatronActor.iter_hf_weights()``
gathers tensor/pipeline shards and names them as HF does) or an HF checkpoint directory.

- ``DiskWeightSync``: write HF safetensors (+ config/tokenizer files copied from the base model)
  to ``<sync_dir>/v<version>.tmp``, rename to ``v<version>`` (atomic on one filesystem: engines
  never see half a checkpoint), then on every engine: ``/pause_generation`` (in place),
  ``/update_weights_from_disk {model_path, weight_version, flush_cache}``, ``/continue_generation``.
  ``flush_cache`` is true only with ``pause_mode="abort"``: SGLang 0.5.23 fails an update whose
  flush finds requests running or queued, as they are when paused in place or retracted.
- ``DistributedWeightSync``: rank 0 of the trainer and every engine rank join one process
  group (SGLang's ``/init_weights_update_group``: trainer rank 0, engine ``i`` at
  ``rank_offset = 1 + sum(tp of engines before it)``). Per push, tensors are packed into
  buckets of at most ``bucket_mb``; inside one ``/begin_weight_update`` ... ``/end_weight_update``
  session per push (SGLang 0.5.23 refuses distributed updates outside one), for each bucket every
  engine gets
  ``/update_weights_from_distributed {names, dtypes, shapes, load_format="flattened_bucket"}``
  and the trainer broadcasts one uint8 tensor (the tensors' bytes back to back -- SGLang's
  ``FlattenedTensorBucket`` layout) from rank 0. The last bucket carries ``weight_version``.
  NCCL on GPU tensors, gloo on CPU. The group has a timeout, and every HTTP call has one, so a
  dead engine raises ``WeightSyncError`` naming it instead of hanging the trainer; the next
  push rebuilds the group.

``fp8=True`` (``rollout.fp8_weights``) quantises the linears of the decoder blocks to per-tensor
FP8 on the way out (``megatron_m2po/rollout/fp8.py``: ``.weight`` in float8_e4m3fn plus a float32
``.weight_scale``, and ``quantization_config`` in each exported config.json), for engines that
serve FP8.

Only trainer rank 0 calls ``push``; the trainer passes the actor's weights in (this module
knows nothing of the actor) and has the other ranks iterate ``iter_hf_weights()`` alongside it
when that gathers collectively.

:func:`export_fp8_dir` writes an FP8 copy of an HF model directory with the same exporter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from megatron_m2po.parallel.side_group import broadcast, new_side_group
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.fp8 import is_fp8_config, quantize_named, write_fp8_config
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.hf_dir import iter_safetensors
from megatron_m2po.utils.net import free_port

Weights = Union[str, os.PathLike, Iterable[tuple[str, torch.Tensor]]]
_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


class WeightSyncError(RuntimeError):
    """A weight push failed; the message names the engines concerned."""


@dataclass(slots=True)
class SyncStats:
    version: int
    bytes: int
    seconds: float
    n_tensors: int
    engines: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


class _Base:
    def __init__(self, engine_urls: list[str], *, timeout_s: float, pause_mode: Optional[str]) -> None:
        if pause_mode not in (None, "in_place", "retract", "abort"):
            raise ValueError(f"pause_mode={pause_mode!r}: use 'in_place' (default), 'retract', 'abort' or None")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.timeout_s, self.pause_mode = timeout_s, pause_mode
        # HTTP calls run on this loop while the calling thread blocks in a broadcast.
        self._io = BackgroundLoop("weight-sync-http")

    async def _each(self, urls: list[str], fn, what: str) -> list:
        async def one(url):
            async with SGLangClient(url, max_retries=1, control_timeout_s=self.timeout_s) as c:
                return await asyncio.wait_for(fn(c), self.timeout_s)
        res = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
        bad = [f"{u}: {_describe(r)}" for u, r in zip(urls, res) if isinstance(r, BaseException)]
        if bad:
            raise WeightSyncError(f"{what} failed on {len(bad)}/{len(urls)} engine(s):\n  " + "\n  ".join(bad))
        return res

    @property
    def _may_flush(self) -> bool:
        """Whether an update may ask SGLang to flush the cache. 0.5.23 fails the update call
        when the flush finds requests running or queued (weight_updater.py
        ``flush_cache_after_weight_update``): only a pause that aborts empties the engine."""
        return self.pause_mode == "abort"

    def _pause(self, urls: list[str]) -> None:
        if self.pause_mode:
            self._io.run(self._each(urls, lambda c: c.pause_generation(self.pause_mode), "pause_generation"))

    def _continue(self, urls: list[str]) -> None:
        if self.pause_mode:
            self._io.run(self._each(urls, lambda c: c.continue_generation(), "continue_generation"))

    def _continue_quietly(self, urls: list[str]) -> None:
        """Continue every engine that can answer (after a failure some cannot)."""
        try:
            self._continue(urls)
        except WeightSyncError:
            pass

    def close(self) -> None:
        self._io.close(join_timeout_s=5.0)


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "no answer (timed out)"
    return f"{type(e).__name__}: {e}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DiskWeightSync(_Base):
    """HF safetensors through a shared directory, then ``/update_weights_from_disk``.

    ``base_model_dir`` supplies config/tokenizer files copied next to the weights so every
    version directory is a complete HF model (a restarted engine can also launch from it).
    ``keep_last`` version directories are kept; older ones are deleted after a push.
    """

    def __init__(self, engine_urls: list[str], sync_dir: str, *, base_model_dir: Optional[str] = None,
                 timeout_s: float = 300.0, pause_mode: Optional[str] = "in_place", keep_last: int = 2,
                 shard_mb: float = 4096.0, fp8: bool = False) -> None:
        if fp8 and not base_model_dir:
            raise ValueError("DiskWeightSync(fp8=True) needs base_model_dir: the FP8 marker goes into the "
                             "config.json copied from it")
        super().__init__(engine_urls, timeout_s=timeout_s, pause_mode=pause_mode)
        self.fp8 = fp8
        self.sync_dir, self.base_model_dir = Path(sync_dir), base_model_dir
        self.keep_last, self.shard_bytes = max(keep_last, 1), int(shard_mb * 2**20)
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.latest_dir: Optional[str] = None

    def export(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[str, int, int]:
        """Write ``v<version>`` atomically; returns (dir, bytes, n_tensors)."""
        from safetensors.torch import save_file
        final, tmp = self.sync_dir / f"v{version}", self.sync_dir / f"v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = total = n = 0
        skipped: list[str] = []
        if self.fp8:
            weights = quantize_named(weights, skipped=skipped)
        for name, t in weights:
            t = t.detach().to("cpu").contiguous()
            if size and size + _nbytes(t) > self.shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += _nbytes(t)
            total += _nbytes(t)
            n += 1
        if n == 0:
            raise ValueError("DiskWeightSync.export: the weights iterator yielded no tensors")
        index = {}
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
        if self.base_model_dir:
            for f in _COPY:
                src = Path(self.base_model_dir) / f
                if src.exists():
                    shutil.copy2(src, tmp / f)
        if self.fp8:
            write_fp8_config(tmp, skipped)
        with open(tmp / "m2po_version.json", "w") as fh:
            json.dump({"version": int(version)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return str(final), total, n

    def push(self, weights: Weights, version: int, engine_urls: Optional[list[str]] = None) -> SyncStats:
        urls = [u.rstrip("/") for u in (engine_urls or self.engine_urls)]
        t0 = time.perf_counter()
        if isinstance(weights, (str, os.PathLike)):
            path = str(weights)
            nbytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            n = -1
        else:
            path, nbytes, n = self.export(weights, version)
        try:
            self._pause(urls)
            self._io.run(self._each(urls, lambda c: c.update_weights_from_disk(
                path, weight_version=str(version), flush_cache=self._may_flush, timeout_s=self.timeout_s),
                "update_weights_from_disk"))
        finally:
            self._continue_quietly(urls)
        self.latest_dir = path
        self._prune(path)
        return SyncStats(int(version), nbytes, time.perf_counter() - t0, n, len(urls))

    def _prune(self, keep: str) -> None:
        versions = sorted((int(p.name[1:]), p) for p in self.sync_dir.glob("v*")
                          if p.is_dir() and p.name[1:].isdigit())
        for _, p in versions[:-self.keep_last]:
            if str(p) != keep:
                shutil.rmtree(p, ignore_errors=True)


class DistributedWeightSync(_Base):
    """Broadcast from trainer rank 0 to the engines over a dedicated process group.

    ``master_address`` must be reachable from the engines (this host's address on the cluster
    network); ``master_port=0`` picks a free port per group. ``backend``: ``"nccl"`` for GPU
    engines (tensors are moved to ``device``), ``"gloo"`` for CPU workers.
    """

    def __init__(self, engine_urls: list[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 backend: str = "gloo", bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 pause_mode: Optional[str] = "in_place", group_name: str = "m2po_weight_sync",
                 device: Optional[str] = None, fp8: bool = False) -> None:
        super().__init__(engine_urls, timeout_s=timeout_s, pause_mode=pause_mode)
        self.fp8 = fp8
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'nccl' (GPU engines) or 'gloo' (CPU workers)")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be > 0")
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.bucket_bytes = backend, int(bucket_mb * 2**20)
        self.group_name, self._generation = group_name, 0
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self._pg = None
        self._members: tuple[str, ...] = ()

    # ------------------------------------------------------------------ group
    def connect(self, engine_urls: Optional[list[str]] = None) -> None:
        """(Re)build the group with these engines (all of ``engine_urls`` by default)."""
        urls = tuple(u.rstrip("/") for u in (engine_urls or self.engine_urls))
        self.disconnect()
        infos = self._io.run(self._each(list(urls), lambda c: c.get_server_info(), "get_server_info"))
        tps = [int(i.get("tp_size", 1)) * int(i.get("pp_size", 1) or 1) for i in infos]
        world = 1 + sum(tps)
        port = self.master_port or free_port(self.master_address)
        self._generation += 1
        name = f"{self.group_name}_{self._generation}"
        offsets = [1 + sum(tps[:i]) for i in range(len(urls))]
        fut = self._io.submit(self._each_indexed(list(urls), lambda c, i: c.init_weights_update_group(
            self.master_address, port, offsets[i], world, group_name=name, backend=self.backend,
            timeout_s=self.timeout_s), "init_weights_update_group"))
        try:
            self._pg = new_side_group(self.backend, self.master_address, port, rank=0, world_size=world,
                                      group_name=name, timeout_s=self.timeout_s)
        except Exception as e:  # the engines' answers name the culprit better than the store error
            try:
                fut.result(self.timeout_s)
            except WeightSyncError as we:
                raise WeightSyncError(f"joining the weight-sync group failed: {we}") from e
            raise WeightSyncError(f"joining the weight-sync group ({self.master_address}:{port}, "
                                  f"world {world}) failed: {e}") from e
        fut.result(self.timeout_s + 10)
        self._members, self._name = urls, name

    async def _each_indexed(self, urls, fn, what):
        idx = {u: i for i, u in enumerate(urls)}
        return await self._each(urls, lambda c: fn(c, idx[c.base_url]), what)

    def disconnect(self) -> None:
        if self._pg is None:
            return
        name, members, self._pg, self._members = self._name, self._members, None, ()
        try:  # best effort: a dead engine cannot answer
            self._io.run(self._each(list(members), lambda c: c.destroy_weights_update_group(name),
                                    "destroy_weights_update_group"), timeout=self.timeout_s + 10)
        except WeightSyncError:
            pass

    # ------------------------------------------------------------------ push
    def push(self, weights: Weights, version: int, engine_urls: Optional[list[str]] = None) -> SyncStats:
        urls = tuple(u.rstrip("/") for u in (engine_urls or self.engine_urls))
        already_fp8 = False
        if isinstance(weights, (str, os.PathLike)):
            already_fp8 = _is_fp8_dir(str(weights))
            weights = iter_safetensors(str(weights))
        if self.fp8 and not already_fp8:
            weights = quantize_named(weights)
        t0 = time.perf_counter()
        if self._pg is None or self._members != urls:
            self.connect(list(urls))
        nbytes = n = 0
        session = False
        try:
            self._pause(list(urls))  # a failure here (a dead engine) also leaves the group unusable
            # SGLang 0.5.23 refuses /update_weights_from_distributed outside a
            # /begin_weight_update ... /end_weight_update session (weight_updater.py).
            self._io.run(self._each(list(urls), lambda c: c.begin_weight_update(timeout_s=self.timeout_s),
                                    "begin_weight_update"))
            session = True
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            it = iter(weights)
            pending = next(it, None)
            if pending is None:
                raise ValueError("DistributedWeightSync.push: the weights iterator yielded no tensors")
            while pending is not None:
                name, t = pending
                pending = next(it, None)
                t = t.detach()
                if bucket and size + _nbytes(t) > self.bucket_bytes:
                    self._send(bucket, urls, None)
                    bucket, size = [], 0
                bucket.append((name, t))
                size += _nbytes(t)
                nbytes += _nbytes(t)
                n += 1
            self._send(bucket, urls, str(version))
            self._io.run(self._each(list(urls), lambda c: c.end_weight_update(timeout_s=self.timeout_s),
                                    "end_weight_update"))
            session = False
        except BaseException:
            self._pg, self._members = None, ()  # a failed collective leaves the group unusable
            if session:  # close the session on every engine that answers, so the next push can begin
                try:
                    self._io.run(self._each(list(urls), lambda c: c.end_weight_update(timeout_s=self.timeout_s),
                                            "end_weight_update"))
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
            raise
        finally:
            self._continue_quietly(list(urls))
        return SyncStats(int(version), nbytes, time.perf_counter() - t0, n, len(urls))

    def _send(self, bucket: list[tuple[str, torch.Tensor]], urls: tuple[str, ...], version: Optional[str]) -> None:
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).replace("torch.", "") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        fut = self._io.submit(self._each(list(urls), lambda c: c.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self._name, weight_version=version,
            load_format="flattened_bucket", flush_cache=version is not None and self._may_flush,
            timeout_s=self.timeout_s),
            "update_weights_from_distributed"))
        flat = torch.cat([t.to(self.device).contiguous().view(-1).view(torch.uint8) for _, t in bucket])
        try:
            broadcast(self._pg, flat, self.timeout_s).wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            try:
                fut.result(self.timeout_s + 10)
            except (WeightSyncError, concurrent.futures.TimeoutError) as we:
                raise WeightSyncError(f"weight broadcast failed: {we}") from e
            raise WeightSyncError(f"weight broadcast to {list(urls)} failed: {e}") from e
        try:
            fut.result(self.timeout_s + 10)
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(f"engines {list(urls)} did not confirm the weight update within "
                                  f"{self.timeout_s:.0f}s") from None

    def close(self) -> None:
        self.disconnect()
        super().close()


def _is_fp8_dir(path: str) -> bool:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_fp8_config(cfg)


def export_fp8_dir(src_dir: str | Path, dst_dir: str | Path) -> str:
    """Write an FP8 copy of an HF model directory (e.g. the base model FP8 engines start from)."""
    import tempfile

    dst = Path(dst_dir)
    if dst.exists():
        raise ValueError(f"export_fp8_dir: {dst} already exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".fp8-export-", dir=dst.parent)
    sync = DiskWeightSync([], tmp, base_model_dir=str(src_dir), fp8=True)
    try:
        out, _, _ = sync.export(iter_safetensors(str(src_dir)), 0)
        Path(out).rename(dst)
    finally:
        sync.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)
