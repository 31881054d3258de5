"""Rank 0's rollout side, behind one service object (:class:`~.service.RolloutService`).

* ``service.py``: the service the training loop calls (its module docstring draws rank 0's loops
  and queues) and how its parts are built and shut down;
* ``engine_control.py``: the engines' one owner (fleet, client, served version, adapters) and every
  verb that acts on them (held for a push, refit, restarted, checked, released / resumed in colocated mode);
* ``groups.py``: the sampler of groups (prompts in, groups with deterministic ids out, ``rollout.filter``);
* ``scheduled.py``: scheduled generation (the steps of sync / stale_k, at their versions);
* ``continuous.py``: continuous generation (async mode, bounded by the store's staleness);
* ``leaser.py``: a step's groups leased from the store, and their acks;
* ``evaluation.py``: evaluation in one home: held-out accuracy with the engines' weights during training,
  and ``m2po eval`` (pass@1 as avg@k over benchmark files);
* ``waiting.py``: the bounded, interruptible waits all of them use.

Layering (``tests/test_import_graph.py``): above ``rollout/``, ``store/`` and ``weights/``, below
``trainer/``, which it never imports.
"""
