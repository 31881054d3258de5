"""Every ``m2po store`` command that opens a database says in ONE line what is wrong with the file.

Run through the real CLI in a subprocess: a missing, read-only, truncated, garbage, foreign
(another program's SQLite database) or directory path gives exit status != 0, no traceback, and
one line that names the file and what to do. Read-only files are what ``stats`` and ``backup``
are for: they work on them (the directory read-only too, as on an archive), and say what to do
when a pending write-ahead log makes that impossible.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from megatron_m2po.store import RolloutStore
from store_testlib import make_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# root ignores file modes; without these capabilities it is held to them like any user
_DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def cli(*args, as_user=False):
    cmd = [sys.executable, "-m", "megatron_m2po.cli", "store", *args]
    if as_user and os.geteuid() == 0:
        cmd = _DROP_DAC + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "M2PO_STORE_TOKEN": "t", "M2PO_STORE_TRAINER_TOKEN": "u"})


def one_line(r, *needles):
    out = (r.stdout + r.stderr).strip()
    assert r.returncode != 0, out
    assert "Traceback" not in out, out
    lines = out.splitlines()
    assert len(lines) == 1, out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


_n = iter(range(10**6))


def run(cmd, path, tmp_path, as_user=False):
    extra = {"serve": ("--port", "0"), "stats": (),
             "backup": ("--out", str(tmp_path / f"out-{next(_n)}.sqlite"))}[cmd]
    return cli(cmd, "--path", str(path), *extra, as_user=as_user)


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.sqlite"
    s = RolloutStore(str(p))
    s.put_groups([make_group("g", 0)])
    s.close()
    return p


def _can_drop_privileges() -> bool:
    if os.geteuid() != 0:
        return True
    if shutil.which("setpriv") is None:
        return False
    return subprocess.run(_DROP_DAC + ["true"], capture_output=True).returncode == 0


CMDS = ("serve", "stats", "backup")


def test_missing(tmp_path):
    for cmd in ("stats", "backup"):
        one_line(run(cmd, tmp_path / "nope.sqlite", tmp_path), str(tmp_path / "nope.sqlite"), "no such file",
                 "check --path")
    # serve creates a missing store, and says so (tests/store/test_store_server.py starts it that way)


def test_directory(tmp_path):
    for cmd in CMDS:
        one_line(run(cmd, tmp_path, tmp_path), str(tmp_path), "is a directory", "check --path")


@pytest.mark.parametrize("kind", ["garbage", "truncated-header", "truncated-pages"])
def test_truncated_or_garbage(tmp_path, good, kind):
    raw = good.read_bytes()
    bad = tmp_path / f"{kind}.sqlite"
    bad.write_bytes({"garbage": b"PK\x03\x04 a zip, not a database" * 40, "truncated-header": raw[:10],
                     "truncated-pages": raw[:5000]}[kind])
    before = bad.read_bytes()
    for cmd in CMDS:
        one_line(run(cmd, bad, tmp_path), str(bad), "restore it from a 'm2po store backup' copy")
    assert bad.read_bytes() == before  # nothing was written into it


def test_foreign_sqlite_database_is_named_and_left_alone(tmp_path):
    other = tmp_path / "app.db"
    c = sqlite3.connect(str(other))
    c.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    c.execute("INSERT INTO users VALUES (1, 'x')")
    c.commit()
    c.close()
    before = hashlib.sha256(other.read_bytes()).hexdigest()
    for cmd in CMDS:
        one_line(run(cmd, other, tmp_path), str(other), "not a rollout store")
    assert hashlib.sha256(other.read_bytes()).hexdigest() == before
    assert sorted(os.listdir(tmp_path)) == ["app.db"]  # no WAL, no backup left behind


def test_read_only(tmp_path, good):
    if not _can_drop_privileges():
        pytest.skip("running as root without setpriv: file modes cannot be enforced")
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copy(good, ro / "s.sqlite")
    os.chmod(ro / "s.sqlite", 0o444)
    os.chmod(ro, 0o555)
    try:
        one_line(run("serve", ro / "s.sqlite", tmp_path, as_user=True), str(ro / "s.sqlite"), "read-only",
                 "writable copy")
        # stats and backup read it (a read-only directory: opened immutable, no -shm needed)
        r = cli("stats", "--path", str(ro / "s.sqlite"), "--json", as_user=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["groups"]["available"]["groups"] == 1
        r = run("backup", ro / "s.sqlite", tmp_path, as_user=True)
        assert r.returncode == 0 and "integrity ok" in r.stdout, r.stdout + r.stderr
        # the backup's destination must be writable
        one_line(cli("backup", "--path", str(ro / "s.sqlite"), "--out", str(ro / "b.sqlite"), as_user=True),
                 str(ro / "b.sqlite"), "read-only", "choose another --out")
    finally:
        os.chmod(ro, 0o755)
    # a write-ahead log still pending (a server's un-checkpointed commits): it cannot be read
    # consistently without write access next to it; the line says what to do
    live = tmp_path / "live.sqlite"
    s = RolloutStore(str(live))
    s.put_groups([make_group("w", 0)])
    ro2 = tmp_path / "ro2"
    ro2.mkdir()
    shutil.copy(live, ro2 / "s.sqlite")
    shutil.copy(str(live) + "-wal", ro2 / "s.sqlite-wal")
    s.close()
    assert os.path.getsize(ro2 / "s.sqlite-wal") > 0
    os.chmod(ro2, 0o555)
    try:
        for cmd in ("stats", "backup"):
            one_line(run(cmd, ro2 / "s.sqlite", tmp_path, as_user=True), str(ro2 / "s.sqlite"),
                     "pending write-ahead log", "the user that runs the server")
    finally:
        os.chmod(ro2, 0o755)


def test_newer_schema(tmp_path, good):
    c = sqlite3.connect(str(good))
    c.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    c.commit()
    c.close()
    for cmd in CMDS:
        one_line(run(cmd, good, tmp_path), str(good), "schema version 99", "matching megatron_m2po version")
