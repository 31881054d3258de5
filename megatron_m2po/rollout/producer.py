"""Rollout producers: prompts in, scored and version-tagged prompt groups out.

A producer is an ``async`` callable ``producer(ctx: ProducerContext, prompts: list[PromptItem])
-> list[Group]``. The default one samples ``n`` responses per prompt from the engines (through
sglang-router, or dispatched by the client over the engines), keeps the engine's per-token sampling log-probs as behaviour log-probs, tags
every token with the weight version that produced it, scores the responses with the reward
function and returns one :class:`~megatron_m2po.store.types.Group` per prompt. Custom producers
(tools, agents, multi-turn) are given as ``rollout.producer = "module:function"`` and checked
at start-up by :func:`load_producer`.

Version tags. The trainer passes the version the engines hold when the batch is submitted
(``ctx.version``). When an engine reports a version per token we use it; when it reports only
the version at the end of the request and that differs from ``ctx.version`` (the request
spanned a weight update, possible only in async mode), every token is tagged with
``ctx.version``: the oldest version it may come from, so the measured staleness is an upper
bound and the ``max_staleness`` rule is never violated. Routed experts (MoE routing replay) are
tagged the same way: the rows of a response all come from its last (re)prefill's weights, so tokens
sampled before a push retracted the request were computed over routing the engine no longer has
(``rollout/routing_versions.py``); they are counted, and masked from the loss when routing is replayed.

Seeded sampling. With ``ctx.seed`` set (the trainer passes ``trainer.seed``), every request
carries SGLang's ``sampling_seed`` (``sglang/srt/sampling/sampling_params.py`` in 0.5.23: an
int in [-2**63, 2**63)) derived from the run seed, the group id and the sample index, so a
re-run of the same configuration samples the same tokens wherever the engine's numerics are
reproducible, whichever engine the router picks, and a resumed step re-samples a missing group
exactly as the killed run would have.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

import numpy as np

from megatron_m2po.rollout.group_ids import group_id, trajectory_uid
from megatron_m2po.rollout.routing_versions import keep_replayable, response_routing_version
from megatron_m2po.store.types import Group, Trajectory
from megatron_m2po.utils.aio import gather_or_cancel
from megatron_m2po.utils.timing import TIMER

logger = logging.getLogger(__name__)

Producer = Callable[["ProducerContext", list], Awaitable[list[Group]]]


@dataclass
class ProducerContext:
    """What a producer gets from the trainer for one batch of prompts.

    Attributes:
        client: an SGLangClient pointed at the router (or a single engine).
        tokenizer: HF tokenizer of the policy (decodes responses for the reward).
        reward: object with ``score_batch(responses, answers) -> RewardResult``.
        sampling_params: SGLang sampling params (temperature, top_p, max_new_tokens, stop ids).
        n_samples: responses per prompt (the GRPO group size).
        version: weight version the engines hold at submission.
        group_prefix: group ids are ``group_ids.group_id(group_prefix, position)`` (deterministic;
            :mod:`~megatron_m2po.rollout.group_ids` owns the format).
        metadata: extra metadata copied into every trajectory (step, mode, ...).
        seed: run seed; when set, request ``j`` of group ``gid`` is sampled with
            ``sampling_seed = request_seed(seed, gid, j)``.
        positions: position of each prompt in its step (group ``group_id(group_prefix, pos)``);
            defaults to the prompt's index in the list handed to the producer.
        routed_experts: ``(num_layers, top_k)`` of the MoE model when the engines' routed experts
            are kept (``rollout.return_routed_experts``): every request asks for them and every
            trajectory carries them (:func:`routed_rows`) with the versions that computed them
            (``metadata["routing"]``, :mod:`~megatron_m2po.rollout.routing_versions`); None otherwise.
        routing_replay: the trainer replays the routed experts (``algo.routing_replay=rollout``):
            model tokens whose behaviour log-prob was not computed over the stored routing (sampled
            before a weight push retracted their request) get ``loss_mask`` 0.
    """

    client: Any
    tokenizer: Any
    reward: Any
    sampling_params: dict
    n_samples: int
    version: int
    group_prefix: str
    metadata: dict = field(default_factory=dict)
    max_attempts: int = 3
    seed: Optional[int] = None
    positions: Optional[list[int]] = None
    routed_experts: Optional[tuple[int, int]] = None
    routing_replay: bool = False

    def group_id(self, p: int) -> str:
        """Deterministic id of the group of the ``p``-th prompt handed to the producer."""
        pos = self.positions[p] if self.positions is not None else p
        return group_id(self.group_prefix, pos)

    def sampling_params_for(self, gid: str, j: int) -> dict:
        """Sampling params of sample ``j`` of group ``gid`` (seeded when ``seed`` is set)."""
        if self.seed is None:
            return self.sampling_params
        return {**self.sampling_params, "sampling_seed": request_seed(self.seed, gid, j)}


def request_seed(seed: int, group_id: str, j: int) -> int:
    """A 63-bit sampling seed from (run seed, group id, sample index); stable across runs."""
    digest = hashlib.blake2b(f"{int(seed)}:{group_id}:{int(j)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _token_versions(out: Any, version: int) -> np.ndarray:
    n = len(out.output_ids)
    if out.token_weight_versions is not None and len(out.token_weight_versions) == n:
        return np.asarray([int(v) for v in out.token_weight_versions], dtype=np.int64)
    return np.full(n, version, dtype=np.int64)


def routed_rows(ctx: ProducerContext, out: Any, start: int, stop: int) -> Optional[np.ndarray]:
    """The routed experts of positions ``[start, stop)`` from a response that asked for them from
    ``start`` on (``stop`` = prompt + output length - 1); None when the context keeps none."""
    if ctx.routed_experts is None:
        return None
    layers, k = ctx.routed_experts
    return out.routed_experts_array(layers, k, stop - start)


async def sample_one(ctx: ProducerContext, prompt_ids: Sequence[int], params: Optional[dict] = None,
                  routed_start: int = 0, affinity: Optional[str] = None) -> Any:
    """One response; an aborted one (engine restarted under it) is sampled again. With
    ``ctx.routed_experts`` it asks for the routed experts of the positions from ``routed_start`` on.
    ``affinity`` (the group id) keeps a group's requests on one engine when the client dispatches
    itself (``rollout/dispatch.py``; sglang-router's cache-aware policy does so from the prompt)."""
    kw: dict = {}
    if ctx.routed_experts is not None:
        kw = {"return_routed_experts": True, "routed_experts_start_len": int(routed_start)}
    if affinity is not None:
        kw["affinity"] = affinity
    for attempt in range(ctx.max_attempts):
        out = await ctx.client.generate(prompt_ids, params or ctx.sampling_params, return_logprob=True, **kw)
        if not out.aborted:
            if out.output_logprobs is None or len(out.output_logprobs) != len(out.output_ids):
                raise RuntimeError(f"engine returned {len(out.output_ids)} tokens but "
                                   f"{None if out.output_logprobs is None else len(out.output_logprobs)} "
                                   "log-probs; start it with return_logprob support")
            return out
        logger.warning("generation aborted by the engine (attempt %d/%d); sampling again", attempt + 1,
                       ctx.max_attempts)
    raise RuntimeError(f"generation was aborted {ctx.max_attempts} times in a row; check the engine logs")


async def default_producer(ctx: ProducerContext, prompts: list) -> list[Group]:
    """Sample ``ctx.n_samples`` responses per prompt, score them, return one group per prompt."""
    jobs = [sample_one(ctx, item.prompt_ids, ctx.sampling_params_for(ctx.group_id(p), j), affinity=ctx.group_id(p))
            for p, item in enumerate(prompts) for j in range(ctx.n_samples)]
    outs = await gather_or_cancel(*jobs)
    texts = [ctx.tokenizer.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    answers = [item.answer for item in prompts for _ in range(ctx.n_samples)]
    # The reward pool blocks; keep the event loop free for other producers' requests.
    with TIMER.phase("reward"):  # driver-side; concurrent groups overlap (a sum of their times)
        result = await asyncio.get_running_loop().run_in_executor(None, ctx.reward.score_batch, texts, answers)
    groups = []
    for p, item in enumerate(prompts):
        gid = ctx.group_id(p)
        trajs = []
        for j in range(ctx.n_samples):
            i = p * ctx.n_samples + j
            out = outs[i]
            versions = _token_versions(out, ctx.version)
            meta = {"prompt_index": int(item.index), "answer": item.answer, **ctx.metadata}
            rows = len(item.prompt_ids) + len(out.output_ids) - 1
            mask = None
            if ctx.routed_experts is not None:  # every row from the weights of the request's last (re)prefill
                row_v = np.full(rows, response_routing_version(out, ctx.version), np.int64)
                mask, meta["routing"] = keep_replayable(len(item.prompt_ids), versions, None, row_v,
                                                        replay=ctx.routing_replay)
            trajs.append(Trajectory(
                uid=trajectory_uid(gid, j), group_id=gid, prompt_ids=np.asarray(item.prompt_ids),
                response_ids=np.asarray(out.output_ids), behav_logprobs=np.asarray(out.output_logprobs),
                versions=versions, reward=float(result.scores[i]), loss_mask=mask,
                finish_reason=out.finish_type if out.finish_type in ("stop", "length", "abort") else "stop",
                metadata=meta, routed_experts=routed_rows(ctx, out, 0, rows)))
        groups.append(Group(gid, trajs))
    return groups


def load_producer(spec: str) -> Producer:
    """Import ``module:function`` and check it is an async ``(ctx, prompts) -> list[Group]``."""
    if ":" not in spec:
        raise ValueError(f"rollout.producer={spec!r} must look like 'package.module:function'")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"rollout.producer={spec!r}: cannot import {mod_name!r}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise ValueError(f"rollout.producer={spec!r}: module {mod_name!r} has no attribute {fn_name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.producer={spec!r} must be an async function (ctx, prompts) -> list[Group]")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < 2:
        raise ValueError(f"rollout.producer={spec!r} must accept (ctx, prompts); it takes "
                         f"{[p.name for p in params]}")
    return fn


def run_producer(producer: Producer, ctx: ProducerContext, prompts: list,
                 loop: Optional[asyncio.AbstractEventLoop] = None) -> list[Group]:
    """Run a producer to completion from synchronous code; checks what it returns."""
    coro = producer(ctx, prompts)
    groups = asyncio.run_coroutine_threadsafe(coro, loop).result() if loop else asyncio.run(coro)
    if not isinstance(groups, list) or not all(isinstance(g, Group) for g in groups):
        raise TypeError(f"producer returned {type(groups).__name__}; it must return list[Group]")
    return groups
