"""The teacher's scoring request and its answer (algo.distill.mode=sglang): the body SGLang 0.5.23 needs to
return the log-probs of the response tokens (prompt + response as ``input_ids``, ``max_new_tokens`` 0,
``logprob_start_len`` at the prompt's last token), the answer's first (null) value dropped, an empty
response sent nowhere, and an answer of the wrong length refused with what was expected. The values
themselves are held to an HF forward of the teacher end to end in tests/trainer/test_distill_sglang.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from megatron_m2po.rollout.client import EngineError, GenerateOutput, generate_payload
from megatron_m2po.rollout_service.teacher import score_response


class _Engine:
    """A client whose ``generate`` builds SGLang's body and answers with ``meta_info.input_token_logprobs``
    as 0.5.23 does: ``[[logprob | null, id, null], ...]`` from ``logprob_start_len``, the first null."""

    base_url = "http://teacher:1"

    def __init__(self, drop: int = 0):
        self.bodies: list[dict] = []
        self.drop = drop

    async def generate(self, input_ids, sampling_params, return_logprob=True, *, logprob_start_len=-1, **kw):
        body = generate_payload(input_ids, sampling_params, return_logprob, rid=None, return_routed_experts=False,
                                routed_experts_start_len=0, logprob_start_len=logprob_start_len)
        self.bodies.append(body)
        start = body["logprob_start_len"]
        rows = [[None, input_ids[start], None]] + [[-0.1 * i, t, None] for i, t in enumerate(input_ids[start + 1:], 1)]
        return GenerateOutput.from_json({"output_ids": [], "meta_info": {
            "input_token_logprobs": rows[:len(rows) - self.drop], "output_token_logprobs": [], "finish_reason": {
                "type": "length", "length": 0}, "weight_version": "default", "id": body["rid"]}})


def test_the_request_scores_exactly_the_response_tokens():
    eng = _Engine()
    out = asyncio.run(score_response(eng, [5, 6, 7], [8, 9]))
    assert out.dtype == np.float32 and out.tolist() == pytest.approx([-0.1, -0.2])
    (body,) = eng.bodies
    assert body["input_ids"] == [5, 6, 7, 8, 9] and body["logprob_start_len"] == 2 and body["return_logprob"]
    assert body["sampling_params"]["max_new_tokens"] == 0
    assert asyncio.run(score_response(eng, [5, 6, 7], [])).size == 0 and len(eng.bodies) == 1


def test_an_answer_of_the_wrong_length_is_refused_with_what_was_expected():
    with pytest.raises(EngineError, match=r"returned 2 values .* for a 3-token prompt and 2-token response scored "
                                          r"from position 2; expected 3"):
        asyncio.run(score_response(_Engine(drop=1), [5, 6, 7], [8, 9]))


def test_teacher_servers_started_elsewhere_need_no_weight_version_and_errors_name_the_setting(tmp_path):
    """algo.distill.teacher_addrs: a plain SGLang server (its weights tagged "default": no
    --weight-version, which rollout engines need) is accepted as a teacher; an address that does not
    answer is refused naming algo.distill.teacher_addrs, not the rollout's setting."""
    from aiohttp import web

    from megatron_m2po.config import load_config
    from megatron_m2po.rollout.engines import FleetSetupError
    from megatron_m2po.rollout_service.teacher import TeacherEngines
    from megatron_m2po.utils.background_loop import BackgroundLoop
    from rollout_testlib import ThreadedApp
    from sglang_source import SUPPORTED_SGLANG

    async def health(_request):
        return web.Response(status=200)

    async def model_info(_request):
        return web.json_response({"is_generation": True, "weight_version": "default"})

    async def server_info(_request):
        return web.json_response({"version": SUPPORTED_SGLANG})

    class Teacher(ThreadedApp):
        def __init__(self):
            app = web.Application()
            for route, handler in (("/health", health), ("/model_info", model_info), ("/server_info", server_info)):
                app.router.add_get(route, handler)
            self.serve(app)

    t = Teacher()
    bg = BackgroundLoop("test-teacher")
    try:
        cfg = load_config(None, ["algo.distill.teacher=/t", "algo.distill.coef=1", "algo.distill.mode=sglang",
                                 f"algo.distill.teacher_addrs=[{t.url}]", f"trainer.run_dir={tmp_path}"])
        engines = TeacherEngines.launch(cfg, "/t", run_dir=tmp_path, bg=bg, store=None)
        engines.close()
        cfg.algo.distill.teacher_addrs = ["http://127.0.0.1:1"]
        with pytest.raises(FleetSetupError, match=r"\(algo\.distill\.teacher_addrs\) failed validation"):
            TeacherEngines.launch(cfg, "/t", run_dir=tmp_path, bg=bg, store=None)
    finally:
        bg.close()
        t.close()
