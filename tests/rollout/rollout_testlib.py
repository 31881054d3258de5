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
