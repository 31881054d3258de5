"""utils/timing.py: per-step phase totals, the "where the time went" table, the Chrome trace."""

from __future__ import annotations

import json
import threading

from megatron_m2po.utils.timing import PhaseTimer


def test_steps_table_and_trace(tmp_path):
    t = PhaseTimer()
    t.reset(trace=True, pid=3)
    t.add("data_wait", 1.0)
    t.add("data_wait", 0.5)
    t.add("optimizer", 2.0)
    m = t.take_step(6.0)
    assert m == {"time/data_wait_s": 1.5, "time/optimizer_s": 2.0, "time/wall_s": 6.0,
                 "time/trainer_idle_frac": 0.25}
    with t.phase("forward_backward"):
        pass
    done = threading.Event()

    def driver():
        t.add("generation", 3.0)  # the driver's thread: overlaps, not a trainer phase
        done.set()
    threading.Thread(target=driver, name="driver").start()
    assert done.wait(10), "the driver thread did not record its phase"
    m2 = t.take_step(2.0)
    assert m2["time/generation_s"] == 3.0 and m2["time/trainer_idle_frac"] == 0.0
    assert m2["time/engine_idle_frac"] == 0.0  # generation longer than the step: clamped
    t.add("generation", 1.0)
    assert t.take_step(4.0)["time/engine_idle_frac"] == 0.75
    t.reset(trace=True, pid=3)
    t.add("data_wait", 1.5)
    t.add("optimizer", 2.0)
    t.take_step(6.0)
    with t.phase("forward_backward"):
        pass
    threading.Thread(target=driver, name="driver").start()
    assert done.wait(10)
    t.take_step(2.0)
    assert m2["time/forward_backward_s"] >= 0
    t.add("checkpoint", 1.0)
    t.finish(1.5)  # the final checkpoint, after the last step
    run, wall, steps = t.totals()
    assert steps == 2 and wall == 9.5 and run["checkpoint"] == 1.0 and run["data_wait"] == 1.5
    rows = {line.split()[0]: line.split() for line in t.table().splitlines()[2:]}
    assert rows["data_wait"][1:] == ["1.50", "15.8%", "0.750"]
    fb = run["forward_backward"]
    assert float(rows["other"][1]) == round(9.5 - 1.5 - 2.0 - 1.0 - fb, 2)
    assert rows["generation"][1] == "3.00"  # listed after "other": not part of the trainer's sum
    assert list(rows).index("generation") > list(rows).index("other")
    trace = json.loads(t.write_trace(tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == ["checkpoint", "data_wait", "forward_backward",
                                                "generation", "optimizer"]
    assert {e["pid"] for e in spans} == {3}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "driver" in threads


def test_no_trace_keeps_no_events():
    t = PhaseTimer()
    t.add("push", 1.0)
    assert t.events == [] and t.take_step(0.0)["time/trainer_idle_frac"] == 0.0
