"""The rank-0 rollout side: it builds and wires the parts, and shuts them down.

Only global rank 0 builds a :class:`RolloutDriver`; every rank runs the actor. The driver never
takes part in a collective: its parts return data (groups, evaluation results) and the trainer
loop shares it and runs the actor on every rank. The parts, each with one job:

* ``weights`` (:class:`~.weight_push.WeightPushController`): the engines' weight version, pushes,
  engine restarts and refits;
* ``generator`` (:class:`~.generation.StepGenerator`): the groups of scheduled steps (sync /
  stale_k); ``producer_loop`` (:class:`~.generation.AsyncProducerLoop`): continuous generation
  (async mode with engines; None for external producers, who push on their own);
* ``leaser`` (:class:`~.leaser.Leaser`): a step's groups from the store, and their acks;
* ``ingestion`` (:class:`~.ingestion.IngestionServer`): the store's HTTP ingestion for external
  producers (``rollout.source=external``; else None);
* ``evaluator`` (:class:`~.evaluation.Evaluator`): held-out accuracy.

They share the store, the prompt stream, the producer, the SGLang client and one background event
loop (generation runs there, overlapping training whenever the schedule allows). Group ids are
deterministic (:mod:`megatron_m2po.rollout.group_ids`): a resumed run re-draws the same prompts for
the same steps and generates only the groups the store lacks.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any, Optional

from megatron_m2po.config import Config, RolloutConfig
from megatron_m2po.data.dataset import build_eval_sets, build_prompt_dataset
from megatron_m2po.rewards import get_reward_fn
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.dispatch import DispatchClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.placement import cuda_count, node_gpus, placement
from megatron_m2po.rollout.episodes import make_episode_producer
from megatron_m2po.rollout.producer import load_producer
from megatron_m2po.rollout.weight_sync import export_fp8_dir
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.store.types import RoutingSpec
from megatron_m2po.trainer.evaluation import Evaluator
from megatron_m2po.trainer.generation import AsyncProducerLoop, GroupMaker, StepGenerator
from megatron_m2po.trainer.ingestion import IngestionServer
from megatron_m2po.trainer.leaser import Leaser
from megatron_m2po.trainer.weight_push import WeightPushController, build_weight_sync
from megatron_m2po.utils.background_loop import BackgroundLoop

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


class RolloutDriver:
    """Rank-0 coordination of rollout generation and the rollout store (the parts above)."""

    def __init__(self, cfg: Config, model_path: str, tokenizer: Any):
        self.cfg, self.model_path = cfg, model_path
        run_dir = Path(cfg.trainer.run_dir)
        # The data first: a mistake in it (a bad row, a prompt too long) is found before the store is created.
        self.dataset = build_prompt_dataset(cfg.data, tokenizer, cfg.trainer.seed)
        eval_sets = build_eval_sets(cfg.data, tokenizer, cfg.trainer.seed) if cfg.trainer.eval_every_steps else {}
        self.store = RolloutStore.from_config(cfg.store, run_dir=str(run_dir))
        if cfg.rollout.return_routed_experts:  # every put (ours and external producers') is checked by it
            self.store.set_routing(routing_spec(model_path, required=cfg.algo.routing_replay == "rollout"))
        self.reward = get_reward_fn(cfg.reward)
        self.sync_dir = cfg.resolved_path(cfg.rollout.weight_sync_dir, "weights")
        # Set by the trainer's signal handler: waits for data return at once (StopRequested).
        self.stop_event = threading.Event()
        self.external = cfg.rollout.source == "external"
        self.fleet: Optional[EngineFleet] = None
        self._bg = BackgroundLoop("m2po-rollout")  # the producer runs here
        self.client: Optional[SGLangClient] = None
        self.weights = WeightPushController()  # replaced by rank 0's controller once the engines run
        self.generator: Optional[StepGenerator] = None
        self.ingestion: Optional[IngestionServer] = None
        self.producer_loop: Optional[AsyncProducerLoop] = None
        try:
            self._start_engines(run_dir)
            self.weights = WeightPushController(
                build_weight_sync(cfg.rollout, self.engine_urls, sync_dir=str(self.sync_dir),
                                  base_model_dir=model_path, external=self.external),
                fleet=self.fleet, store=self.store, bg=self._bg, drain=lambda: self.generator.wait_generation())
            maker = GroupMaker(cfg.rollout, seed=cfg.trainer.seed, tokenizer=tokenizer, reward=self.reward,
                               producer=build_producer(cfg.rollout), client=self.client, store=self.store,
                               engine_version=lambda: self.weights.version)
            self.filter_counters = maker.counters
            self.generator = StepGenerator(cfg.trainer, maker=maker, dataset=self.dataset, store=self.store,
                                           bg=self._bg, stop_event=self.stop_event)
            producers = None
            if self.external:
                # rollout.filter applies at ingestion: dropped groups are acknowledged, not stored.
                self.ingestion = IngestionServer(cfg.store, self.store, self._bg, group_filter=cfg.rollout.filter,
                                                 counters=maker.counters)
                url = self.ingestion.start(str(self.sync_dir), base_model=model_path)
                producers = f"external producers push to {url}/v1/groups"
                if self.store.current_version is None:
                    self.store.set_version(0)
            else:
                self.producer_loop = AsyncProducerLoop(cfg.trainer, cfg.store, maker=maker, dataset=self.dataset,
                                                       store=self.store, bg=self._bg,
                                                       stop_timeout_s=cfg.rollout.request_timeout_s)
            self.leaser = Leaser(cfg.trainer, cfg.store, self.store, stop_event=self.stop_event,
                                 sources=[self.generator] + ([self.producer_loop] if self.producer_loop else []),
                                 producers=producers,
                                 on_leased=self.producer_loop.leased if self.producer_loop else None)
            self.evaluator = Evaluator(eval_sets, samples=cfg.trainer.eval_samples, correct=cfg.reward.correct,
                                       maker=maker, bg=self._bg, drain=self.generator.wait_generation,
                                       wait=lambda fut, what: self.generator.wait(fut, what, interruptible=True))
        except BaseException:
            self.close()  # no engine processes left behind
            raise

    # ------------------------------------------------------------------ engines
    def _start_engines(self, run_dir: Path) -> None:
        """The engine fleet and the client the producer samples with (none for external producers
        without ``rollout.external_addrs``)."""
        cfg = self.cfg
        if self.external and not cfg.rollout.external_addrs:
            return
        # FP8 engines start from a block-FP8 export of the base model: SGLang 0.5.23 reloads
        # only block-FP8 parameters (rollout/fp8.py); `--quantization fp8` on the float
        # model would quantise per channel, and the first weight push would fail.
        engine_model = self._fp8_base(run_dir) if cfg.rollout.fp8_weights else self.model_path
        # Engines on this node go after the trainer's GPUs; impossible layouts fail here, before
        # anything starts (rollout/placement.py).
        node = node_gpus(count=cuda_count(), trainer_on_gpu=cuda_count() is not None)
        if cfg.rollout.launcher == "local":
            placement(cfg, node)
        # refit_fn is bound late: the push controller needs the started fleet's URLs first.
        self.fleet = EngineFleet(cfg.rollout, engine_model, run_dir=str(run_dir),
                                 refit_fn=lambda url: self.weights.refit(url), node=node,
                                 on_concurrency=self._resize_client, on_engines=self._reset_engines)
        self.fleet.start()
        self._bg.submit(self._open_client()).result()

    async def _open_client(self) -> None:
        # sglang-router's client, or without a router a DispatchClient over the engines (rollout/dispatch.py)
        self.client = self.fleet.client()

    def _resize_client(self, concurrency: int) -> None:
        """The fleet's derived concurrency changed (engines joined or left): the client follows."""
        if self.client is not None and not isinstance(self.client, DispatchClient):
            self._bg.submit(self.client.set_concurrency(concurrency)).result(timeout=30)

    def _reset_engines(self, limits: dict[str, int]) -> None:
        """No router: the fleet's engines changed (restart, admission) or were re-checked; the
        dispatching client sends requests to these (and to engines it had marked down again)."""
        if isinstance(self.client, DispatchClient):
            self._bg.submit(self.client.set_engines(limits)).result(timeout=30)

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
        return self.fleet.engine_urls if self.fleet is not None else []

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
    def filter_metrics(self) -> dict[str, float]:
        """``rollout.filter``'s counts since the previous call (one step's log line; sums):
        ``rollout/{generated,filtered,surplus}_groups``, ``rollout/oversample_rounds``. Counted
        where groups are made (or ingested), so in stale_k they belong to the steps generated since
        the previous log line, not only to the step logged. {} without a filter."""
        return self.filter_counters.take() if self.cfg.rollout.filter != "none" else {}

    def start_continuous(self) -> None:
        """Async mode: generate continuously (bounded by the store's admission control) until
        :meth:`close`; external producers push on their own."""
        if self.producer_loop is not None:
            self.producer_loop.start()

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
            cursor = {"store_id": self.store.store_id, "acked_through": 0, "unacked": [], "version": 0}
        replays = self.store.restore_cursor(cursor, strict=not fresh)
        # Published weights of lost versions: a push of that version must write the re-run's
        # weights, not reuse these (DiskWeightSync reuses a complete v<N>); producers must not load them.
        for d in self.sync_dir.glob("v*"):
            n = d.name[1:].removesuffix(".tmp")
            if n.isdigit() and int(n) > version:
                shutil.rmtree(d, ignore_errors=True)
        retired = self.store.retire_ahead(version) if retire_ahead else []
        if replays or retired:
            log.info("restart from %s (version %d): %d recorded lease(s) will be replayed; %d unconsumed group(s) "
                     "made by weights newer than version %d retired", "the base model" if fresh else "a checkpoint",
                     version, replays, len(retired), version)
        return {"replays": replays, "retired": len(retired)}

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self.producer_loop is not None:
            self.producer_loop.stop()
        if self.generator is not None:
            self.generator.cancel()
        if self.client is not None:
            try:
                self._bg.submit(self.client.close()).result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self.ingestion is not None:
            self.ingestion.close()
        self._bg.close()
        closers = (self.weights.close, self.fleet.stop if self.fleet else None, self.reward.close, self.store.close)
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
