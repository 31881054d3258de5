"""``m2po train``: the training loop and what runs it.

* ``cli.py`` starts a run (single process or under torchrun), ``preflight.py`` refuses mistakes
  before anything starts, ``run_lock.py`` keeps one run per run directory.
* ``loop.py``: generate -> score -> store -> train -> push -> checkpoint, in the modes of
  ``schedule.py`` (sync / stale_k / async and their exact staleness); ``colocated.py``: the phases
  when engines and trainer share GPUs.
* ``batching.py`` (stored groups to the actor's batch), ``kl_reward.py``, ``token_dump.py``,
  ``run_report.py`` (what a run says when it ends), ``settings.py`` (``trainer``, ``checkpoint``).
"""
