"""utils/timing.py: per-step phase totals, the "where the time went" table, the Chrome trace."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from megatron_m2po.standins.dist_testing import run_distributed
from megatron_m2po.utils.timing import ENGINES_PID, TIMER, PhaseTimer, merge_traces
from waiting import wait_until


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
    t.reset(trace=True, pid=0)
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
    t.counters({"engine/running_reqs": 2.0})
    assert t.write_trace(tmp_path) == tmp_path / "trace.json"  # rank 0 of a world of 1: merged alone
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == ["checkpoint", "data_wait", "forward_backward",
                                                "generation", "optimizer"]
    assert {e["pid"] for e in spans} == {0}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "driver" in threads
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counters == [{"name": "engine/running_reqs", "ph": "C", "ts": counters[0]["ts"], "pid": ENGINES_PID,
                         "args": {"value": 2.0}}]
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) == 0  # shifted to start at 0


def test_no_trace_keeps_no_events():
    t = PhaseTimer()
    t.add("push", 1.0)
    assert t.events == [] and t.take_step(0.0)["time/trainer_idle_frac"] == 0.0


def _rank_trace(rank: int, world_size: int, run_dir: str) -> dict | None:
    """One trainer rank: time phases in two threads, write the trace at the end. Rank 1 writes
    only once rank 0 has written its own file, so rank 0 must wait for it to merge."""
    TIMER.reset(trace=True, pid=rank)
    with TIMER.phase("forward_backward"):
        pass
    t = threading.Thread(target=lambda: TIMER.add("generation", 0.25), name="driver")
    t.start()
    t.join()
    TIMER.take_step(1.0)
    if rank == 1:
        wait_until(lambda: (Path(run_dir) / "trace" / "rank0.json").is_file(), what="rank 0's trace file")
    out = TIMER.write_trace(run_dir, world_size=world_size)
    return json.loads(out.read_text()) if rank == 0 else None


def test_trace_merges_every_rank(tmp_path):
    """Under 2 gloo ranks every rank's phases reach <run_dir>/trace.json: rank 0 waits for the
    file of a rank that writes after it and merges both, one process per rank."""
    trace = run_distributed(_rank_trace, world_size=2, args=(str(tmp_path),))[0]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in spans) == [
        (0, "forward_backward"), (0, "generation"), (1, "forward_backward"), (1, "generation")]
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {(0, "rank 0"), (1, "rank 1"), (0, "driver"), (1, "driver")} <= names
    assert min(e["ts"] for e in spans) == 0 and trace["otherData"]["ranks"] == 2
    assert json.loads((tmp_path / "trace.json").read_text()) == trace


def test_trace_names_a_rank_that_never_wrote(tmp_path, caplog):
    t = PhaseTimer()
    t.reset(trace=True, pid=0)
    t.add("push", 0.5)
    with caplog.at_level(logging.WARNING, logger="megatron_m2po.utils.timing"):
        t.write_trace(tmp_path, world_size=2, wait_s=0.2)  # elapsed time is the behaviour under test (the give-up)
    assert "rank(s) [1]" in caplog.text
    assert {e["pid"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]} == {0}
    (tmp_path / "trace" / "rank1.json").write_text(json.dumps({"traceEvents": [
        {"name": "push", "ph": "X", "ts": 0.0, "dur": 1.0, "pid": 1, "tid": 7}]}))
    merged = json.loads(merge_traces(tmp_path).read_text())  # the later merge the warning names
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}


def test_union_counts_concurrent_blocks_once_and_splits_at_a_step(monkeypatch):
    """``TIMER.union``: batches generated together count the time at least one runs (the
    engines are busy), not the sum; a stretch running across a step boundary is split."""
    import megatron_m2po.utils.timing as timing

    clock = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    t = PhaseTimer()
    t.reset()
    a, b = t.union("generation"), t.union("generation")
    a.__enter__()              # t=100: batch a starts
    clock[0] = 101.0
    b.__enter__()              # t=101: batch b starts, a still runs
    clock[0] = 103.0
    a.__exit__(None, None, None)  # t=103: a ends, b still runs
    clock[0] = 104.0
    m = t.take_step(4.0)       # step boundary at t=104 while b runs: 100..104 so far
    assert m["time/generation_s"] == 4.0 and m["time/engine_idle_frac"] == 0.0
    clock[0] = 105.0
    b.__exit__(None, None, None)  # t=105: b ends; 104..105 belongs to the next step
    clock[0] = 106.0
    with t.union("generation"):  # t=106..108: a batch alone
        clock[0] = 108.0
    m = t.take_step(4.0)
    assert m["time/generation_s"] == 3.0 and m["time/engine_idle_frac"] == 0.25
    assert t.totals()[0]["generation"] == 7.0


def test_union_blocks_running_across_a_reset_stay_counted(monkeypatch):
    """The async producer starts its batches before the trainer resets the timer for its first
    step: the blocks running then still end their stretch (counted from the reset)."""
    import megatron_m2po.utils.timing as timing

    clock = [10.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    t = PhaseTimer()
    a = t.union("generation")
    a.__enter__()
    clock[0] = 12.0
    t.reset()                  # the run starts: the batch is running
    clock[0] = 13.0
    a.__exit__(None, None, None)
    with t.union("generation"):  # later batches are timed as ever
        clock[0] = 14.0
    assert t.take_step(4.0)["time/generation_s"] == 2.0
