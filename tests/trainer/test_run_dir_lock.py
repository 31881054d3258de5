"""One run per run directory (docs/design.md §5b, ``trainer/run_lock.py``).

A live trainer (an external-producer run waiting for data: no engines to start) holds its run
directory; the same command again is refused in one line naming the holder, and the live run
goes on. Killed with SIGKILL, the holder's lock goes with it: the same command again starts
(past the lock, the start-up checks, the store's rewind: it serves ingestion), holds the lock
itself, and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

import launcher
from megatron_m2po.utils.net import free_port
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
ENV = {**os.environ, "M2PO_STORE_TOKEN": "test-token", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop("M2PO_DEBUG", None)


def _cmd(run: Path, port: int) -> list[str]:
    return ["train", str(EXAMPLE), f"trainer.run_dir={run}",
            "rollout.source=external", "trainer.mode=async", f"store.serve_port={port}", "trainer.num_steps=2",
            "logging.progress=false", "checkpoint.save_every_steps=0", "checkpoint.export_hf_at_end=false"]


def _start(run: Path, port: int, log: Path) -> launcher.Run:
    return launcher.start(_cmd(run, port), log=log, env=ENV, append=False)


def _serving(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        return True
    except OSError:
        return False


def _wait_serving(proc: launcher.Run, port: int, log: Path) -> None:
    wait_until(lambda: _serving(port), what=f"the trainer serving ingestion on port {port}", timeout=240,
               hopeless=lambda: proc.poll() is not None and f"it exited ({proc.returncode}):\n"
               + log.read_text(errors="replace")[-4000:])


@pytest.mark.slow
def test_a_live_run_dir_is_refused_and_a_sigkilled_holder_does_not_block_the_resume(tmp_path):
    run, port = tmp_path / "run", free_port()
    procs = []
    try:
        first = _start(run, port, tmp_path / "first.log")
        procs.append(first)
        _wait_serving(first, port, tmp_path / "first.log")
        # The same command again (on another ingestion port, which would otherwise refuse it):
        # today's failure mode was a second run that took the live one for a crashed one.
        second = launcher.run_captured(_cmd(run, 0), env=ENV, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and "Traceback" not in second.stderr and len(lines) == 1, second.stderr[-4000:]
        assert lines[0].startswith(f"m2po train: trainer.run_dir {run} is in use by a live run (pid {first.pid} "
                                   f"on host {socket.gethostname()}, started "), lines[0]
        assert f"kill {first.pid} on {socket.gethostname()}" in lines[0] and "choose another trainer.run_dir" in lines[0]
        assert first.poll() is None and _serving(port), "the live run did not survive the refused one"

        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        third = _start(run, port, tmp_path / "third.log")
        procs.append(third)
        _wait_serving(third, port, tmp_path / "third.log")
        assert (run / ".lock").read_text().startswith(f"pid={third.pid} host={socket.gethostname()} ")
        # its stop handlers are in once it says it trains (before that a SIGTERM is the default one)
        wait_until(lambda: "SIGINT / SIGTERM: the step finishes" in (tmp_path / "third.log").read_text(errors="replace"),
                   what="the third run training (its stop handlers installed)", timeout=240,
                   hopeless=lambda: third.poll() is not None and f"it exited ({third.returncode})")
        third.send_signal(signal.SIGTERM)  # a stop while it waits for data: nothing to checkpoint, exit 0
        assert third.wait(timeout=120) == 0, (tmp_path / "third.log").read_text(errors="replace")[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill_tree()
