"""Builders of synthetic groups shared by the store tests."""

from __future__ import annotations

import zlib

import numpy as np

from megatron_m2po.store.types import Group, Trajectory


def make_group(gid: str, version: int = 0, n: int = 2, resp_len: int = 5, seed: int = 0, *,
               reward: float | None = 1.0, versions=None) -> Group:
    rng = np.random.default_rng([zlib.crc32(gid.encode()), seed])
    trajs = []
    for i in range(n):
        r = resp_len + i
        v = np.full(r, version, np.int64) if versions is None else np.asarray(versions[i], np.int64)
        trajs.append(Trajectory(
            uid=f"{gid}/{i}", group_id=gid, prompt_ids=rng.integers(0, 1000, 3 + i),
            response_ids=rng.integers(0, 1000, r), behav_logprobs=-rng.random(r).astype(np.float32),
            versions=v, reward=reward if reward is None else float(reward) + i,
            loss_mask=(rng.random(r) > 0.2).astype(np.uint8), finish_reason="stop", metadata={"i": i, "gid": gid}))
    return Group(gid, trajs)


def same_group(a: Group, b: Group) -> bool:
    if a.group_id != b.group_id or len(a.trajectories) != len(b.trajectories):
        return False
    for x, y in zip(a.trajectories, b.trajectories):
        for f in ("prompt_ids", "response_ids", "behav_logprobs", "versions", "loss_mask"):
            if not np.array_equal(getattr(x, f), getattr(y, f)):
                return False
        if (x.uid, x.reward, x.finish_reason, x.metadata) != (y.uid, y.reward, y.finish_reason, y.metadata):
            return False
    return True


def start_server(path: str, *, token: str | None = "s3cret", extra: tuple = (), env_extra: dict | None = None,
                 port: int = 0):
    """`m2po store serve` in a subprocess; returns (process, url). Caller terminates it."""
    import os
    import re
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("M2PO_STORE_TOKEN", None)
    if token is not None:
        env["M2PO_STORE_TOKEN"] = token
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-m", "megatron_m2po.cli", "store", "serve", "--path", path,
                             "--port", str(port), *extra], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120  # generous: a loaded CI machine imports and fsyncs slowly
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"on (http://\S+)", line)
        if m:
            proc.startup_output = "".join(lines)
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("store server did not start:\n" + "".join(lines) + (proc.stdout.read() or ""))


def stop(proc) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except Exception:
            proc.kill()
            proc.wait()


def crash_group(gid: str) -> Group:
    """A group whose content follows from its id alone (so a checker can regenerate it)."""
    n_tok = 200 + zlib.crc32(gid.encode()) % 1500
    return make_group(gid, version=zlib.crc32(gid.encode()) % 3, n=4, resp_len=n_tok)


def check_store_integrity(path: str) -> dict:
    """Every stored group is complete and byte-identical to ``crash_group(id)``; returns {id: state}."""
    import sqlite3

    from megatron_m2po.store import sqlite as db

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT seq, group_id, n_traj, state FROM groups").fetchall()
        for seq, gid, n_traj, _ in rows:
            (n,) = conn.execute("SELECT COUNT(*) FROM trajectories WHERE group_seq=?", (seq,)).fetchone()
            assert n == n_traj, f"partial group {gid}: {n} of {n_traj} trajectories"
            (g,) = db.load_groups(conn, [seq])
            assert same_group(g, crash_group(gid)), f"group {gid} differs from what was sent"
        (orphans,) = conn.execute("SELECT COUNT(*) FROM trajectories WHERE group_seq NOT IN "
                                  "(SELECT seq FROM groups)").fetchone()
        assert orphans == 0, f"{orphans} trajectories without a group"
        return {gid: state for _, gid, _, state in rows}
    finally:
        conn.close()
