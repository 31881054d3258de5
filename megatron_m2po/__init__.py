"""megatron_m2po: off-policy RL post-training on Megatron-Core with M2PO.

Packages, from the trainer down: ``trainer`` (the loop, ``m2po train``), ``actor`` (Megatron-Core
policy, log-probs, losses with the global M2 mask), ``algo`` (the pure math), ``parallel``,
``rollout`` / ``rollout_service`` (SGLang engines, the router, producers), ``store`` (the
staleness-tagged rollout store), ``weights`` (pushes to the engines), ``rewards``, ``data``,
``plan`` (``m2po plan``), ``experiment`` (``m2po experiment``), ``standins`` (the CPU build's
stand-ins), ``utils``.
"""

__version__ = "0.1.0"
