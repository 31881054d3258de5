"""megatron_m2po: off-policy RL post-training on Megatron-Core with M2PO."""

__version__ = "0.1.0"
