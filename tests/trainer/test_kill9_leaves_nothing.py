"""Nothing outlives a trainer killed with SIGKILL (docs/design.md §5, "Nothing outlives the trainer").

A tiny run is started as the README starts it, and killed with ``kill -9`` once it is mid-run
with every kind of process the trainer starts alive: its CPU engine, sglang-router and a reward
worker (Megatron's checkpoint writer starts no process of its own between saves: its results queue
is an in-process queue, ``actor/checkpoint.py`` ``_own_writer_results_queue``, and the test asserts
that no such manager and no resource tracker appear). Then the whole tree must be gone within seconds: each child
dies by its own mechanism (``utils/lifeline.py``), none waits for someone to clean up after it.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import launcher
from leftovers import Tree
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A run far longer than the test (killed mid-run), a checkpoint after every step.
OVERRIDES = ["trainer.num_steps=1000", "trainer.prompts_per_step=4", "trainer.prompts_per_update=2",
             "rollout.num_engines=1", "rollout.n_samples_per_prompt=4", "logging.progress=false",
             "checkpoint.export_hf_at_end=false", "checkpoint.save_every_steps=1", "trainer.eval_every_steps=0"]

# Each kind of process the trainer starts here, by a piece of its command line.
KINDS = {"CPU engine": "megatron_m2po.standins.cpu_worker", "sglang-router": "sglang::router",
         "reward worker": "rewards.pool import _worker_entry"}
# Processes a trainer used to start and must not any more: a spawned manager for Megatron's writer
# results (~4 s of CPU and ~330 MB a rank) and the resource tracker it brought.
ABSENT = {"Megatron's checkpoint-writer results queue (spawn manager)": "multiprocessing.spawn import spawn_main",
          "multiprocessing's resource tracker": "multiprocessing.resource_tracker"}


def _steps_logged(run: Path) -> int:
    path, n = run / "metrics.jsonl", 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                n += "train/step" in json.loads(line)
            except ValueError:
                continue  # a line being written
    return n


def test_sigkill_of_the_trainer_leaves_no_process(tmp_path):
    run = tmp_path / "run"
    tree = Tree({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    log = tmp_path / "train.log"
    # Through the test launcher (a fork of a preloaded server, tests/launcher.py): SIGKILL of the
    # command's pid must end its tree exactly as for a plain process, which this test proves.
    proc = launcher.start(["train", str(EXAMPLE), f"trainer.run_dir={run}", *OVERRIDES], log=log, env=tree.env)
    try:
        ever: set[str] = set()  # every command line seen in the tree while waiting

        def missing() -> list[str]:
            procs = tree.observe(proc.pid).values()
            ever.update(procs)
            return [kind for kind, part in KINDS.items() if not any(part in c for c in procs)]

        def mid_run() -> bool:
            return (run / "checkpoints" / "latest").is_file() and _steps_logged(run) >= 1 and not missing()

        wait_until(mid_run, what="a step logged, a checkpoint written and every kind of child alive", timeout=240,
                   hopeless=lambda: proc.poll() is not None and
                   f"the trainer exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        started = [kind for kind, part in ABSENT.items() if any(part in c for c in ever)]
        assert not started, f"the trainer started {started} (actor/checkpoint.py _own_writer_results_queue)"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tree.wait_gone("the trainer was killed with SIGKILL mid-run", timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        tree.kill()
