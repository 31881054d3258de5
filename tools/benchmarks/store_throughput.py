"""Rollout store throughput against a plain file with the same bytes.

Builds one 32B-scale training batch (default 2048 trajectories x 8192 tokens: 256 prompt groups
of 8, ~1/16 of each trajectory prompt, the rest response) and measures:

* ingest: ``RolloutStore.put_groups`` (SQLite WAL, synchronous=FULL, ``--groups-per-put``
  groups per transaction) and, with ``--http``, the same through ``m2po store serve`` with the
  binary encoding — versus appending the same array bytes to a plain file with one fsync per
  the same number of groups;
* serve: ``lease`` + ``ack`` of the whole batch (decoding into numpy records) — versus reading the
  plain file back and slicing it into arrays.

Prints tokens/s, MB/s and the store/plain ratios. ``--scale`` shrinks the trajectory count
(the per-trajectory size stays 32B-scale) when memory or time is short.

    python tools/benchmarks/store_throughput.py [--trajectories 2048 --tokens 8192 --scale 1.0]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from megatron_m2po.store import Group, RolloutStore, Trajectory, fifo


def build(n_traj: int, n_tok: int, group_size: int, seed: int = 0) -> list[Group]:
    rng = np.random.default_rng(seed)
    p = max(1, n_tok // 16)
    r = n_tok - p
    groups = []
    for gi in range(n_traj // group_size):
        prompt = rng.integers(0, 150_000, p, dtype=np.int32)
        trajs = []
        for j in range(group_size):
            v = np.zeros(r, np.int64)
            v[r // 2:] = 1  # a partial rollout spanning one weight update: two version runs
            trajs.append(Trajectory(uid=f"g{gi}/{j}", group_id=f"g{gi}", prompt_ids=prompt,
                                    response_ids=rng.integers(0, 150_000, r, dtype=np.int32),
                                    behav_logprobs=-rng.random(r, dtype=np.float32), versions=v,
                                    reward=float(j % 2), metadata={"prompt_index": gi}))
        groups.append(Group(f"g{gi}", trajs))
    return groups


def array_bytes(g: Group) -> list[bytes]:
    out = []
    for t in g.trajectories:
        out += [t.prompt_ids.tobytes(), t.response_ids.tobytes(), t.behav_logprobs.tobytes(),
                np.array([[0, t.response_ids.size // 2], [1, t.response_ids.size - t.response_ids.size // 2]],
                         "<i8").tobytes()]
    return out


def plain_write(path: str, groups: list[Group], per_put: int) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(0, len(groups), per_put):
            for g in groups[i:i + per_put]:
                for b in array_bytes(g):
                    f.write(b)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def plain_read(path: str, groups: list[Group]) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        buf = f.read()
    off = 0
    for g in groups:  # slice into arrays the way a reader of a flat file would
        for t in g.trajectories:
            for n, dt in ((t.prompt_ids.size, "<i4"), (t.response_ids.size, "<i4"), (t.response_ids.size, "<f4"),
                          (4, "<i8")):
                np.frombuffer(buf, dt, n, off).copy()
                off += n * np.dtype(dt).itemsize
    return time.perf_counter() - t0


def store_ingest(path: str, groups: list[Group], per_put: int) -> float:
    s = RolloutStore(path)
    t0 = time.perf_counter()
    for i in range(0, len(groups), per_put):
        s.put_groups(groups[i:i + per_put])
    dt = time.perf_counter() - t0
    s.close()
    return dt


def store_serve(path: str, n_groups: int, per_lease: int) -> float:
    s = RolloutStore(path)
    t0 = time.perf_counter()
    for step in range(0, n_groups, per_lease):
        s.ack(s.lease(fifo(), n_groups=min(per_lease, n_groups - step), step=step))
    dt = time.perf_counter() - t0
    s.close()
    return dt


def http_ingest(path: str, groups: list[Group], per_put: int) -> float:
    from megatron_m2po.store.client import StoreClient

    env = {**os.environ, "M2PO_STORE_TOKEN": "bench", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_m2po.cli", "store", "serve", "--path", path, "--port", "0",
                             "--max-request-mb", "4096"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("server did not start")
            m = re.search(r"on (http://\S+)", line)
            url = m.group(1) if m else None
        c = StoreClient(url, token="bench", encoding="binary")
        c.set_version(max(g.max_version for g in groups))  # versions ahead of the trainer's are refused
        t0 = time.perf_counter()
        for i in range(0, len(groups), per_put):
            c.put_groups(groups[i:i + per_put])
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trajectories", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192, help="Tokens per trajectory (prompt + response).")
    ap.add_argument("--scale", type=float, default=1.0, help="Multiply the trajectory count (memory/time).")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-put", type=int, default=16, help="Groups per put / HTTP request / fsync.")
    ap.add_argument("--groups-per-lease", type=int, default=64)
    ap.add_argument("--http", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dir", default=None, help="Scratch directory (default: a temp dir, removed after).")
    a = ap.parse_args()

    n_traj = max(a.group_size, int(a.trajectories * a.scale) // a.group_size * a.group_size)
    groups = build(n_traj, a.tokens, a.group_size)
    tokens = sum(t.num_tokens for g in groups for t in g.trajectories)
    nbytes = sum(len(b) for g in groups for b in array_bytes(g))
    d = tempfile.mkdtemp(dir=a.dir)
    try:
        rows = []
        t = plain_write(os.path.join(d, "plain.bin"), groups, a.groups_per_put)
        rows.append(("ingest", "plain file + fsync", t))
        t = store_ingest(os.path.join(d, "store.sqlite"), groups, a.groups_per_put)
        rows.append(("ingest", "RolloutStore.put_groups", t))
        if a.http:
            t = http_ingest(os.path.join(d, "http.sqlite"), groups, a.groups_per_put)
            rows.append(("ingest", "HTTP binary -> store", t))
        t = plain_read(os.path.join(d, "plain.bin"), groups)
        rows.append(("serve", "plain file read", t))
        t = store_serve(os.path.join(d, "store.sqlite"), len(groups), a.groups_per_lease)
        rows.append(("serve", "lease + ack", t))
        db_mb = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("store.sqlite")) / 2**20
    finally:
        shutil.rmtree(d, ignore_errors=True)

    print(f"batch: {n_traj} trajectories x {a.tokens} tokens ({len(groups)} groups of {a.group_size}), "
          f"{tokens / 1e6:.1f} M tokens, {nbytes / 2**20:.0f} MiB of arrays; store file {db_mb:.0f} MiB; "
          f"{a.groups_per_put} groups per put/fsync, {a.groups_per_lease} per lease"
          + ("" if a.scale == 1.0 else f"  [scaled x{a.scale}]"))
    base = {k: s for k, name, s in rows if name.startswith("plain")}
    print(f"{'phase':<8}{'path':<26}{'seconds':>9}{'M tok/s':>10}{'MB/s':>9}{'vs plain':>10}")
    for phase, name, s in rows:
        print(f"{phase:<8}{name:<26}{s:>9.2f}{tokens / s / 1e6:>10.1f}{nbytes / s / 1e6:>9.0f}"
              f"{base[phase] / s:>10.2f}")


if __name__ == "__main__":
    main()
