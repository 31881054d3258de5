"""The trainer's side of the model: Megatron-Core's GPT (built through mbridge) as the policy, its
token log-probs, the registered losses' training steps with the exact global M2 mask, checkpoints,
LoRA, routing replay, the frozen reference and colocated offload.

* ``actor.py``: :class:`~.actor.MegatronActor`, what the training loop calls (log-probs, ``train_step``,
  ``iter_hf_weights``, save / load); ``model.py`` builds the model, ``te_twin.py`` is Transformer
  Engine's layer spec on CPU; ``batch.py`` lays a batch out over ranks and micro-batches.
* ``global_mask.py`` / ``mask_correction.py``: the batch-level M2 mask, exact whatever the layout.
* ``checkpoint.py``, ``lora.py``, ``experts.py`` / ``moe_plan.py`` / ``routing_replay.py``,
  ``reference.py``, ``offload.py``, ``settings.py`` (``model``, ``parallel``, ``optim``).
"""
