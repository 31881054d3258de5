"""External ingestion, in one package: trajectories that producers outside the trainer push into the
rollout store (agent harnesses, slime-style rollout functions, other languages over HTTP).

* :mod:`.producer`: the protocol (version, weights, generate, push) and its Python side:
  :class:`~.producer.ExternalProducer`, :func:`~.producer.make_group`, the slime adapter;
* :mod:`.server`: the authenticated HTTP service (``m2po store serve``; routes, limits, roles);
* :mod:`.endpoint`: the same service run inside the trainer (``rollout.source=external``).

Layering (``tests/test_import_graph.py``): above ``store/`` (whose records and client it uses) and
``rollout/`` (the group filter); below ``rollout_service/`` and ``trainer/``, which start the endpoint.
"""
