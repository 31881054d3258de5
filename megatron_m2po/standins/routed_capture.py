"""The CPU worker's routed-experts capture: SGLang 0.5.23's ``--enable-return-routed-experts``.

What it follows from SGLang 0.5.23 (``srt/state_capturer/routed_experts.py``, ``base.py``):

- Capture is a server feature (``server_args.enable_return_routed_experts``,
  ``arg_groups/fields/exec_.py``). Without it ``RoutedExpertsCapturer.create`` returns None and a
  request's ``return_routed_experts=true`` is silently ignored
  (``batch_result_processor.py`` ``_maybe_collect_routed_experts`` returns when there is no
  capturer): the response has no ``meta_info["routed_experts"]``. With it, a model without
  ``num_experts_per_tok`` fails at start-up (the capturer reads it from the HF config).
- Every MoE layer's top-k ids (``layers/moe/topk.py`` ``capture_routed_experts_if_allowed``, the
  *logical* ids before any expert-location mapping) are written per token into a host buffer
  ``[tokens, num_hidden_layers, num_experts_per_tok]`` int32 indexed by the token's KV slot
  (``BaseTopkCapturer.on_forward_end``). Layers that are not MoE are never written (zeros).
- At the end of a request the rows of its KV slots ``[start_len, seqlen - 1)`` are returned
  (``BaseTopkCapturer.get_topk``: ``req_to_token[req][start_len : seqlen - 1]``, ``start_len``
  clamped to ``seqlen - 1``): one row per position of prompt + output but the last (the last
  sampled token is never run through the model). Prompt tokens served from the radix cache keep
  the routing that was captured when their KV was computed: it lives with the KV slot.
- The detokenizer base64-encodes the int32 tensor's bytes (``detokenizer_manager.py``
  ``_b64_encode_per_request``): the client decodes it with ``np.frombuffer(..., np.int32)``
  (``extract_routed_experts_from_meta_info``) and reshapes to ``[-1, layers, top_k]``.
- ``routed_experts_start_len`` must be in ``[0, prompt_tokens]`` (``scheduler.py``
  ``handle_generate_request``: otherwise the request finishes with an abort naming the value).

The top-k is the one the HF model computes (``Qwen3MoeTopKRouter.forward``: softmax in float32,
``torch.topk``), which SGLang's ``TopK`` (``fused_topk`` over the same softmax, ``renormalize``
only rescales the weights) selects too; the ids come back in ``torch.topk`` order (descending
weight).
"""

from __future__ import annotations

import base64
from typing import Optional

import torch


class RoutedExpertsCapture:
    """Forward hooks on every MoE router of an HF causal LM, and SGLang's response encoding."""

    def __init__(self, model: torch.nn.Module, config) -> None:
        text = getattr(config, "text_config", None) or config
        top_k = getattr(text, "num_experts_per_tok", None)
        if top_k is None:
            raise ValueError(f"--enable-return-routed-experts needs an MoE model: {type(model).__name__} has no "
                             "num_experts_per_tok in its config (SGLang's RoutedExpertsCapturer reads it)")
        self.top_k = int(top_k)
        self.num_layers = int(text.num_hidden_layers)
        self._taken: list[Optional[torch.Tensor]] = [None] * self.num_layers
        layers = model.model.layers
        self.moe_layers = []
        for i, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is None or not hasattr(gate, "top_k"):  # a dense layer (mlp_only_layers): never written
                continue
            gate.register_forward_hook(self._hook(i))
            self.moe_layers.append(i)
        if not self.moe_layers:
            raise ValueError(f"--enable-return-routed-experts: {type(model).__name__} has no MoE router")

    def _hook(self, i: int):
        def hook(module, args, out):  # Qwen3MoeTopKRouter -> (logits, weights, indices [tokens, top_k])
            self._taken[i] = out[2].detach().to(torch.int32)
        return hook

    def begin(self) -> None:
        self._taken = [None] * self.num_layers

    def take(self, batch: int, length: int) -> torch.Tensor:
        """The last forward's ids as ``[batch, length, layers, top_k]`` int32 (zeros where no router ran)."""
        out = torch.zeros(batch * length, self.num_layers, self.top_k, dtype=torch.int32)
        for i in self.moe_layers:
            t = self._taken[i]
            if t is None or t.shape[0] != batch * length:
                raise AssertionError(f"layer {i} router saw {None if t is None else t.shape[0]} tokens, "
                                     f"the forward had {batch * length}")
            out[:, i] = t
        return out.view(batch, length, self.num_layers, self.top_k)

    # The prefix cache keeps per-token entries shaped like KV ([heads, tokens, dim]): the routing of a
    # cached token rides along as one more such entry, so it is matched, split and evicted with its KV.
    def cache_entry(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = rows.reshape(1, rows.shape[0], self.num_layers * self.top_k)
        return flat, flat

    def from_cache_entry(self, entry: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        flat = entry[0]
        return flat.reshape(flat.shape[1], self.num_layers, self.top_k)

    @staticmethod
    def check_start(start_len: int, prompt_len: int) -> Optional[str]:
        """scheduler.py handle_generate_request's message for a bad ``routed_experts_start_len``."""
        if start_len < 0:
            return (f"recv_req.routed_experts_start_len={start_len} is lower than 0. "
                    "Please use a non-negative routed_experts_start_len.")
        if start_len > prompt_len:
            return (f"recv_req.routed_experts_start_len={start_len} is higher than the number of input tokens "
                    f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len.")
        return None

    @staticmethod
    def encode(rows: torch.Tensor, seqlen: int, start_len: int) -> str:
        """``get_topk`` then ``_b64_encode_per_request``: rows ``[start_len, seqlen - 1)`` as base64 int32."""
        start = min(start_len, seqlen - 1)
        part = rows[start:seqlen - 1].to(torch.int32).contiguous()
        return base64.b64encode(part.numpy().tobytes()).decode("utf-8")

