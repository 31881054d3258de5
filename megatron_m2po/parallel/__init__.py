"""Distributed building blocks below the actor: the process groups read from Megatron-Core
(``groups.py``), vocab-parallel log-probs and entropy without ``[T, V]`` logits (``logprobs.py``),
exact distributed order statistics for the global mask (``selection.py``), rank 0's results on
every rank (``rank0.py``), the trainer-to-engine weight-sync groups (``side_group.py``) and the
device a collective needs (``devices.py``).
"""
