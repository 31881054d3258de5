"""The rank-0 rollout driver: engines, router, store, prompts, rewards, weight pushes.

Only global rank 0 builds a :class:`RolloutDriver`; every rank runs the actor. The driver never
takes part in a collective: it returns data (groups, evaluation results) and the trainer loop
shares it and runs the actor on every rank. It generates in a background event loop so
rollouts overlap training whenever the schedule allows (stale_k with k >= 1, async), and it
never changes the engines' weights while a generation that must be tagged with the old version
is in flight.

Determinism and resume. Prompts are drawn in the main thread, in schedule order, and every
group gets a deterministic id (``s<step>-g<position>``); a resumed run re-draws the same
prompts for the same steps, skips the groups the store already holds (generated before the
crash), and generates only the missing ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_m2po.config import Config
from megatron_m2po.data.dataset import build_eval_sets, build_prompt_dataset
from megatron_m2po.rewards import get_reward_fn
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.placement import cuda_count, node_gpus, placement
from megatron_m2po.rollout.producer import ProducerContext, load_producer
from megatron_m2po.rollout.weight_stage import PushPlan, run_stage
from megatron_m2po.rollout.weight_sync import DiskWeightSync, DistributedWeightSync, export_fp8_dir
from megatron_m2po.store.store import NotReadyError, RolloutStore, bounded
from megatron_m2po.store.types import Group
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.faults import fault_point
from megatron_m2po.utils.timing import TIMER

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a wait looks at the stop request and its deadline
_FIRST_NOTE_S, _NOTE_EVERY_S = 5.0, 60.0  # a wait says what it waits for after 5 s, then every minute


class _WaitNotes:
    """The log lines of one wait: what it waits for, how long so far, what to do."""

    def __init__(self, what: str, hint: str, timeout_s: float):
        self.what, self.hint, self.timeout_s = what, hint, timeout_s
        self.t0 = time.monotonic()
        self.next = self.t0 + _FIRST_NOTE_S

    def tick(self, detail: str = "") -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + _NOTE_EVERY_S
            log.warning("waiting for %s%s (%.0fs of trainer.wait_timeout_s=%.0f): %s; SIGINT / SIGTERM stops the run "
                        "(checkpointing the finished steps)", self.what, f" ({detail})" if detail else "",
                        now - self.t0, self.timeout_s, self.hint)


class StopRequested(Exception):
    """A wait for data ended because the trainer was asked to stop (SIGINT / SIGTERM)."""


class RolloutDriver:
    """Rank-0 coordination of rollout generation and the rollout store."""

    def __init__(self, cfg: Config, model_path: str, tokenizer: Any):
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer = tokenizer
        run_dir = Path(cfg.trainer.run_dir)
        self.store = RolloutStore.from_config(cfg.store, run_dir=str(run_dir))
        self.dataset = build_prompt_dataset(cfg.data, tokenizer, cfg.trainer.seed)
        self.eval_sets = build_eval_sets(cfg.data, tokenizer, cfg.trainer.seed) if cfg.trainer.eval_every_steps else {}
        self.reward = get_reward_fn(cfg.reward)
        self.producer = load_producer(cfg.rollout.producer)
        self.engine_version = 0
        self.sync_dir = cfg.resolved_path(cfg.rollout.weight_sync_dir, "weights")
        self._inflight: list[concurrent.futures.Future] = []
        self._gen_lock: Optional[asyncio.Lock] = None  # steps are generated one after another
        self._async_stop = threading.Event()
        self._async_future: Optional[concurrent.futures.Future] = None
        # Set by the trainer's signal handler: waits for data return at once (StopRequested).
        self.stop_event = threading.Event()
        self.gen_seconds = 0.0
        self.external = cfg.rollout.source == "external"
        self.fleet: Optional[EngineFleet] = None
        self._bg = BackgroundLoop("m2po-rollout")  # the producer runs here
        self.client: Optional[SGLangClient] = None
        self._ingest_runner = None
        self.weight_sync = None
        try:
            if not self.external or cfg.rollout.external_addrs:
                # FP8 engines start from a block-FP8 export of the base model: SGLang 0.5.23 reloads
                # only block-FP8 parameters (rollout/fp8.py); `--quantization fp8` on the float
                # model would quantise per channel, and the first weight push would fail.
                engine_model = self._fp8_base(run_dir) if cfg.rollout.fp8_weights else model_path
                # Engines on this node go after the trainer's GPUs; impossible layouts fail here, before
                # anything starts (rollout/placement.py).
                node = node_gpus(count=cuda_count(), trainer_on_gpu=cuda_count() is not None)
                if cfg.rollout.launcher == "local":
                    placement(cfg, node)
                self.fleet = EngineFleet(cfg.rollout, engine_model, run_dir=str(run_dir), refit_fn=self._refit,
                                         node=node, on_concurrency=self._resize_client)
                self.fleet.start()
            self.weight_sync = self._make_weight_sync()
            if self.fleet is not None:
                self._bg.submit(self._open_client()).result()
            if self.external:
                self._bg.submit(self._serve_ingestion()).result()
                if self.store.current_version is None:
                    self.store.set_version(0)
        except BaseException:
            self.close()  # no engine processes left behind
            raise

    # ------------------------------------------------------------------ setup / teardown
    async def _open_client(self) -> None:
        r = self.cfg.rollout
        self.client = SGLangClient(self.fleet.url, concurrency=self.fleet.concurrency, timeout_s=r.request_timeout_s,
                                   max_retries=r.max_retries)

    def _resize_client(self, concurrency: int) -> None:
        """The fleet's derived concurrency changed (engines joined or left): the client follows."""
        if self.client is not None:
            self._bg.submit(self.client.set_concurrency(concurrency)).result(timeout=30)

    async def _serve_ingestion(self) -> None:
        """External producers push to ``http://store.serve_host:serve_port/v1/groups``."""
        from aiohttp import web

        from megatron_m2po.store.server import build_app, load_token
        s = self.cfg.store
        token = load_token(s.token_env, s.token_file)
        if token is None:
            raise ValueError(f"rollout.source=external: set the ingestion token in ${s.token_env} (or "
                             "store.token_file); producers send it as 'Authorization: Bearer <token>'")
        # Producers get the ingestion token; the trainer writes its version straight into the store,
        # so the HTTP trainer role gets a random token nobody holds: no producer can set the version.
        import secrets
        app = build_app(self.store, token=token, max_request_bytes=int(s.max_request_mb * 2**20),
                        trainer_token=secrets.token_hex(32))
        self._ingest_runner = web.AppRunner(app)
        await self._ingest_runner.setup()
        site = web.TCPSite(self._ingest_runner, s.serve_host, s.serve_port)
        await site.start()
        port = self._ingest_runner.addresses[0][1]
        self.ingest_url = f"http://{s.serve_host}:{port}"
        log.info("external rollout: ingestion at %s/v1/groups, current version at %s/v1/version, weights in %s",
                 self.ingest_url, self.ingest_url, self.sync_dir)

    def _fp8_base(self, run_dir: Path) -> str:
        """``<run_dir>/engine_base_fp8``: the base model in block FP8 (kept for a resume)."""
        import json
        import shutil

        out = run_dir / "engine_base_fp8"
        block = list(self.cfg.rollout.fp8_block_size)
        try:
            have = json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"]
        except (OSError, ValueError, KeyError, TypeError):
            have = None
        if have != block:
            shutil.rmtree(out, ignore_errors=True)
            export_fp8_dir(self.model_path, out, block=tuple(block))
        return str(out)

    @property
    def engine_urls(self) -> list[str]:
        return self.fleet.engine_urls if self.fleet is not None else []

    def _make_weight_sync(self):
        r = self.cfg.rollout
        if r.weight_sync == "disk" or self.external:
            # External harnesses load the published v<version> directories themselves.
            return DiskWeightSync(self.engine_urls, str(self.sync_dir), base_model_dir=self.model_path,
                                     timeout_s=r.weight_sync_timeout_s, fp8=r.fp8_weights,
                                     fp8_block=tuple(r.fp8_block_size))
        import torch

        # Engines must reach every stage's sender: each sender uses M2PO_WEIGHT_SYNC_ADDR of its own
        # node, else the address of its route to the engines (master_address="").
        sync = DistributedWeightSync(self.engine_urls, master_address="", timeout_s=r.weight_sync_timeout_s,
                                     backend="nccl" if torch.cuda.is_available() else "gloo",
                                     bucket_mb=r.weight_sync_bucket_mb, fp8=r.fp8_weights,
                                     fp8_block=tuple(r.fp8_block_size))
        sync.connect()
        return sync

    def _refit(self, url: str) -> None:
        """A restarted engine gets the current weights before it serves again (disk weight sync;
        distributed engines are refit by the next push from every stage, see :meth:`check_engines`)."""
        if self.engine_version == 0:
            return  # it launched from the base model, which is version 0
        latest = getattr(self.weight_sync, "latest_dir", None)
        if latest is None:
            raise RuntimeError(f"engine {url} was restarted at weight version {self.engine_version}, but "
                               "there is no on-disk copy of that version to refit it from")
        self.weight_sync.push(latest, self.engine_version, engine_urls=[url])

    def close(self) -> None:
        self.stop_async()
        for f in self._inflight:
            f.cancel()
        if self.client is not None:
            try:
                self._bg.submit(self.client.close()).result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self._ingest_runner is not None:
            try:
                self._bg.submit(self._ingest_runner.cleanup()).result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._bg.close()
        closers = (getattr(self.weight_sync, "close", None), self.fleet.stop if self.fleet else None,
                   self.reward.close, self.store.close)
        for closer in closers:
            if closer is None:
                continue
            try:
                closer()
            except Exception as e:  # noqa: BLE001
                log.warning("shutdown: %s failed: %s", getattr(closer, "__qualname__", closer), e)

    # ------------------------------------------------------------------ restarts
    def rewind(self, cursor: Optional[dict], version: int) -> dict[str, int]:
        """The store side of the restart rule (docs/design.md §5b); call once at start.

        ``cursor`` is the resume checkpoint's store cursor, or None when the run starts from the
        base model (no checkpoint): then every lease ever recorded lies after the resume point.
        Consumption recorded after the resume point is rewound and replayed identically to the
        re-run's requests (a run without a checkpoint may ask differently: an unmatched recorded
        lease is then released instead of raising). In async mode (engines or external producers)
        unconsumed groups with tokens newer than ``version`` were made by weights that no longer
        exist and are retired (counted in the store's metrics); sync / stale_k groups are kept:
        their ids and versions are the schedule's, which the re-run reaches again by the same
        updates on the same data, and they are reused with their true versions.
        """
        fresh = cursor is None
        if fresh:
            cursor = {"store_id": self.store.store_id, "acked_through": 0, "unacked": [], "version": 0}
        replays = self.store.restore_cursor(cursor, strict=not fresh)
        # Published weights of lost versions: a push of that version must write the re-run's
        # weights, not reuse these (DiskWeightSync reuses a complete v<N>); producers must not load them.
        import shutil
        for d in self.sync_dir.glob("v*"):
            n = d.name[1:].removesuffix(".tmp")
            if n.isdigit() and int(n) > version:
                shutil.rmtree(d, ignore_errors=True)
        retired = self.store.retire_ahead(version) if self.cfg.trainer.mode == "async" else []
        if replays or retired:
            log.info("restart from %s (version %d): %d recorded lease(s) will be replayed; %d unconsumed group(s) "
                     "made by weights newer than version %d retired", "the base model" if fresh else "a checkpoint",
                     version, replays, len(retired), version)
        return {"replays": replays, "retired": len(retired)}

    # ------------------------------------------------------------------ weights
    def push_weights(self, weights: Iterable, version: int) -> float:
        """Push ``weights`` ((hf_name, tensor) iterator of the whole model) from this process to every
        engine; returns seconds. The trainer pushes from every pipeline stage instead
        (:meth:`begin` / :meth:`finish` through ``weight_stage.push_from_stages``)."""
        t0 = time.perf_counter()
        plan = self.begin(version, 1)
        self.finish(plan, [run_stage(plan, 0, weights)])
        return time.perf_counter() - t0

    def begin(self, version: int, n_stages: int) -> PushPlan:
        """Rank 0's start of a weight push from ``n_stages`` pipeline stages (the push controller)."""
        self.wait_generation()
        # The trainer is at ``version`` already: record it first, so tokens an engine samples
        # with the new weights while the push is still returning validate against it.
        self.store.set_version(version)
        # The fleet's current URLs: a replaced engine (e.g. a new Ray actor) may have moved, and a
        # router-discovered fleet is re-read from the router (engines that joined get this push).
        if self.fleet is not None:
            self.fleet.refresh()
            self.fleet.hold(self.engine_urls)  # paused by the push: the router's health view is not the truth
        try:
            return self.weight_sync.begin(version, n_stages, self.engine_urls)
        except BaseException:
            if self.fleet is not None:
                self.fleet.release()
            raise

    def finish(self, plan: PushPlan, results: list):
        """Rank 0's end of a push: engines at the new version; relaunched engines rejoin the router."""
        fault_point("weight_push")  # the store records plan.version; the engines do not hold it yet
        try:
            stats = self.weight_sync.finish(plan, results)
        finally:
            if self.fleet is not None:
                self.fleet.release()
        self.engine_version = plan.version
        if self.fleet is not None:
            self.fleet.admit()
        return stats

    def restart_dead_engines(self) -> list[str]:
        """Relaunch dead engines without weights or router registration (after a failed push the
        push is repeated for every engine, which refits them and rebuilds their groups); returns
        their URLs."""
        if self.fleet is None:
            return []
        restarted = self.fleet.check_and_restart(refit=False)
        if restarted:
            log.warning("restarted %d engine(s): %s; they get the weights with the next push",
                        len(restarted), ", ".join(restarted))
            if isinstance(self.weight_sync, DistributedWeightSync):
                self.weight_sync.invalidate()  # a relaunched engine has lost its weight-update groups
        return restarted

    def check_engines(self) -> list[str]:
        """Restart dead engines; returns the URLs of those still waiting for weights.

        Disk weight sync refits a relaunched engine from the latest version directory and
        re-registers it here. Distributed weight sync cannot refit one engine from rank 0 alone:
        the engine waits (unregistered) and the trainer pushes the current weights from every
        stage, which rebuilds the groups for it and admits it.
        """
        if self.fleet is None:
            return []
        if isinstance(self.weight_sync, DistributedWeightSync) and self.engine_version > 0:
            self.restart_dead_engines()
            pending = self.fleet.pending_urls
        else:
            pending = []
            restarted = self.fleet.check_and_restart()
            if restarted:
                log.warning("restarted %d engine(s): %s", len(restarted), ", ".join(restarted))
                if isinstance(self.weight_sync, DistributedWeightSync):
                    self.weight_sync.invalidate()  # version 0: launched from the base model, groups lost
        return pending + self._engines_off_version(set(pending))

    def _engines_off_version(self, skip: set[str]) -> list[str]:
        """Engines whose served weight version is not the one pushed last: restarted by someone
        else (an external or router-discovered engine comes back with the base model), or kept
        from a run that died (they hold weights the re-run does not have). Their tokens would be
        tagged with versions the schedule does not expect; the trainer pushes to every engine."""
        async def versions() -> list[str]:
            out = []
            for url in self.engine_urls:
                if url in skip:
                    out.append(str(self.engine_version))
                    continue
                async with SGLangClient(url, timeout_s=30.0, max_retries=2) as c:
                    out.append(await c.weight_version())
            return out
        urls = self.engine_urls
        got = self._bg.submit(versions()).result(timeout=120)
        off = [(u, v) for u, v in zip(urls, got) if v != str(self.engine_version)]
        if off:
            log.warning("engine(s) %s serve weight version(s) %s, not version %d pushed last (restarted outside the "
                        "trainer, or kept from a run that died): pushing the current weights to every engine",
                        ", ".join(u for u, _ in off), ", ".join(v for _, v in off), self.engine_version)
        return [u for u, _ in off]

    def engine_loads(self) -> dict[str, float]:
        """Metrics of the engines' load now (``/v1/loads``, SGLang 0.5.23 ``entrypoints/v1_loads.py``),
        summed over engines: ``engine/{running,queued}_reqs``, ``engine/used_tokens``; not under
        ``rollout/``, whose metrics describe the rollouts (a re-run reproduces them exactly).
        A snapshot, not an average; {} when there are no engines or one does not answer (a metric
        must not end a run)."""
        async def loads() -> list[dict]:
            out = []
            for url in self.engine_urls:
                async with SGLangClient(url, timeout_s=10.0, max_retries=0) as c:
                    out.append(await c.loads())
            return out
        if not self.engine_urls:
            return {}
        try:
            got = self._bg.submit(loads()).result(timeout=30)
        except Exception as e:  # noqa: BLE001
            log.debug("engine loads: %s", e)
            return {}
        return {f"engine/{name}": float(sum(int(g.get(key, 0)) for g in got))
                for name, key in (("running_reqs", "num_running_reqs"), ("queued_reqs", "num_waiting_reqs"),
                                  ("used_tokens", "num_used_tokens"))}

    # ------------------------------------------------------------------ generation
    def _context(self, prefix: str, n_samples: Optional[int] = None, **meta) -> ProducerContext:
        r = self.cfg.rollout
        params = {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens}
        if self.tokenizer.eos_token_id is not None:
            params["stop_token_ids"] = [int(self.tokenizer.eos_token_id)]
        return ProducerContext(client=self.client, tokenizer=self.tokenizer, reward=self.reward,
                               sampling_params=params, n_samples=n_samples or r.n_samples_per_prompt,
                               version=self.engine_version, group_prefix=prefix, metadata=meta,
                               max_attempts=r.max_retries + 1, seed=self.cfg.trainer.seed)

    def _plan_step(self, step: int) -> Optional[tuple[ProducerContext, list, list[int]]]:
        """Draw this step's prompts now (deterministic order); the groups still to generate, or None."""
        prompts = self.dataset.next_prompts(self.cfg.trainer.prompts_per_step)
        prefix = f"s{step:06d}"
        gids = [f"{prefix}-g{i:05d}" for i in range(len(prompts))]
        have = self.store.existing_group_ids(gids)
        todo = [p for p, g in zip(prompts, gids) if g not in have]
        if have:
            log.info("step %d: %d/%d groups already in the store (generated before a restart)", step, len(have),
                     len(gids))
        if not todo:
            return None
        ctx = self._context(prefix, step=step, generated_at=self.engine_version)
        positions = [gids.index(g) for g in gids if g not in have]
        ctx.positions = positions
        return ctx, todo, positions

    def missing_steps(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` whose groups the store does not hold completely (never generated)."""
        n = self.cfg.trainer.prompts_per_step
        out = []
        for step in steps:
            gids = [f"s{step:06d}-g{i:05d}" for i in range(n)]
            if len(self.store.existing_group_ids(gids)) < n:
                out.append(step)
        return out

    def generate_for_step(self, step: int, *, background: bool = True) -> concurrent.futures.Future:
        """Generate and store the step's missing groups (in the background unless ``background=False``)."""
        plan = self._plan_step(step)
        if plan is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(0)
            return done
        fut = self._bg.submit(self._generate_and_store(*plan))
        self._inflight.append(fut)
        if not background:
            self._wait(fut, f"the on-policy rollouts of step {step}", interruptible=True)
        return fut

    def generate_step_groups(self, step: int) -> list[Group]:
        """Generate the step's missing groups now and return them *unstored*.

        For trainer-side behaviour log-probs: the trainer fills them in on every rank, then
        stores the groups with :meth:`put_groups`.
        """
        plan = self._plan_step(step)
        if plan is None:
            return []
        return self._wait(self._bg.submit(self._generate(*plan)), f"the rollouts of step {step}", interruptible=True)

    def put_groups(self, groups: list[Group]) -> None:
        if groups:
            self.store.put_groups(groups)

    async def _generate_and_store(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> int:
        # One step at a time: a step's groups are committed in one transaction, so the store's
        # arrival order keeps steps that share a generation version (base-model steps) apart.
        if self._gen_lock is None:
            self._gen_lock = asyncio.Lock()
        async with self._gen_lock:
            return await self._generate_and_store_locked(ctx, prompts, positions)

    async def _generate_and_store_locked(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> int:
        t0 = time.perf_counter()
        with TIMER.phase("generation"):  # the driver's thread: overlaps the trainer in stale_k / async
            fixed = await self._generate(ctx, prompts, positions)
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.store.put_groups(fixed))
        self.gen_seconds += time.perf_counter() - t0
        return len(fixed)

    async def _generate(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        groups = await self.producer(ctx, prompts)
        if len(groups) != len(prompts):
            raise RuntimeError(f"producer returned {len(groups)} groups for {len(prompts)} prompts")
        # Rename to the step's deterministic ids (a custom producer may not know them).
        fixed = []
        for g, pos in zip(groups, positions):
            gid = f"{ctx.group_prefix}-g{pos:05d}"
            for j, t in enumerate(g.trajectories):
                t.group_id, t.uid = gid, f"{gid}-{j}"
            fixed.append(Group(gid, g.trajectories))
        return fixed

    def wait_generation(self, *, interruptible: bool = False) -> None:
        """Block until every submitted generation is stored; re-raises its error. Bounded by
        ``trainer.wait_timeout_s``; ``interruptible``: a stop request ends it (StopRequested)."""
        while self._inflight:
            self._wait(self._inflight[0], "the generation of scheduled rollouts", interruptible=interruptible)
            self._inflight.pop(0)

    def generation_idle(self) -> bool:
        """No scheduled generation is in flight (every one submitted is stored or failed)."""
        return all(f.done() for f in self._inflight)

    def _wait(self, fut: concurrent.futures.Future, what: str, *, interruptible: bool):
        """``fut.result()`` within ``trainer.wait_timeout_s``, the stop request looked at every
        ``_POLL_S`` when ``interruptible``."""
        timeout_s = self.cfg.trainer.wait_timeout_s
        deadline = time.monotonic() + timeout_s
        notes = _WaitNotes(what, f"the engines generate it (logs in {self.cfg.trainer.run_dir}/engines)", timeout_s)
        while True:
            try:
                return fut.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                notes.tick()
            if interruptible and self.stop_event.is_set():
                raise StopRequested(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"waited {timeout_s:.0f}s (trainer.wait_timeout_s) for {what}, which did not finish: check the "
                    f"engine logs in {self.cfg.trainer.run_dir}/engines and their load; raise trainer.wait_timeout_s "
                    "if generation is just slow. Run the same command again to resume")

    def take_step(self, step: int, version: int, generated_at: int, *,
                  timeout_s: Optional[float] = None) -> tuple[list[Group], Any]:
        """Lease the groups of ``step`` (generated at ``generated_at``); returns (groups, lease).

        Waits at most ``timeout_s`` (default ``trainer.wait_timeout_s``); a stop request ends the
        wait (StopRequested). It fails at once when the groups can never come: a quarantined
        group of the step, or no generation in flight and the step's groups not all stored."""
        n = self.cfg.trainer.prompts_per_step
        timeout_s = self.cfg.trainer.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        notes = _WaitNotes(f"the {n} groups of step {step} generated at version {generated_at}",
                           f"they are generated in the background (engine logs in {self.cfg.trainer.run_dir}/engines)",
                           timeout_s)
        while True:
            self._raise_failed()
            try:
                lease = self.store.lease_exact(generated_at=generated_at, n_groups=n, current_version=version,
                                               step=step, timeout_s=1.0)
                break
            except NotReadyError:
                if self.stop_event.is_set():
                    raise StopRequested(f"stopped while waiting for the rollouts of step {step}") from None
                # A group of this step that failed the store's integrity check can never be
                # served, and regenerating it now would sample at another version than the
                # exact stale-k schedule says: stop at once instead of waiting for the timeout.
                lost = self.store.quarantined_ids(f"s{step:06d}-")
                if lost:
                    raise RuntimeError(
                        f"step {step}: group(s) {lost[:5]} of this step failed the rollout store's integrity check "
                        f"and are quarantined (`m2po store stats {self.store.path}` shows why); exact stale-k "
                        "cannot serve the step without them. Restore the store from a backup (`m2po store backup` "
                        "makes one while the run is live) and run the same command again to resume, or resume "
                        "with a new trainer.run_dir") from None
                notes.tick(f"{self.store.count_available(generated_at=generated_at)} available")
                if self.generation_idle() and self._async_future is None:
                    self._raise_failed()
                    if self.generation_idle() and not self._can_serve(step, generated_at):
                        raise RuntimeError(self._never_message(step, generated_at)) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step}: rollouts generated at version {generated_at} did not arrive "
                                       f"within {timeout_s:.0f}s (trainer.wait_timeout_s); check the engine logs in "
                                       f"{self.cfg.trainer.run_dir}/engines; run the same command again to resume"
                                       ) from None
        self._check_step_groups(lease.groups, step)
        return lease.groups, lease

    def _can_serve(self, step: int, generated_at: int) -> bool:
        """Whether the store can still serve ``step`` without more generation."""
        n = self.cfg.trainer.prompts_per_step
        if self.store.has_replay():
            return True  # a recorded lease is served first; the request is compared with it there
        return self.store.count_available(generated_at=generated_at) >= n

    def _never_message(self, step: int, generated_at: int) -> str:
        n = self.cfg.trainer.prompts_per_step
        gids = [f"s{step:06d}-g{i:05d}" for i in range(n)]
        have = len(self.store.existing_group_ids(gids))
        return (f"step {step}: waiting for {n} groups generated at version {generated_at}, but no generation is in "
                f"flight and the store holds {self.store.count_available(generated_at=generated_at)} available "
                f"(of this step's groups {have}/{n} are stored, counts {self.store.counts()}): they can never come. "
                f"The store in {self.store.path} holds consumption this run did not record (a run_dir reused by "
                "another run, or a store restored from elsewhere?): use a new trainer.run_dir, or restore the store "
                "from the backup that matches the checkpoint")

    def _check_step_groups(self, groups: list[Group], step: int) -> None:
        bad = [g.group_id for g in groups if not g.group_id.startswith(f"s{step:06d}-")]
        if bad:
            raise RuntimeError(f"step {step} was served groups of another step: {bad[:3]}; the store holds "
                               "data this schedule did not produce (reusing a run_dir of a different run?)")

    def _raise_failed(self) -> None:
        for f in list(self._inflight):
            if f.done():
                self._inflight.remove(f)
                f.result()  # raises the producer's error
        if self._async_future is not None and self._async_future.done():
            self._async_future.result()

    def ack(self, lease: Any) -> None:
        self.store.ack(lease)

    # ------------------------------------------------------------------ async mode
    def start_async(self) -> None:
        """Generate continuously (bounded by ``store capacity``) until :meth:`stop_async`."""
        if self.external:
            return  # external producers push on their own
        self._async_stop.clear()
        self._async_future = self._bg.submit(self._async_loop())

    async def _async_loop(self) -> None:
        t = self.cfg.trainer
        chunk = t.prompts_per_update
        # Admission control: never hold more unconsumed data than the trainer can use within
        # max_staleness updates (nor more than two steps' worth), so nothing is generated only
        # to be refused as too old.
        horizon_updates = max(1, min(self.cfg.store.max_staleness, 2 * t.num_updates_per_step))
        cap = horizon_updates * t.prompts_per_update
        seq = 0
        while not self._async_stop.is_set():
            counts = self.store.counts()
            if counts["available"] + counts["pending"] >= cap:
                await asyncio.sleep(0.05)
                continue
            prompts = self.dataset.next_prompts(chunk)
            ctx = self._context(f"a{int(time.time() * 1e3):013d}-{seq:06d}", generated_at=self.engine_version)
            seq += 1
            await self._generate_and_store(ctx, prompts, list(range(len(prompts))))

    def stop_async(self) -> None:
        self._async_stop.set()
        if self._async_future is not None:
            try:
                self._async_future.result(timeout=self.cfg.rollout.request_timeout_s)
            except Exception as e:  # noqa: BLE001 - surfaced by take_async otherwise
                log.warning("async producer stopped with: %s", e)
            self._async_future = None

    def take_async(self, step: int, version: int, *, timeout_s: Optional[float] = None) -> tuple[list[Group], Any]:
        """Lease a step's groups under ``store.max_staleness``; waits at most ``timeout_s`` (default
        ``trainer.wait_timeout_s``), a stop request ends the wait (StopRequested)."""
        s = self.cfg.store
        policy = bounded(s.max_staleness, s.order, s.retire_overage)
        timeout_s = self.cfg.trainer.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        who = (f"external producers push to {getattr(self, 'ingest_url', '?')}/v1/groups" if self.external
               else f"the engines generate them (logs in {self.cfg.trainer.run_dir}/engines)")
        notes = _WaitNotes(f"{self.cfg.trainer.prompts_per_step} groups for step {step} within "
                           f"store.max_staleness={s.max_staleness} of version {version}", who, timeout_s)
        while True:
            self._raise_failed()
            try:
                lease = self.store.lease(policy, n_groups=self.cfg.trainer.prompts_per_step, current_version=version,
                                         step=step, timeout_s=1.0)
                return lease.groups, lease
            except NotReadyError as e:
                if self.stop_event.is_set():
                    raise StopRequested(f"stopped while waiting for the rollouts of step {step}") from None
                notes.tick(str(e))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step}: no {self.cfg.trainer.prompts_per_step} servable groups within "
                                       f"{timeout_s:.0f}s (trainer.wait_timeout_s): {e}; check that {who}; run the "
                                       "same command again to resume") from None

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy (avg@k at the rollout temperature) with the engines' current weights."""
        self.wait_generation()
        out = {}
        k = self.cfg.trainer.eval_samples
        for name, items in self.eval_sets.items():
            ctx = self._context(f"eval-{name}-{step}", n_samples=k)
            groups = self._wait(self._bg.submit(self.producer(ctx, items)), f"the evaluation on {name!r}",
                                interruptible=True)
            fault_point("evaluation")
            rewards = [float(t.reward) for g in groups for t in g.trajectories]
            correct = sum(r >= self.cfg.reward.correct for r in rewards)
            out[f"eval/{name}/acc"] = correct / max(1, len(rewards))
        return out
