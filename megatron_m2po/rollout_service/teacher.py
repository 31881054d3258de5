"""The distillation teacher on SGLang engines (``algo.distill.mode=sglang``; algo/distill.py says what
the teacher's log-probs are for).

Teacher engines are started like the rollout fleet (``algo.distill.teacher_engines`` of the rollout's
engine kind and launcher, on ``algo.distill.teacher_gpu_ids``, logs in ``<run_dir>/teacher/engines``)
or are already running at ``algo.distill.teacher_addrs``. Each response is scored with one request:
``input_ids`` = prompt + response, ``max_new_tokens = 0``, ``return_logprob`` with
``logprob_start_len = P - 1`` (P: the prompt's length); ``meta_info.input_token_logprobs`` then holds
None for the prompt's last token and the log-prob of every response token given the ones before it,
from the raw logits (SGLang 0.5.23 ``logprob_result_processor.py``: no temperature, which is why the
rollout's temperature must be 1 in this mode).

When: on rank 0 when a step's groups are leased, for every trajectory the store holds without them
(so every run mode, external producers' groups and agentic episodes alike); the values are written to
the store's ``teacher`` column before the step trains (:meth:`RolloutStore.set_teacher_logprobs`), so a
resumed or replayed step, and a stale one, reads exactly what the first scoring wrote.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_m2po.config import Config
from megatron_m2po.rollout.client import EngineError, SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.placement import cuda_count, node_gpus
from megatron_m2po.store.types import Group, Trajectory
from megatron_m2po.utils.aio import gather_or_cancel
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.timing import TIMER

log = logging.getLogger(__name__)

__all__ = ["TeacherEngines", "score_response"]


async def score_response(client: SGLangClient, prompt_ids, response_ids) -> np.ndarray:
    """The served model's float32 log-prob of each response token given the prompt and the response
    tokens before it (module docstring); an empty response needs no request."""
    p, r = len(prompt_ids), len(response_ids)
    if r == 0:
        return np.zeros(0, np.float32)
    ids = [int(t) for t in prompt_ids] + [int(t) for t in response_ids]
    out = await client.generate(ids, {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
                                logprob_start_len=p - 1)
    vals = out.input_logprobs
    if vals is None or len(vals) != r + 1 or any(v is None for v in vals[1:]):
        got = "none" if vals is None else f"{len(vals)} values ({sum(v is None for v in vals[1:])} null after the first)"
        raise EngineError(client.base_url, "/generate", f"the teacher engine returned {got} as input_token_logprobs "
                          f"for a {p}-token prompt and {r}-token response scored from position {p - 1}; expected "
                          f"{r + 1} (is it an SGLang server with return_logprob support?)")
    return np.asarray(vals[1:], dtype=np.float32)


class TeacherEngines:
    """The teacher fleet and its client on the rollout's background loop (module docstring)."""

    def __init__(self, fleet: EngineFleet, bg: BackgroundLoop, *, store: Any) -> None:
        self._fleet, self._bg, self._store = fleet, bg, store
        self._client: Optional[SGLangClient] = None
        try:
            fleet.start()
            self._bg.submit(self._open()).result()
        except BaseException:
            self.close()
            raise
        log.info("distillation teacher: %d engine(s) at %s", len(fleet.engine_urls), ", ".join(fleet.engine_urls))

    async def _open(self) -> None:
        self._client = self._fleet.client()

    @classmethod
    def launch(cls, cfg: Config, teacher_path: str, *, run_dir: Path, bg: BackgroundLoop,
               store: Any) -> "TeacherEngines":
        """Teacher engines as ``algo.distill`` asks, started (or checked, at ``teacher_addrs``)."""
        d, r = cfg.algo.distill, cfg.rollout
        external = bool(d.teacher_addrs)
        tcfg = dataclasses.replace(
            r, launcher="external" if external else ("local" if r.launcher == "external" else r.launcher),
            external_addrs=list(d.teacher_addrs), num_engines=d.teacher_engines, engine_tp=d.teacher_engine_tp,
            engine_gpu_ids=list(d.teacher_gpu_ids), use_router=False, router_addr=None, base_port=0,
            colocate=False, fp8_weights=False, return_routed_experts=False, concurrency=None)
        node = node_gpus(count=cuda_count(), trainer_on_gpu=cuda_count() is not None)
        fleet = EngineFleet(tcfg, teacher_path, run_dir=str(Path(run_dir) / "teacher"), node=node, role="teacher")
        return cls(fleet, bg, store=store)

    def score(self, groups: list[Group]) -> int:
        """Every trajectory of ``groups`` without teacher log-probs scored and stored (in the store, then
        on the trajectory); returns how many were scored. Blocking (rank 0)."""
        todo: list[Trajectory] = [t for g in groups for t in g.trajectories if t.teacher_logprobs is None]
        if not todo:
            return 0
        with TIMER.phase("teacher"):
            vals = self._bg.submit(gather_or_cancel(
                *(score_response(self._client, t.prompt_ids, t.response_ids) for t in todo))).result()
            self._store.set_teacher_logprobs({t.uid: v for t, v in zip(todo, vals)})
        for t, v in zip(todo, vals):
            t.teacher_logprobs = v
        return len(todo)

    def close(self) -> None:
        client, self._client = self._client, None
        self._bg.close_quietly(client)
        try:
            self._fleet.stop()
        except Exception as e:  # noqa: BLE001
            log.warning("shutdown: the teacher engines did not stop cleanly: %s", e)
