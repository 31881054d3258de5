"""Each mechanism of ``megatron_m2po.utils.lifeline`` ends its child when the parent is killed
with SIGKILL, and a child started on a short-lived thread outlives that thread (the parent-death
signal follows the thread that forked: tests/utils/lifeline_parent.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leftovers import Tree

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.timeout(120)


def test_every_child_dies_with_its_parent_and_none_with_a_thread():
    tree = Tree(os.environ)
    proc = subprocess.Popen([sys.executable, str(HERE / "lifeline_parent.py")], env=tree.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the parent prints once every child is up (or exits: EOF)
        assert line, f"the parent exited ({proc.wait()}):\n{proc.stderr.read()[-3000:]}"
        pids = json.loads(line)
        kids = tree.observe(proc.pid)
        assert set(pids.values()) <= set(kids), (pids, kids)
        proc.kill()
        proc.wait()
        tree.wait_gone(f"the parent of {pids} was killed with SIGKILL", timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tree.kill()
