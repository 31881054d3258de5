"""Helpers of the rollout tests (tiny model, HF reference log-probs, a fake engine)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import torch
from aiohttp import web

from megatron_m2po.utils.net import free_port


def build_tiny_qwen2(path, seed: int = 0, tie: bool = False) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=1, bos_token_id=0, tie_word_embeddings=tie)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(path))
    return str(path)


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """Reference: one unpadded HF forward over prompt+output, log_softmax(logits / T)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, -1)[len(prompt) - 1:-1]
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0]


def sglang_python_standin(directory) -> str:
    """An executable that stands in for SGLang's venv python (``$SGLANG_PYTHON``; SGLang cannot be
    installed here): it logs how it was called, accepts only ``-m sglang.launch_server``, drops the
    GPU-only flags and serves the same model with the CPU worker, so a fleet that starts through it
    proves the engine command went to ``$SGLANG_PYTHON`` and nowhere else."""
    import os
    import stat
    import sys
    from pathlib import Path

    path = Path(directory) / "sglang-python"
    path.write_text(f"""#!/usr/bin/env bash
echo "sglang-python called with: $*"
[ "$1 $2" = "-m sglang.launch_server" ] || {{ echo "not an SGLang launch" >&2; exit 3; }}
shift 2
args=()
while [ $# -gt 0 ]; do
  case "$1" in --tp-size|--mem-fraction-static) shift 2 ;; *) args+=("$1"); shift ;; esac
done
exec {sys.executable} -m megatron_m2po.standins.cpu_worker "${{args[@]}}"
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    assert os.access(path, os.X_OK)
    return str(path)


class ThreadedApp:
    """An aiohttp app served on a free loopback port from a thread of its own (``url``; ``close()``)."""

    def serve(self, app: web.Application) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeEngine(ThreadedApp):
    """An engine's HTTP surface that EngineFleet and sglang-router check (health, model info, server
    info), served from a thread: an engine whose ``/server_info`` the test chooses."""

    def __init__(self, server_info: dict) -> None:
        def answer(body: dict | None):
            async def handler(_request):
                return web.Response(status=200) if body is None else web.json_response(body)
            return handler

        app = web.Application()
        model_info = {"is_generation": True, "weight_version": "0"}
        for route, body in (("/health", None), ("/health_generate", None), ("/model_info", model_info),
                            ("/get_model_info", model_info), ("/server_info", server_info)):
            app.router.add_get(route, answer(body))
        self.serve(app)


@contextlib.contextmanager
def cpu_worker_process(model_dir: str, args: list[str], log_path):
    """A CPU worker (``python -m megatron_m2po.standins.cpu_worker``, this test's Python) serving
    ``model_dir`` with SGLang flags ``args`` on a free port; yields its URL once ``/health``
    answers, terminates it after. Its output goes to ``log_path``."""
    import subprocess
    import sys

    from megatron_m2po.rollout.client import SGLangClient
    from megatron_m2po.utils.net import free_port
    from waiting import wait_until

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_m2po.standins.cpu_worker", "--model-path", model_dir,
                                 "--port", str(port), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: asyncio.run(SGLangClient(url, max_retries=0).health(1.0)), what="the worker healthy",
                       timeout=120, hopeless=lambda: proc.poll() is not None and f"it exited ({log_path})")
            yield url
        finally:
            proc.terminate()
            proc.wait(30)
