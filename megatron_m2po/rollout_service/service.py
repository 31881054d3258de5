"""The rank-0 rollout side as one service: the training loop's only way to its data.

Only global rank 0 builds a :class:`RolloutService`; every rank runs the actor. The service never
takes part in a collective: it returns data (groups, evaluation results) and the training loop
(:mod:`megatron_m2po.trainer.loop`) shares it and runs the actor on every rank. Rank 0's loops and
queues (the layout follows torchtitan's RL controller, whose module header draws its loops)::

    main thread: the training loop's calls       background event loop "m2po-rollout"         engines
    ======================================       ====================================         =======

    generate(step, background) ----------------> ScheduledGeneration --+
    sample(step) -> groups; put(groups)            (sync / stale_k)     |   GroupSampler
                                                                        +-> producer(ctx, prompts) ---> EngineFleet
    start_continuous() / stop_continuous() ----> ContinuousGeneration --+   ids, rollout.filter  <---- (SGLang)
                                                   (async, up to its capacity)   |                          ^
                                                                                 | put_groups               |
                                                                                 v                          |
                                                  +--------------------------------------+                  |
    lease(step, version[, generated_at]) <------- | RolloutStore (sqlite): groups,       | <-- IngestionServer
      (Leaser: waits, asks the generators         | leases, acks, quarantine, the        |     (HTTP) <-- external
       whether they failed or went idle)          | trainer's version, the resume cursor |     producers   |
    ack(lease) ---------------------------------> |                                      |                  |
    state_dict() / load_state_dict() / rewind() > +--------------------------------------+                  |
      (dataset position + store cursor)                             ^ set_version                           |
                                                                    |                                       |
    weights (WeightPushController; every rank pushes through one) --+-- drain scheduled generation, then  --+
      send every stage's layers; check_engines(): dead engines relaunched and refit
    evaluate(step) ---------> Evaluator: drain, then the held-out sets through the producer
    request_stop() ---------> the stop event: every interruptible wait ends at once (StopRequested)
    filter_metrics(), engine_loads() --> rollout.filter's counts; the engines' load now

The parts, each with one job, are private and handed to each other when they are built:

* ``_weights`` (:class:`~megatron_m2po.weights.push.WeightPushController`): the engines' weight
  version, pushes, engine restarts and refits;
* ``_sampler`` (:class:`~.groups.GroupSampler`): prompts in, groups with deterministic ids out;
* ``_scheduled`` (:class:`~.scheduled.ScheduledGeneration`): the groups of scheduled steps (sync /
  stale_k); ``_continuous`` (:class:`~.continuous.ContinuousGeneration`): continuous generation
  (async mode with engines; None for external producers, who push on their own);
* ``_leaser`` (:class:`~.leaser.Leaser`): a step's groups from the store, and their acks;
* ``_ingestion`` (:class:`~.ingestion.IngestionServer`): the store's HTTP ingestion for external
  producers (``rollout.source=external``; else None);
* ``_evaluator`` (:class:`~.evaluation.Evaluator`): held-out accuracy.

They share the store, the prompt stream, the producer, the SGLang client and one background event
loop (generation runs there, overlapping training whenever the schedule allows). Two pairs need
each other, and are joined once, explicitly, after both exist: the fleet refits a restarted engine
through the push controller, and the push controller drains scheduled generation before it
changes the engines' weights. Group ids are deterministic (:mod:`megatron_m2po.rollout.group_ids`):
a resumed run re-draws the same prompts for the same steps and generates only the groups the store
lacks.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_m2po.config import Config
from megatron_m2po.rollout.settings import RolloutConfig
from megatron_m2po.data.dataset import build_eval_sets, build_prompt_dataset
from megatron_m2po.rewards import get_reward_fn
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.dispatch import DispatchClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.episodes import make_episode_producer
from megatron_m2po.rollout.placement import cuda_count, node_gpus, placement
from megatron_m2po.rollout.producer import load_producer
from megatron_m2po.rollout_service.continuous import ContinuousGeneration
from megatron_m2po.rollout_service.evaluation import Evaluator
from megatron_m2po.rollout_service.groups import GroupSampler
from megatron_m2po.rollout_service.ingestion import IngestionServer
from megatron_m2po.rollout_service.leaser import Leaser
from megatron_m2po.rollout_service.scheduled import ScheduledGeneration
from megatron_m2po.store.store import Lease, RolloutStore
from megatron_m2po.store.types import Group, RoutingSpec
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.weights.fp8 import export_fp8_dir
from megatron_m2po.weights.lora_export import peft_config
from megatron_m2po.weights.lora_push import AdapterPush, lora_push_mode
from megatron_m2po.weights.lora_push import engine_args as lora_engine_args
from megatron_m2po.weights.push import WeightPushController, build_weight_sync

# LoRA adapter versions every engine keeps loaded: the newest, and the one requests in flight across a push use
ADAPTERS_KEPT = 2

log = logging.getLogger(__name__)


def routing_spec(model_path: str, *, required: bool) -> RoutingSpec:
    """The routed-experts layout of the HF model in ``model_path`` (``store.types.RoutingSpec``)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    hf = getattr(hf, "text_config", None) or hf
    if not getattr(hf, "num_experts_per_tok", None) or not getattr(hf, "num_experts", None):
        raise ValueError(f"rollout.return_routed_experts=true needs an MoE model; {model_path} ({hf.model_type}) has "
                         "no experts: set rollout.return_routed_experts=false")
    return RoutingSpec(int(hf.num_hidden_layers), int(hf.num_experts_per_tok), int(hf.num_experts), required)


class RolloutService:
    """Rank 0's rollout side behind one interface (the diagram above); its parts are private.

    The training loop calls: :meth:`generate` / :meth:`sample` / :meth:`put` / :meth:`missing_steps`
    (scheduled steps), :meth:`start_continuous` / :meth:`stop_continuous`, :meth:`lease` /
    :meth:`ack`, :meth:`mark_step_start` / :meth:`state_dict` / :meth:`load_state_dict` /
    :meth:`rewind` (checkpoints and restarts), :meth:`evaluate`, :meth:`request_stop`,
    :meth:`filter_metrics` / :meth:`engine_loads`, :meth:`close`; and it takes :attr:`weights`
    once (every rank pushes through its controller)."""

    def __init__(self, cfg: Config, model_path: str, tokenizer: Any, *,
                 relaunch: Optional[Callable[[], list[str]]] = None):
        """``relaunch``: what the push controller calls to relaunch dead engines after a failed push
        (colocated mode's offload around it, trainer/colocated.py); None: rank 0 restarts them."""
        self.cfg, self.model_path = cfg, model_path
        self._relaunch = relaunch
        run_dir = Path(cfg.trainer.run_dir)
        # The data first: a mistake in it (a bad row, a prompt too long) is found before the store is created.
        self._dataset = build_prompt_dataset(cfg.data, tokenizer, cfg.trainer.seed)
        eval_sets = build_eval_sets(cfg.data, tokenizer, cfg.trainer.seed) if cfg.trainer.eval_every_steps else {}
        self._store = RolloutStore.from_config(cfg.store, run_dir=str(run_dir))
        if cfg.rollout.return_routed_experts:  # every put (ours and external producers') is checked by it
            self._store.set_routing(routing_spec(model_path, required=cfg.algo.routing_replay == "rollout"))
        self._reward = get_reward_fn(cfg.reward)
        self._sync_dir = cfg.resolved_path(cfg.rollout.weight_sync_dir, "weights")
        # Set by the trainer's signal handler (request_stop): waits for data return at once (StopRequested).
        self._stop_event = threading.Event()
        self._external = cfg.rollout.source == "external"
        self._fleet: Optional[EngineFleet] = None
        self._bg = BackgroundLoop("m2po-rollout")  # the producer runs here
        self._client: Optional[SGLangClient] = None
        self._adapters: Optional[AdapterPush] = None  # model.lora.push=adapter: built before the client
        self._weights = WeightPushController()  # replaced by rank 0's controller once the engines run
        self._scheduled: Optional[ScheduledGeneration] = None
        self._ingestion: Optional[IngestionServer] = None
        self._continuous: Optional[ContinuousGeneration] = None
        # The dataset position at the start of the step being trained (mark_step_start).
        self._step_start_dataset: Optional[dict] = None
        try:
            self._start_engines(run_dir)
            self._build_parts(tokenizer, eval_sets)
        except BaseException:
            self.close()  # no engine processes left behind
            raise

    def _build_parts(self, tokenizer: Any, eval_sets: dict[str, list]) -> None:
        """The parts, in the order they need each other (the module docstring)."""
        cfg = self.cfg
        self._weights = WeightPushController(
            build_weight_sync(cfg.rollout, self.engine_urls, sync_dir=str(self._sync_dir),
                              base_model_dir=self.model_path, external=self._external),
            fleet=self._fleet, store=self._store, bg=self._bg, drain=self._drain, adapters=self._adapters,
            lora_push=lora_push_mode(cfg), relaunch=self._relaunch)
        self._sampler = GroupSampler(cfg.rollout, seed=cfg.trainer.seed, tokenizer=tokenizer, reward=self._reward,
                                     producer=build_producer(cfg.rollout), client=self._client, store=self._store,
                                     weights=self._weights)
        self._scheduled = ScheduledGeneration(cfg.trainer, sampler=self._sampler, dataset=self._dataset,
                                              store=self._store, bg=self._bg, stop_event=self._stop_event)
        self._filter_counters = self._sampler.counters  # counted where groups are made or ingested
        producers = None
        if self._external:
            # rollout.filter applies at ingestion: dropped groups are acknowledged, not stored.
            self._ingestion = IngestionServer(cfg.store, self._store, self._bg, group_filter=cfg.rollout.filter,
                                              counters=self._filter_counters)
            url = self._ingestion.start(str(self._sync_dir), base_model=self.model_path)
            producers = f"external producers push to {url}/v1/groups"
            if self._store.current_version is None:
                self._store.set_version(0)
        else:
            self._continuous = ContinuousGeneration(cfg.trainer, cfg.store, sampler=self._sampler,
                                                    dataset=self._dataset, store=self._store, bg=self._bg,
                                                    stop_timeout_s=cfg.rollout.request_timeout_s)
        self._leaser = Leaser(cfg.trainer, cfg.store, self._store, stop_event=self._stop_event,
                              sources=[self._scheduled] + ([self._continuous] if self._continuous else []),
                              producers=producers,
                              on_leased=self._continuous.leased if self._continuous else None)
        self._evaluator = Evaluator(eval_sets, samples=cfg.trainer.eval_samples, correct=cfg.reward.correct,
                                    sampler=self._sampler, bg=self._bg, scheduled=self._scheduled)

    @property
    def weights(self) -> WeightPushController:
        """Rank 0's weight-push controller (the training loop takes it once and pushes through it)."""
        return self._weights

    # ------------------------------------------------------------------ engines
    def _start_engines(self, run_dir: Path) -> None:
        """The engine fleet and the client the producer samples with (none for external producers
        without ``rollout.external_addrs``)."""
        cfg = self.cfg
        if self._external and not cfg.rollout.external_addrs:
            return
        # FP8 engines start from a block-FP8 export of the base model: SGLang 0.5.23 reloads
        # only block-FP8 parameters (weights/fp8.py); `--quantization fp8` on the float
        # model would quantise per channel, and the first weight push would fail.
        engine_model = self._fp8_base(run_dir) if cfg.rollout.fp8_weights else self.model_path
        # Engines on this node go after the trainer's GPUs; impossible layouts fail here, before
        # anything starts (rollout/placement.py).
        node = node_gpus(count=cuda_count(), trainer_on_gpu=cuda_count() is not None)
        if cfg.rollout.launcher == "local":
            placement(cfg, node)
        self._adapters = self._adapter_push()
        self._fleet = EngineFleet(cfg.rollout, engine_model, run_dir=str(run_dir), node=node, refit_fn=self._refit,
                                  on_concurrency=self._resize_client, on_engines=self._reset_engines,
                                  extra_engine_args=self._lora_engine_args())
        self._fleet.start()
        self._bg.submit(self._open_client()).result()

    def _lora_engine_args(self) -> list[str]:
        """LoRA adapter pushes: the engines serve adapters on their base (weights/lora_push.py)."""
        lora = self.cfg.model.lora
        if lora_push_mode(self.cfg) != "adapter":
            return []
        return lora_engine_args(lora.rank, list(lora.targets), keep=ADAPTERS_KEPT)

    def _refit(self, url: str) -> None:
        """The fleet's ``refit_fn``: a restarted engine gets the current weights (the push controller,
        built once the fleet's URLs are known)."""
        self._weights.refit(url)

    def _drain(self) -> None:
        """The push controller's ``drain``: a push waits for scheduled generation in flight."""
        if self._scheduled is not None:
            self._scheduled.drain()

    def _adapter_push(self) -> Optional[AdapterPush]:
        """Rank 0's adapter pushes (``model.lora.push=adapter``, engines of this run's own); the client
        sends every request under the newest adapter and tags its tokens with that adapter's version."""
        if lora_push_mode(self.cfg) != "adapter":
            return None
        r = self.cfg.rollout
        adapters = AdapterPush(self._sync_dir, peft_config(self.cfg.model.lora, self.model_path),
                               client_for=lambda url: SGLangClient(url, timeout_s=r.weight_sync_timeout_s,
                                                                   control_timeout_s=r.weight_sync_timeout_s),
                               bg=self._bg, timeout_s=r.weight_sync_timeout_s, keep=ADAPTERS_KEPT,
                               in_memory=self.cfg.model.lora.adapter_transport == "memory")
        return adapters

    async def _open_client(self) -> None:
        # sglang-router's client, or without a router a DispatchClient over the engines (rollout/dispatch.py)
        adapters = self._adapters
        self._client = self._fleet.client(adapter=(lambda: adapters.current) if adapters is not None else None)

    def _resize_client(self, concurrency: int) -> None:
        """The fleet's derived concurrency changed (engines joined or left): the client follows."""
        if self._client is not None and not isinstance(self._client, DispatchClient):
            self._bg.submit(self._client.set_concurrency(concurrency)).result(timeout=30)

    def _reset_engines(self, limits: dict[str, int]) -> None:
        """No router: the fleet's engines changed (restart, admission) or were re-checked; the
        dispatching client sends requests to these (and to engines it had marked down again)."""
        if isinstance(self._client, DispatchClient):
            self._bg.submit(self._client.set_engines(limits)).result(timeout=30)

    def _fp8_base(self, run_dir: Path) -> str:
        """``<run_dir>/engine_base_fp8``: the base model in block FP8 (kept for a resume)."""
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
        return self._fleet.engine_urls if self._fleet is not None else []

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

    # ------------------------------------------------------------------ colocated mode
    def release_engines(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> list[str]:
        """Colocated mode: wait for scheduled generation in flight, then every engine frees ``tags``
        (``/release_memory_occupation``; SGLang 0.5.23 asserts an idle engine,
        ``managers/scheduler_components/weight_updater.py`` ``release_memory_occupation``, and kills its
        scheduler otherwise, so nothing may be generating). Returns the engines that failed because
        they are dead (their memory went with their process: :meth:`relaunch_engines`); a failure on
        an engine that is alive raises, naming each."""
        self._scheduled.drain()
        return self._on_engines(lambda c: c.release_memory_occupation(list(tags), timeout_s=self._control_timeout_s),
                                f"release_memory_occupation {list(tags)}")

    def resume_engines(self, tags: tuple[str, ...]) -> list[str]:
        """Colocated mode: every engine maps ``tags`` again (``/resume_memory_occupation``). Resumed
        ``weights`` hold nothing usable (no ``--enable-weights-cpu-backup``): push before generating.
        Returns the engines that are dead, as :meth:`release_engines`."""
        return self._on_engines(lambda c: c.resume_memory_occupation(list(tags), timeout_s=self._control_timeout_s),
                                f"resume_memory_occupation {list(tags)}")

    def dead_engines(self) -> list[str]:
        """Colocated mode: the engines that died (a probe; nothing is relaunched)."""
        return self._fleet.dead_urls() if self._fleet is not None else []

    @property
    def pending_engines(self) -> list[str]:
        """Relaunched engines that wait for the next push (out of the router until it admits them)."""
        return self._fleet.pending_urls if self._fleet is not None else []

    def relaunch_engines(self, release: tuple[str, ...]) -> list[str]:
        """Colocated mode, with the trainer offloaded (a relaunched engine loads the base model and
        reserves its KV cache at start-up, as SGLang 0.5.23 does with ``--enable-memory-saver``:
        ``model_executor/model_runner.py`` ``initialize``): relaunch the dead engines, out of the
        router until a push admits them, then release ``release`` on them, to match the others.
        Returns their URLs."""
        urls = self._weights.restart_dead_engines()
        if urls and release:
            self._on_engines(lambda c: c.release_memory_occupation(list(release), timeout_s=self._control_timeout_s),
                             f"release_memory_occupation {list(release)} of the relaunched engine(s)", urls=urls,
                             tolerate_dead=False)
        return urls

    @property
    def _control_timeout_s(self) -> float:
        return self.cfg.rollout.weight_sync_timeout_s

    def _on_engines(self, fn, what: str, *, urls: Optional[list[str]] = None, tolerate_dead: bool = True) -> list[str]:
        """``fn(client)`` on every engine (or ``urls``) at once (each engine's own URL: the router
        forwards no memory calls). Returns the engines that failed and are dead (``tolerate_dead``);
        any other failure raises RuntimeError naming each engine that failed."""
        import asyncio

        urls = list(self.engine_urls if urls is None else urls)

        async def one(url: str):
            async with SGLangClient(url, max_retries=0, control_timeout_s=self._control_timeout_s) as c:
                return await fn(c)

        async def each() -> list:
            return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)

        got = self._bg.submit(each()).result(timeout=self._control_timeout_s + 30)
        bad = {u: f"{type(r).__name__}: {r}" for u, r in zip(urls, got) if isinstance(r, BaseException)}
        dead = set(self.dead_engines()) & set(bad) if bad and tolerate_dead else set()
        if set(bad) - dead:
            raise RuntimeError(f"{what} failed on {len(bad)}/{len(got)} engine(s):\n  "
                               + "\n  ".join(f"{u}: {m}" for u, m in bad.items()))
        for u in sorted(dead):
            log.warning("%s: engine %s is dead (%s); it is relaunched where its memory is free", what, u, bad[u])
        return sorted(dead)

    # ------------------------------------------------------------------ scheduled generation
    def generate(self, step: int, *, background: bool) -> None:
        """Generate and store the missing groups of scheduled step ``step`` (sync / stale_k); unless
        ``background``, wait for them (a stop request ends the wait: StopRequested)."""
        self._scheduled.generate(step, background=background)

    def sample(self, step: int) -> list[Group]:
        """The missing groups of scheduled step ``step``, generated now and returned unstored: the
        trainer fills in its own behaviour log-probs on every rank, then :meth:`put` stores them."""
        return self._scheduled.sample(step)

    def put(self, groups: list[Group]) -> None:
        """Store groups :meth:`sample` returned."""
        self._scheduled.put(groups)

    def missing_steps(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` whose groups the store does not hold completely (never generated)."""
        return self._scheduled.missing_steps(steps)

    # ------------------------------------------------------------------ continuous generation
    def start_continuous(self) -> None:
        """Async mode: generate continuously (bounded by the store's admission control) until
        :meth:`stop_continuous` or :meth:`close`; external producers push on their own."""
        if self._continuous is not None:
            self._continuous.start()

    def stop_continuous(self) -> None:
        """Stop continuous generation (the batches in flight finish first)."""
        if self._continuous is not None:
            self._continuous.stop()

    # ------------------------------------------------------------------ leases
    def lease(self, step: int, version: int, *, generated_at: Optional[int] = None) -> tuple[list[Group], Lease]:
        """Lease the groups step ``step`` trains on, the trainer at ``version``; returns (groups, lease).

        ``generated_at``: exactly the step's groups generated at that version (sync / stale_k,
        :meth:`.Leaser.take_step`); None: any within ``store.max_staleness`` (async,
        :meth:`.Leaser.take_async`). Bounded by ``trainer.wait_timeout_s``; a stop request ends
        the wait (StopRequested)."""
        if generated_at is None:
            return self._leaser.take_async(step, version)
        return self._leaser.take_step(step, version, generated_at)

    def ack(self, lease: Lease) -> None:
        """The lease's groups are consumed (the step trained on them)."""
        self._leaser.ack(lease)

    # ------------------------------------------------------------------ evaluation, stop, metrics
    def evaluate(self, step: int) -> dict[str, float]:
        """``eval/<set>/acc`` on the held-out sets after ``step`` steps, with the engines' weights
        (scheduled generation drained first); a stop request ends it (StopRequested)."""
        return self._evaluator.evaluate(step)

    def request_stop(self) -> None:
        """The trainer was asked to stop (its signal handler): every interruptible wait for data
        ends at once with StopRequested."""
        self._stop_event.set()

    def filter_metrics(self) -> dict[str, float]:
        """``rollout.filter``'s counts since the previous call (one step's log line; sums):
        ``rollout/{generated,filtered,surplus}_groups``, ``rollout/oversample_rounds``. Counted
        where groups are made (or ingested), so in stale_k they belong to the steps generated since
        the previous log line, not only to the step logged. {} without a filter."""
        return self._filter_counters.take() if self.cfg.rollout.filter != "none" else {}

    # ------------------------------------------------------------------ checkpoints and restarts
    def mark_step_start(self) -> None:
        """A step begins: remember the dataset position before its generation events draw prompts
        (:meth:`state_dict` ``at_step_start``)."""
        self._step_start_dataset = self._dataset.state_dict()

    def state_dict(self, *, at_step_start: bool = False) -> dict:
        """What a resume needs of the rollout side: the dataset position and the store cursor.

        Scheduled generation in flight is waited for first, so the cursor covers it.
        ``at_step_start``: a stop request ended the wait for a step whose generation events drew
        its prompts at its start, and the resumed step draws them again: the position recorded is
        the one from :meth:`mark_step_start`, and generation started at the step's version may stay
        in flight (the resumed step generates what is missing at that same version)."""
        if at_step_start:
            dataset = self._step_start_dataset
        else:
            dataset = self._dataset.state_dict()
            self._scheduled.drain()
        return {"dataset": dataset, "store_cursor": self._store.cursor_state()}

    def load_state_dict(self, state: dict) -> None:
        """The dataset position of a :meth:`state_dict`; the store cursor is restored by
        :meth:`rewind`, which runs at every start (with a checkpoint or without)."""
        self._dataset.load_state_dict(state["dataset"])

    # ------------------------------------------------------------------ restarts
    def rewind(self, cursor: Optional[dict], version: int, *, retire_ahead: bool) -> dict[str, int]:
        """The store side of the restart rule (docs/design.md §5b); call once at start.

        ``cursor`` is the resume checkpoint's store cursor, or None when the run starts from the
        base model (no checkpoint): then every lease ever recorded lies after the resume point.
        Consumption recorded after the resume point is rewound and replayed identically to the
        re-run's requests (a run without a checkpoint may ask differently: an unmatched recorded
        lease is then released instead of raising). ``retire_ahead`` (the async schedule: engines
        or external producers): unconsumed groups with tokens newer than ``version`` were made by
        weights that no longer exist and are retired (counted in the store's metrics); sync /
        stale_k groups are kept: their ids and versions are the schedule's, which the re-run
        reaches again by the same updates on the same data, and they are reused with their true
        versions.
        """
        fresh = cursor is None
        if fresh:
            cursor = {"store_id": self._store.store_id, "acked_through": 0, "unacked": [], "version": 0}
        replays = self._store.restore_cursor(cursor, strict=not fresh)
        # Published weights of lost versions: a push of that version must write the re-run's
        # weights, not reuse these (DiskWeightSync reuses a complete v<N>); producers must not load them.
        for d in self._sync_dir.glob("v*"):
            n = d.name[1:].removesuffix(".tmp")
            if n.isdigit() and int(n) > version:
                shutil.rmtree(d, ignore_errors=True)
        retired = self._store.retire_ahead(version) if retire_ahead else []
        if replays or retired:
            log.info("restart from %s (version %d): %d recorded lease(s) will be replayed; %d unconsumed group(s) "
                     "made by weights newer than version %d retired", "the base model" if fresh else "a checkpoint",
                     version, replays, len(retired), version)
        return {"replays": replays, "retired": len(retired)}

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop generating and serving, then shut the engines, the reward and the store down."""
        self.stop_continuous()
        if self._scheduled is not None:
            self._scheduled.cancel()
        if self._client is not None:
            try:
                self._bg.submit(self._client.close()).result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self._ingestion is not None:
            self._ingestion.close()
        self._bg.close()
        closers = (self._weights.close, self._fleet.stop if self._fleet else None, self._reward.close,
                   self._store.close)
        for closer in closers:
            if closer is None:
                continue
            try:
                closer()
            except Exception as e:  # noqa: BLE001
                log.warning("shutdown: %s failed: %s", getattr(closer, "__qualname__", closer), e)


def build_producer(rollout: RolloutConfig) -> Any:
    """The producer ``rollout.producer`` names: ``agentic`` (multi-turn episodes with
    ``rollout.agentic.env``, rollout/episodes.py) or a ``module:function``."""
    if rollout.producer == "agentic":
        return make_episode_producer(rollout.agentic)
    return load_producer(rollout.producer)
