"""The sampler of groups: prompts in, groups with deterministic ids out (rank 0's rollout side).

:class:`GroupSampler` runs the producer (``rollout.producer``) for a batch of prompts, gives its
groups their deterministic ids (:mod:`megatron_m2po.rollout.group_ids`), applies ``rollout.filter``
(dynamic sampling, docs/design.md §3a) and stores batches. Both kinds of generation use it:
scheduled generation (:mod:`.scheduled`, sync / stale_k) and continuous generation
(:mod:`.continuous`, async); so does the held-out evaluation (:mod:`.evaluation`).

Vocabulary, here and in the service: *sample* makes groups and returns them unstored; *generate*
makes groups and stores them.

With ``rollout.filter`` groups whose rewards are all equal never reach the store: a scheduled step
over-samples (:meth:`GroupSampler.oversample`, prompts from :func:`oversample_prompts`) until it
has ``prompts_per_step`` informative groups, at its own scheduled version; continuous generation
simply generates more.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable, Optional, Protocol

import numpy as np

from megatron_m2po.rollout.settings import RolloutConfig
from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout.filters import FilterCounters, split_groups
from megatron_m2po.rollout.producer import Producer, ProducerContext
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.store.types import Group
from megatron_m2po.utils.timing import TIMER


class EngineWeights(Protocol):
    """What the sampler reads of the engines' weights: the version they hold now
    (:class:`~megatron_m2po.weights.push.WeightPushController` is one)."""

    version: int


class GroupSampler:
    """Prompts in, groups with deterministic ids out; stored one batch at a time.

    ``weights``: the engines' weights (:class:`EngineWeights`, the push controller); every batch is
    tagged with their version at submission. ``client``: the SGLang client the producer samples
    with (None without engines)."""

    def __init__(self, rollout: RolloutConfig, *, seed: Optional[int], tokenizer: Any, reward: Any,
                 producer: Producer, client: Any, store: RolloutStore, weights: EngineWeights):
        self.rollout, self.seed = rollout, seed
        self.tokenizer, self.reward, self.producer, self.client = tokenizer, reward, producer, client
        self.store, self.weights = store, weights
        self._lock: Optional[asyncio.Lock] = None  # batches are generated one after another
        self.counters = FilterCounters()  # rollout.filter: what was generated, dropped, over-sampled

    def context(self, prefix: str, n_samples: Optional[int] = None, **meta) -> ProducerContext:
        """The producer's context for a batch whose groups are named ``group_id(prefix, position)``."""
        r = self.rollout
        params = {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens}
        if self.tokenizer.eos_token_id is not None:
            params["stop_token_ids"] = [int(self.tokenizer.eos_token_id)]
        routed = self._routing()
        # The store's layout is `required` exactly when the trainer replays routing (algo.routing_replay=rollout).
        replay = routed is not None and self.store.routing.required
        return ProducerContext(client=self.client, tokenizer=self.tokenizer, reward=self.reward,
                               sampling_params=params, n_samples=n_samples or r.n_samples_per_prompt,
                               version=self.weights.version, group_prefix=prefix, metadata=meta,
                               max_attempts=r.max_retries + 1, seed=self.seed, routed_experts=routed,
                               routing_replay=replay)

    def _routing(self) -> Optional[tuple[int, int]]:
        """``(layers, top_k)`` of the routed experts the engines return (rollout.return_routed_experts),
        from the layout the trainer recorded in the store (``RolloutStore.set_routing``)."""
        if not self.rollout.return_routed_experts:
            return None
        spec = self.store.routing
        if spec is None or not spec.num_layers:
            raise RuntimeError("rollout.return_routed_experts=true but the store has no routed-experts layout; the "
                               "trainer records it from the model at start-up (RolloutStore.set_routing)")
        return spec.num_layers, spec.top_k

    def engine_version(self) -> int:
        """The weight version the engines hold now."""
        return self.weights.version

    async def sample(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        """The producer's groups for ``prompts``, renamed to their deterministic ids (unstored)."""
        groups = await self.producer(ctx, prompts)
        if len(groups) != len(prompts):
            raise RuntimeError(f"producer returned {len(groups)} groups for {len(prompts)} prompts")
        # Rename to the step's deterministic ids (a custom producer may not know them).
        fixed = []
        for g, pos in zip(groups, positions):
            gid = group_ids.group_id(ctx.group_prefix, pos)
            for j, t in enumerate(g.trajectories):
                t.group_id, t.uid = gid, group_ids.trajectory_uid(gid, j)
            fixed.append(Group(gid, g.trajectories))
        return fixed

    async def sample_kept(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        """:meth:`sample` with ``rollout.filter`` applied: the kept groups (counted)."""
        groups = await self.sample(ctx, prompts, positions)
        kept, dropped = split_groups(groups, self.rollout.filter)
        self.counters.add(generated_groups=len(groups), filtered_groups=len(dropped))
        return kept

    async def oversample(self, ctx: ProducerContext, prompts: list, positions: list[int], *, step: int,
                         need: int, more: Callable[[int, int], list]) -> list[Group]:
        """The ``need`` groups of scheduled step ``step`` (unstored), over-sampled under ``rollout.filter``.

        Round 0 generates the step's own ``prompts`` (at ``positions``); while fewer than ``need``
        groups survive the filter, an over-sampling round generates ``more(start, n)`` prompts at
        positions ``start .. start+n-1`` (after every position used so far), with the same context:
        same weight version, same id prefix, sampling seeds from the ids. The first ``need`` kept
        groups by position are the step's; informative ones beyond them are counted as surplus.
        Everything depends on the outcomes of earlier rounds only, so a re-run of the step (a
        resume) generates the same rounds where the engines sample reproducibly. More than
        ``rollout.filter_max_rounds`` rounds: RuntimeError naming the step and what to set."""
        r = self.rollout
        kept: list[Group] = []
        made, rounds, next_pos = 0, 0, 0
        while True:
            ctx.positions = list(positions)
            kept += await self.sample_kept(ctx, prompts, positions)
            made += len(positions)
            next_pos = max(next_pos, max(positions, default=-1) + 1)
            if len(kept) >= need:
                break
            if rounds >= r.filter_max_rounds:
                raise RuntimeError(
                    f"step {step}: rollout.filter={r.filter} found {len(kept)} of the {need} informative groups "
                    f"(rewards not all equal) the step needs in {made} groups generated ({rounds} over-sampling "
                    f"round(s) after the step's own prompts, rollout.filter_max_rounds={r.filter_max_rounds}): the "
                    "task gives too few informative groups at this policy. Raise rollout.filter_max_rounds, give "
                    "more samples per prompt (rollout.n_samples_per_prompt), use prompts of a difficulty the "
                    "policy solves sometimes, or set rollout.filter=none")
            rounds += 1
            missing = need - len(kept)
            # Sized by the informative fraction seen so far, one step's prompts at most per round.
            size = min(need, max(missing, math.ceil(missing * made / max(len(kept), 1))))
            prompts, positions = more(next_pos, size), list(range(next_pos, next_pos + size))
        # ``kept`` is in position order: each round's groups come in position order, after the last round's.
        self.counters.add(oversample_rounds=rounds, surplus_groups=len(kept) - need)
        return kept[:need]

    async def store_in_order(self, make: Callable[[], Any]) -> int:
        """Store the groups ``await make()`` returns, one batch at a time; returns how many."""
        # One batch at a time: a step's groups are committed in one transaction, so the store's
        # arrival order keeps steps that share a generation version (base-model steps) apart.
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            with TIMER.union("generation"):  # the service's thread: overlaps the trainer in stale_k / async
                fixed = await make()
            return await self.put(fixed)

    async def put(self, groups: list[Group]) -> int:
        """Store ``groups`` in one transaction, off the event loop; returns how many."""
        if groups:
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.store.put_groups(groups))
        return len(groups)


def oversample_prompts(dataset: Any, seed: int, step: int, start: int, n: int) -> list:
    """The over-sampling prompts of scheduled step ``step`` at positions ``start .. start+n-1``.

    Drawn from a stream of the step's own (a permutation of the dataset seeded by the run seed and
    the step, cycled), not from the main prompt stream: how many a step needs is known only after
    its rollouts are scored, in the background, while the main thread draws later steps' prompts.
    So the main stream (and the dataset position a checkpoint records) never depends on filter
    outcomes, and a resumed step draws the same over-sampling prompts for the same positions.
    ``start`` counts from the step's first position (``prompts_per_step`` for the first round)."""
    items = dataset.items
    order = np.random.default_rng(np.random.SeedSequence([int(seed) % (1 << 64), 0x0D4A90, int(step)])
                                  ).permutation(len(items))
    return [items[int(order[p % len(order)])] for p in range(start, start + n)]
