"""tools/plot_trace.py: a trace written by utils/timing.py drawn as lanes per rank and thread."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from megatron_m2po.utils.timing import PhaseTimer

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plot_trace", ROOT / "tools" / "plot_trace.py")
plot_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_mod)


def _two_rank_trace(run_dir: Path) -> None:
    """Rank 1 then rank 0 (which merges), as the trainer writes them; rank 0's driver thread
    has a reward inside a generation."""
    for rank in (1, 0):
        t = PhaseTimer()
        t.reset(trace=True, pid=rank)
        t.add("forward_backward", 0.5)
        if rank == 0:
            def driver():
                g0 = time.perf_counter()
                t.add("generation", 1.0, start=g0)
                t.add("reward", 0.2, start=g0 + 0.1)  # inside the generation
            th = threading.Thread(target=driver, name="m2po-rollout")
            th.start()
            th.join()
            t.counters({"engine/running_reqs": 8.0, "engine/queued_reqs": 0.0})
        t.write_trace(run_dir, world_size=2, wait_s=5)


def test_lanes_per_rank_and_thread_and_a_png(tmp_path):
    _two_rank_trace(tmp_path)
    out = tmp_path / "trace.png"
    lanes = plot_mod.plot_trace(tmp_path, out)
    assert lanes == ["rank 0 / MainThread", "rank 0 / m2po-rollout", "rank 1 / MainThread"]
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
    spans = [e for e in plot_mod._load(tmp_path)["traceEvents"] if e["ph"] == "X"]
    depth = {e["name"]: d for e, d in plot_mod._depths(spans) if e["pid"] == 0}
    assert depth == {"forward_backward": 0, "generation": 0, "reward": 1}


def test_cli_writes_next_to_the_run_by_default(tmp_path, monkeypatch, capsys):
    """Without --out the PNG goes into the run directory, not the working directory."""
    run, elsewhere = tmp_path / "run", tmp_path / "cwd"
    elsewhere.mkdir()
    _two_rank_trace(run)
    monkeypatch.chdir(elsewhere)
    assert plot_mod.main([str(run)]) == 0
    assert (run / "trace.png").is_file() and not list(elsewhere.iterdir())
    assert capsys.readouterr().out.strip() == str(run / "trace.png")
    (run / "trace.png").unlink()
    assert plot_mod.main([str(run / "trace.json")]) == 0  # the file itself: its directory
    assert (run / "trace.png").is_file()


def test_cli_says_what_is_missing(tmp_path, capsys):
    assert plot_mod.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "logging.trace=true" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no phase spans"):
        (tmp_path / "trace.json").write_text('{"traceEvents": []}')
        plot_mod.plot_trace(tmp_path, tmp_path / "x.png")
