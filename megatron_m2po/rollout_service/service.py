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
      send every stage's layers, the engines held by EngineControl                                          |
    engines (EngineControl) --------------------------------------------------------------------------------+
      check(): dead engines relaunched and refit; colocated: release / resume / relaunch; loads()
    evaluate(step) ---------> Evaluator: drain, then the held-out sets through the producer
    request_stop() ---------> the stop event: every interruptible wait ends at once (StopRequested)
    filter_metrics() -------> rollout.filter's counts

The parts, each with one job, are private and handed to each other when they are built:

* ``_engines`` (:class:`~.engine_control.EngineControl`): the engines' one owner (their fleet, the
  client, the version they serve, their adapters, every verb that acts on them);
* ``_weights`` (:class:`~megatron_m2po.weights.push.WeightPushController`): the weight version and
  the pushes (through ``_engines``' transport, the engines held by ``_engines`` meanwhile);
* ``_sampler`` (:class:`~.groups.GroupSampler`): prompts in, groups with deterministic ids out;
* ``_scheduled`` (:class:`~.scheduled.ScheduledGeneration`): the groups of scheduled steps (sync /
  stale_k); ``_continuous`` (:class:`~.continuous.ContinuousGeneration`): continuous generation
  (async mode with engines; None for external producers, who push on their own);
* ``_leaser`` (:class:`~.leaser.Leaser`): a step's groups from the store, and their acks;
* ``_ingestion`` (:class:`~megatron_m2po.ingestion.endpoint.IngestionServer`): the store's HTTP ingestion for external
  producers (``rollout.source=external``; else None);
* ``_evaluator`` (:class:`~.evaluation.Evaluator`): held-out accuracy.

They share the store, the prompt stream, the producer, the SGLang client and one background event
loop (generation runs there, overlapping training whenever the schedule allows). Each part gets
what it needs in its constructor; the engines' ``drain`` (a push or a memory release waits for
scheduled generation in flight) is the service's own method, which reads the scheduled part once it
exists. Group ids are deterministic (:mod:`megatron_m2po.rollout.group_ids`):
a resumed run re-draws the same prompts for the same steps and generates only the groups the store
lacks.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_m2po.config import Config
from megatron_m2po.rollout.settings import RolloutConfig
from megatron_m2po.data.dataset import build_eval_sets, build_prompt_dataset
from megatron_m2po.rewards import get_reward_fn
from megatron_m2po.rollout.episodes import make_episode_producer
from megatron_m2po.rollout.producer import load_producer
from megatron_m2po.rollout_service.continuous import ContinuousGeneration
from megatron_m2po.rollout_service.engine_control import EngineControl
from megatron_m2po.rollout_service.evaluation import Evaluator
from megatron_m2po.rollout_service.groups import GroupSampler
from megatron_m2po.ingestion.endpoint import IngestionServer
from megatron_m2po.rollout_service.teacher import TeacherEngines
from megatron_m2po.rollout_service.leaser import Leaser
from megatron_m2po.rollout_service.scheduled import ScheduledGeneration
from megatron_m2po.store.store import Lease, RolloutStore
from megatron_m2po.store.types import Group, RoutingSpec
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.weights.lora_push import lora_push_mode
from megatron_m2po.weights.push import WeightPushController, build_weight_sync

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
    :meth:`filter_metrics`, :meth:`close`; and it takes :attr:`weights` once (every rank pushes
    through its controller) and :attr:`engines` (rank 0's engine verbs)."""

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
        self._bg = BackgroundLoop("m2po-rollout")  # the producer runs here
        self._engines: Optional[EngineControl] = None
        self._weights = WeightPushController()  # replaced by rank 0's controller once the engines run
        self._scheduled: Optional[ScheduledGeneration] = None
        self._ingestion: Optional[IngestionServer] = None
        self._continuous: Optional[ContinuousGeneration] = None
        self._teacher: Optional[TeacherEngines] = None  # algo.distill.mode=sglang
        # The dataset position at the start of the step being trained (mark_step_start).
        self._step_start_dataset: Optional[dict] = None
        try:
            self._engines = EngineControl.launch(
                cfg, model_path, run_dir=run_dir, store=self._store, bg=self._bg, drain=self._drain,
                transport=lambda urls: build_weight_sync(cfg.rollout, urls, sync_dir=str(self._sync_dir),
                                                         base_model_dir=model_path, external=self._external))
            self._build_parts(tokenizer, eval_sets)
            d = cfg.algo.distill
            if d.coef > 0 and d.mode == "sglang":
                from megatron_m2po.utils.hf_dir import check_same_tokenizer, resolve_model_path

                teacher = resolve_model_path(cfg.model, override=d.teacher)
                check_same_tokenizer(model_path, teacher)
                self._teacher = TeacherEngines.launch(cfg, teacher, run_dir=run_dir, bg=self._bg, store=self._store)
        except BaseException:
            self.close()  # no engine processes left behind
            raise

    def _build_parts(self, tokenizer: Any, eval_sets: dict[str, list]) -> None:
        """The parts, in the order they need each other (the module docstring)."""
        cfg = self.cfg
        self._weights = WeightPushController(self._engines.transport, engines=self._engines,
                                             lora_push=lora_push_mode(cfg), relaunch=self._relaunch)
        self._sampler = GroupSampler(cfg.rollout, seed=cfg.trainer.seed, tokenizer=tokenizer, reward=self._reward,
                                     producer=build_producer(cfg.rollout), client=self._engines.client,
                                     store=self._store,
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

    @property
    def engines(self) -> EngineControl:
        """Rank 0's engines (the training loop checks them before a step; colocated mode moves
        their memory)."""
        return self._engines

    def _drain(self) -> None:
        """The engines' ``drain``: a push or a memory release waits for scheduled generation in flight."""
        if self._scheduled is not None:
            self._scheduled.drain()

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

    def score_teacher(self, groups: list[Group]) -> None:
        """``algo.distill.mode=sglang``: the leased ``groups``' trajectories that have no teacher log-probs
        yet scored by the teacher engines and stored (rollout_service/teacher.py); else nothing."""
        if self._teacher is not None:
            self._teacher.score(groups)

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
        if self._engines is not None:
            self._engines.close_client()
        if self._ingestion is not None:
            self._ingestion.close()
        if self._teacher is not None:
            self._teacher.close()
        self._bg.close()
        closers = (self._engines.close if self._engines else None, self._reward.close, self._store.close)
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
