"""What Megatron-Core logs on every run that says nothing to the user is not logged: its rerun
state machine (unused here) is made explicitly, quietly, in its default mode."""

from __future__ import annotations

import logging


def test_rerun_state_machine_is_made_without_its_two_warnings(monkeypatch, caplog):
    from megatron.core import rerun_state_machine as rsm

    from megatron_m2po.actor.actor import _make_rerun_state_machine

    monkeypatch.setattr(rsm, "_GLOBAL_RERUN_STATE_MACHINE", None)
    with caplog.at_level(logging.DEBUG):
        _make_rerun_state_machine()
        machine = rsm.get_rerun_state_machine()  # what Megatron's schedules call on first use
        _make_rerun_state_machine()  # a second actor in the process: kept, not made again
    assert rsm.get_rerun_state_machine() is machine and machine.get_mode() == rsm.RerunMode.DISABLED
    assert not [r for r in caplog.records if "Rerun" in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert logging.getLogger(rsm.__name__).level == logging.NOTSET  # its logger left as it was
