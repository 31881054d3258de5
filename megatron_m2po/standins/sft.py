"""The supervised step the tiny bases are trained with (``tiny_base`` and ``tiny_tools``)."""

from __future__ import annotations

from typing import Any


def sft_step(model: Any, opt: Any, ids: Any, attn: Any, lmask: Any) -> Any:
    """One supervised step on the tokens ``lmask`` marks (mean next-token NLL, gradient clipped at
    1.0); returns the loss."""
    import torch

    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="none")
    m = lmask[:, 1:].reshape(-1)
    loss = (nll * m).sum() / m.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss
