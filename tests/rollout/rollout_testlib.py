"""Helpers of the rollout tests (tiny model, HF reference log-probs)."""

from __future__ import annotations

import torch


def build_tiny_qwen2(path, seed: int = 0) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
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
exec {sys.executable} -m megatron_m2po.rollout.cpu_worker "${{args[@]}}"
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    assert os.access(path, os.X_OK)
    return str(path)
