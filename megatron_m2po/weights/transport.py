"""Trainer side of weight sync: push new weights to the rollout engines and tag the version.

Two controllers with the same interface, run on trainer rank 0:

- ``begin(version, n_stages) -> PushPlan`` and ``finish(plan, stage_results) -> SyncStats``: a push
  from every pipeline stage in parallel (:func:`~megatron_m2po.rollout.weight_stage.push_from_stages`,
  called by every trainer rank; each stage's sender sends or writes its own layers, see
  :mod:`megatron_m2po.rollout.weight_stage`);
- ``push(weights, version, engine_urls=None) -> SyncStats``: the same push from this one process
  (one stage), where ``weights`` is an iterator of ``(hf_name, full_tensor)`` or an HF checkpoint
  directory (a refit, a benchmark, the tests);
- ``can_refit_alone`` / ``refit(url, version)`` / ``on_engines_restarted(urls)``: what a relaunched
  engine needs. The disk sync refits one engine alone from the latest version directory; the
  distributed one cannot (the engine waits for the next push from every stage) and rebuilds its
  groups at that push, since a relaunched engine has lost them.

Pause and cache flush (docs/sglang.md, "Weight updates and the prefix cache"). SGLang keeps prompt KV
in its radix cache across requests until the cache is flushed; an update that does not flush leaves
the KV the old weights computed in use, and tokens tagged with the new version are then partly
computed by older weights. So every push flushes: the engines pause with ``retract`` (the default
``pause_mode``), which moves running requests back to the waiting queue and frees their KV
(``scheduler.py`` ``pause_generation``), so the flush that the update asks for is legal
(``flush_cache`` is refused only while requests run, or wait on an unpaused scheduler); on
``/continue_generation`` the retracted requests are prefilled again, output included, by the new
weights. In sync and stale_k mode the engines are idle at a push (the driver waits for the
generation first) and nothing is retracted; in async mode the in-flight requests pay one prefill
each. ``pause_mode="in_place"`` keeps running requests and their KV, so 0.5.23 refuses the flush
while any runs: it sends ``flush_cache=false`` unless ``flush_cache=True`` is given (the caller
knows the engines are idle), and then the tokens after the push are conditioned on older KV.

``DiskWeightSync``: stages write HF safetensors shards into ``<sync_dir>/v<version>.tmp``; the
controller names them ``model-0000k-of-0000n.safetensors``, writes ``model.safetensors.index.json``
and the config/tokenizer files copied from the base model, renames the directory to ``v<version>``
(atomic on one filesystem: engines never see half a checkpoint), then on every engine:
``/pause_generation``, ``/update_weights_from_disk {model_path, weight_version, flush_cache}``,
``/continue_generation``. A retried push of a version whose directory is complete reuses it. The
engines' load gets a timeout that follows the pushed bytes (:mod:`~megatron_m2po.rollout.push_timeout`:
at least ``timeout_s``, longer for a model that a slow disk needs minutes to read).

``DistributedWeightSync``: each stage's sender and every engine rank form one weight-update group
per stage (SGLang's ``/init_weights_update_group``, group ``<group_name>_<id>_<generation>_s<stage>``,
the sender at rank 0, engine ``i`` at ``rank_offset = 1 + sum(tp of engines before it)``). Per push,
inside one ``/begin_weight_update`` ... ``/end_weight_update`` session (SGLang 0.5.23 refuses
distributed updates outside one), each stage sends buckets of at most ``bucket_mb``: every engine
gets ``/update_weights_from_distributed {names, dtypes, shapes, load_format="flattened_bucket"}``
and the sender broadcasts one uint8 tensor (SGLang's ``FlattenedTensorBucket`` layout). Only the
last bucket of the last stage carries ``weight_version`` and ``flush_cache``. NCCL on GPU tensors, gloo on CPU. The
groups have a timeout and every HTTP call has one, so a dead engine raises ``WeightSyncError``
naming it instead of hanging the trainer. The groups are rebuilt for the next push after a failure,
when the engines change, or when :meth:`DistributedWeightSync.on_engines_restarted` says an engine was
restarted (a restarted engine has lost its groups).

``fp8=True`` (``rollout.fp8_weights``) quantises the linears of the decoder blocks to block FP8 on
the way out (``megatron_m2po/rollout/fp8.py``: ``.weight`` in float8_e4m3fn plus a float32
``.weight_scale_inv`` per ``fp8_block`` block, and ``quantization_config`` with
``weight_block_size`` in each exported config.json), for engines that serve FP8: SGLang 0.5.23
reloads block-FP8 parameters in place, while per-tensor FP8 replaces them after the first load and
fails every later update.

:func:`export_fp8_dir` writes an FP8 copy of an HF model directory with the same exporter.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from megatron_m2po.rollout.fp8 import DEFAULT_BLOCK, check_block, is_fp8_config, write_fp8_config
from megatron_m2po.rollout.nccl_handshake import MISMATCH
from megatron_m2po.rollout.push_timeout import disk_push_timeout_s
from megatron_m2po.rollout.weight_stage import (PushPlan, StageResult, WeightSyncError, each_engine,
                                                forget_groups, run_stage, weight_sync_error)
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.hf_dir import assemble_shards, iter_safetensors

__all__ = ["DiskWeightSync", "DistributedWeightSync", "SyncStats", "WeightSyncError", "export_fp8_dir"]

Weights = Union[str, os.PathLike, Iterable[tuple[str, torch.Tensor]]]
_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass(slots=True)
class SyncStats:
    """One push: ``bytes`` of weights to ``engines`` in ``seconds`` (from :meth:`begin` to the engines
    holding them). A disk push also says how long the stages took to write (``write_s``), the engines
    to load (``load_s``), and the load's timeout (``timeout_s``, :mod:`.push_timeout`)."""

    version: int
    bytes: int
    seconds: float
    n_tensors: int
    engines: int
    stages: int = 1
    write_s: Optional[float] = None
    load_s: Optional[float] = None
    timeout_s: Optional[float] = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


class _Base:
    def __init__(self, engine_urls: list[str], *, timeout_s: float, pause_mode: Optional[str],
                 flush_cache: Optional[bool] = None, fp8: bool = False,
                 fp8_block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        if pause_mode not in (None, "in_place", "retract", "abort"):
            raise ValueError(f"pause_mode={pause_mode!r}: use 'retract' (default), 'in_place', 'abort' or None")
        if flush_cache not in (None, True, False):
            raise ValueError(f"flush_cache={flush_cache!r}: use None (flush unless pausing in place), True or False")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.timeout_s, self.pause_mode, self.flush_cache = timeout_s, pause_mode, flush_cache
        self.fp8, self.fp8_block = fp8, check_block(fp8_block)
        # HTTP calls run on this loop while the calling thread blocks in a broadcast.
        self._io = BackgroundLoop("weight-sync-http")
        self._t0 = 0.0

    def _urls(self, engine_urls: Optional[list[str]]) -> tuple[str, ...]:
        return tuple(u.rstrip("/") for u in (engine_urls or self.engine_urls))

    def _each(self, urls, fn, what: str, timeout_s: Optional[float] = None) -> list:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return self._io.run(each_engine(urls, fn, what, timeout_s), timeout=timeout_s + 30)

    @property
    def _may_flush(self) -> bool:
        """Whether the update asks SGLang to flush its prefix cache (module docstring). 0.5.23
        fails the update when the flush finds requests running, or waiting on an unpaused
        scheduler (scheduler_components/weight_updater.py ``flush_cache_after_weight_update``,
        scheduler.py ``flush_cache``): after a retract or abort pause none run; paused in place
        they may, so only an explicit ``flush_cache=True`` flushes then; with no pause SGLang's
        model-update lock waits for the running requests."""
        if self.flush_cache is not None:
            return self.flush_cache
        return self.pause_mode != "in_place"

    def _pause(self, urls) -> None:
        if self.pause_mode:
            self._each(urls, lambda c: c.pause_generation(self.pause_mode), "pause_generation")

    def _continue_quietly(self, urls) -> None:
        """Continue every engine that can answer (after a failure some cannot)."""
        if self.pause_mode:
            try:
                self._each(urls, lambda c: c.continue_generation(), "continue_generation")
            except WeightSyncError:
                pass

    def _dead(self, urls) -> list[str]:
        """The engines that do not answer ``/health`` now (named in a failed push's error)."""
        async def probe(c):
            if not await c.health(min(self.timeout_s, 5.0)):
                raise WeightSyncError("unhealthy")
        try:
            self._each(urls, probe, "health")
            return []
        except WeightSyncError as e:
            return [u for u in urls if f"{u}:" in str(e)]

    def _failed(self, plan: PushPlan, errors: list[str]) -> WeightSyncError:
        dead = self._dead(plan.urls)
        fatal = [e for e in errors if MISMATCH in e]
        if fatal:  # one line, and not worth a relaunch: the relaunched engine runs the same build
            return weight_sync_error(fatal[0])
        msg = f"weight push of version {plan.version} failed:\n  " + "\n  ".join(errors)
        if dead:
            msg += "\nengines not answering /health: " + ", ".join(dead)
        return WeightSyncError(msg)

    def push(self, weights: Weights, version: int, engine_urls: Optional[list[str]] = None) -> SyncStats:
        """The whole push from this process (one stage)."""
        plan = self.begin(version, 1, engine_urls)
        if isinstance(weights, (str, os.PathLike)):
            weights = self._from_dir(str(weights), plan)
        return self.finish(plan, [run_stage(plan, 0, weights)])

    def _from_dir(self, path: str, plan: PushPlan):
        return iter_safetensors(path)

    #: Whether :meth:`refit` loads the current weights into one relaunched engine from this process
    #: alone. When not, a relaunched engine waits (unregistered) for the next push from every stage.
    can_refit_alone = False

    def refit(self, url: str, version: int) -> None:
        """Load the weights of ``version`` (the last pushed) into the relaunched engine ``url``."""
        raise WeightSyncError(f"{type(self).__name__} cannot refit engine {url} alone: it gets version {version} "
                              "with the next push from every stage")

    def on_engines_restarted(self, urls: list[str]) -> None:
        """Engines ``urls`` were relaunched: what this controller set up with them is gone."""

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None) -> PushPlan:
        raise NotImplementedError

    def finish(self, plan: PushPlan, results: list[StageResult]) -> SyncStats:
        raise NotImplementedError

    def close(self) -> None:
        self._io.close(join_timeout_s=5.0)


def _stats(plan: PushPlan, results: list[StageResult], seconds: float) -> SyncStats:
    return SyncStats(int(plan.version), sum(r.bytes for r in results), seconds,
                     sum(r.n_tensors for r in results), len(plan.urls), plan.n_stages)


class DiskWeightSync(_Base):
    """HF safetensors shards through a shared directory, then ``/update_weights_from_disk``.

    ``base_model_dir`` supplies config/tokenizer files copied next to the weights so every
    version directory is a complete HF model (a restarted engine can also launch from it).
    ``keep_last`` version directories are kept; older ones are deleted after a push. A stage holds
    at most ``shard_mb`` of host memory at a time. The engines' load times out after
    :func:`~.push_timeout.disk_push_timeout_s` of the pushed bytes at ``min_gbps`` (at least
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

    def _complete(self, version: int) -> Optional[str]:
        final = self.sync_dir / f"v{version}"
        try:
            if json.loads((final / "m2po_version.json").read_text())["version"] == int(version):
                return str(final)
        except (OSError, ValueError, KeyError):
            pass
        return None

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None, *,
              reuse: bool = True) -> PushPlan:
        self._t0 = time.perf_counter()
        reuse = (self._complete(version) if reuse else None) or ""
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
        stats = _stats(plan, results, time.perf_counter() - self._t0)
        stats.bytes = nbytes
        stats.write_s, stats.load_s, stats.timeout_s = written - self._t0, loaded - written, load_timeout
        if plan.reuse_dir:
            stats.n_tensors = -1
        return stats

    def _assemble(self, plan: PushPlan, results: list[StageResult]) -> str:
        """Name the stages' files in stage order, write the index and the HF files, publish."""
        tmp, final = Path(plan.tmp_dir), self.sync_dir / f"v{plan.version}"
        try:
            assemble_shards(tmp, [f for r in results for f in r.files])
        except ValueError as e:
            raise WeightSyncError(f"version {plan.version}: {e}") from None
        if self.base_model_dir:
            for f in _COPY:
                src = Path(self.base_model_dir) / f
                if src.exists():
                    shutil.copy2(src, tmp / f)
        if plan.fp8:
            write_fp8_config(tmp, plan.fp8_block, [s for r in results for s in r.skipped])
        with open(tmp / "m2po_version.json", "w") as fh:
            json.dump({"version": int(plan.version)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return str(final)

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


class DistributedWeightSync(_Base):
    """Broadcast from each pipeline stage's sender to the engines over one group per stage.

    ``master_address``: the senders' address as the engines reach it; ``""`` lets each sender use
    its own (``M2PO_WEIGHT_SYNC_ADDR`` on its node, else the address of its route to the engines).
    ``backend``: ``"nccl"`` for GPU engines (tensors are moved to ``device``), ``"gloo"`` for CPU
    workers. While an earlier stage sends, a stage prepares up to ``prefetch_mb`` (default: one
    bucket) of gathered, converted tensors.
    """

    def __init__(self, engine_urls: list[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 backend: str = "gloo", bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 pause_mode: Optional[str] = "retract", group_name: str = "m2po_weight_sync",
                 device: Optional[str] = None, fp8: bool = False, fp8_block: tuple[int, int] = DEFAULT_BLOCK,
                 prefetch_mb: Optional[float] = None, flush_cache: Optional[bool] = None) -> None:
        super().__init__(engine_urls, timeout_s=timeout_s, pause_mode=pause_mode, flush_cache=flush_cache,
                         fp8=fp8, fp8_block=fp8_block)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'nccl' (GPU engines) or 'gloo' (CPU workers)")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be > 0")
        if master_port:
            raise ValueError(f"master_port={master_port}: every stage's sender picks a free port of its own; "
                             "leave master_port=0")
        self.master_address = master_address
        self.backend, self.bucket_bytes = backend, int(bucket_mb * 2**20)
        self.prefetch_bytes = int((bucket_mb if prefetch_mb is None else prefetch_mb) * 2**20)
        self.group_name, self._generation = group_name, 0
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self._prefix = f"{group_name}_{uuid.uuid4().hex[:8]}_"  # this controller's groups
        self._groups: tuple[str, ...] = ()       # the engines hold these groups
        self._members: tuple[str, ...] = ()
        self._stale = False

    def invalidate(self, url: Optional[str] = None) -> None:
        """An engine (``url``, or any) lost its groups (restarted): the next push rebuilds them."""
        self._stale = True

    def on_engines_restarted(self, urls: list[str]) -> None:
        self.invalidate()  # a relaunched engine has lost its weight-update groups

    def connect(self, engine_urls: Optional[list[str]] = None) -> None:
        """Check the engines answer (their tensor-parallel sizes); groups are built by the next push."""
        self._layout(self._urls(engine_urls))

    def _layout(self, urls) -> tuple[int, tuple[int, ...]]:
        infos = self._each(urls, lambda c: c.get_server_info(), "get_server_info")
        tps = [int(i.get("tp_size", 1)) * int(i.get("pp_size", 1) or 1) for i in infos]
        return 1 + sum(tps), tuple(1 + sum(tps[:i]) for i in range(len(urls)))

    def _drop_groups(self) -> None:
        """Forget the current groups on the engines that answer (best effort) and here."""
        names, members = self._groups, self._members
        self._groups, self._members = (), ()
        forget_groups(self._prefix)
        for name in names:
            try:
                self._each(members, lambda c, n=name: c.destroy_weights_update_group(n),
                           "destroy_weights_update_group")
            except WeightSyncError:
                pass

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None) -> PushPlan:
        self._t0 = time.perf_counter()
        urls = self._urls(engine_urls)
        if self._stale or self._members != urls or len(self._groups) != n_stages:
            self._drop_groups()
            self._stale = False
            self._generation += 1
            self._groups = tuple(f"{self._prefix}{self._generation}_s{p}" for p in range(n_stages))
            self._members = urls
            self._world, self._offsets = self._layout(urls)
        plan = PushPlan("distributed", int(version), urls, n_stages, self.timeout_s, fp8=self.fp8,
                        fp8_block=self.fp8_block, groups=self._groups, world=self._world, offsets=self._offsets, backend=self.backend,
                        device=self.device, bucket_bytes=self.bucket_bytes, prefetch_bytes=self.prefetch_bytes,
                        flush_last=self._may_flush, master_address=self.master_address)
        try:
            self._pause(urls)
            # SGLang 0.5.23 refuses /update_weights_from_distributed outside a
            # /begin_weight_update ... /end_weight_update session (weight_updater.py).
            self._each(urls, lambda c: c.begin_weight_update(timeout_s=self.timeout_s), "begin_weight_update")
        except WeightSyncError as e:
            self._stale = True
            self._end_quietly(urls)
            self._continue_quietly(urls)
            raise self._failed(plan, [str(e)]) from None
        return plan

    def _end_quietly(self, urls) -> None:
        try:
            self._each(urls, lambda c: c.end_weight_update(timeout_s=self.timeout_s), "end_weight_update")
        except WeightSyncError:
            pass

    def finish(self, plan: PushPlan, results: list[StageResult]) -> SyncStats:
        urls = plan.urls
        try:
            errors = [r.error for r in results if r.error]
            if len(results) != plan.n_stages:
                errors.append(f"{len(results)} of {plan.n_stages} stages reported")
            if not errors and sum(r.n_tensors for r in results) == 0:
                errors.append("the stages sent no tensors")
            if not errors:
                try:
                    self._each(urls, lambda c: c.end_weight_update(timeout_s=self.timeout_s), "end_weight_update")
                except WeightSyncError as e:
                    errors.append(str(e))
            if errors:
                self._stale = True  # a failed collective leaves the groups unusable
                self._end_quietly(urls)  # close the session where it is open, so the next push can begin
                raise self._failed(plan, errors)
        finally:
            self._continue_quietly(urls)
        return _stats(plan, results, time.perf_counter() - self._t0)

    def _from_dir(self, path: str, plan: PushPlan):
        if _is_fp8_dir(path):
            plan.fp8 = False  # already quantised
        return iter_safetensors(path)

    def close(self) -> None:
        try:
            self._drop_groups()
        finally:
            super().close()


def _is_fp8_dir(path: str) -> bool:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_fp8_config(cfg)


def export_fp8_dir(src_dir: str | Path, dst_dir: str | Path, block: tuple[int, int] = DEFAULT_BLOCK) -> str:
    """Write a block-FP8 copy of an HF model directory (the base model FP8 engines start from)."""
    import tempfile

    dst = Path(dst_dir)
    if dst.exists():
        raise ValueError(f"export_fp8_dir: {dst} already exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".fp8-export-", dir=dst.parent)
    sync = DiskWeightSync([], tmp, base_model_dir=str(src_dir), fp8=True, fp8_block=block)
    try:
        out, _, _ = sync.export(iter_safetensors(str(src_dir)), 0)
        Path(out).rename(dst)
    finally:
        sync.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)
