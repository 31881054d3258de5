"""One run per run directory: global rank 0 holds a lock on ``<run_dir>/.lock`` while it runs.

Two trainers on one run directory would share one store and one checkpoint set: the second
takes the live run for a crashed one, rewinds its leases and takes the store over, and the
first dies. So global rank 0 locks the run directory before it reads or writes anything in it
(the store, checkpoints, weights), and writes its pid, host and start time into the lock file;
a second run is refused in one line naming them. Other ranks take no lock: rank 0 speaks for
the run, on whatever node it is.

What is used, and why: a POSIX record lock on the whole file (``fcntl.lockf``: ``fcntl(F_SETLK)``).

* The kernel releases it when the holder dies, by any signal (SIGKILL included): the lock of a
  dead run never blocks its resume, and there is no stale file to clean up (the file stays; its
  lock does not).
* It belongs to the process: a child never holds it. Megatron-Core's checkpoint writers are
  forked (``megatron/core/dist_checkpointing/strategies/filesystem_async.py``
  ``write_preloaded_data_multiproc``); an ``flock`` lock would be shared with them, and one that
  outlives a killed trainer would block the resume. The descriptor is close-on-exec as well.
* Its one trap: a process loses all its POSIX locks on a file when it closes *any* descriptor of
  that file. Nothing in the trainer opens ``.lock`` but this module.

Filesystems: local ones; NFS (v3 through the lock manager, v4 natively), where the lock holds
across nodes and a node that dies holding it keeps it until the server's lease expires (90 s by
default on Linux servers); Lustre only when mounted with ``-o flock`` (``-o localflock`` locks per
node only; with neither the call fails); GPFS. Where the filesystem refuses locks, the run goes on
unlocked with a warning that says so.

    lock = claim_run_dir("runs/x", check=lambda: check_start(cfg))   # refused: RunDirBusy
    ...
    lock.release()
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import Callable, Optional

from megatron_m2po.utils.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# The filesystem cannot lock (Lustre without -o flock, some FUSE filesystems): run unlocked.
_NO_LOCKING = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class RunDirBusy(UserError):
    """Another live run holds the run directory's lock."""


class RunDirLock:
    """The lock on ``<run_dir>/.lock`` held by this process (``fd`` is None when the filesystem
    refused locking); :meth:`release` (or this process's death) frees it."""

    def __init__(self, run_dir: Path, fd: Optional[int]):
        self.run_dir, self.fd = run_dir, fd

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_NAME

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> "RunDirLock":
        """Lock the existing directory ``run_dir`` without waiting; :class:`RunDirBusy` names the
        live holder. ``OSError`` when the lock file cannot be created."""
        run_dir = Path(run_dir)
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise RunDirBusy(_busy_message(run_dir, holder)) from None
            if e.errno in _NO_LOCKING:
                log.warning("cannot lock %s on this filesystem (%s): a second run on this run directory will "
                            "not be refused (docs/design.md §5b)", run_dir / LOCK_NAME, e.strerror)
                return cls(run_dir, None)
            raise
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()} started={started}\n".encode(), 0)
        return cls(run_dir, fd)

    def release(self) -> None:
        """Free the lock (idempotent); the file stays, as a later run opens it again."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def _read_holder(fd: int) -> dict[str, str]:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)


def _busy_message(run_dir: Path, holder: dict[str, str]) -> str:
    pid, host = holder.get("pid"), holder.get("host")
    if pid and host:
        who = f"pid {pid} on host {host}" + (f", started {holder['started']}" if "started" in holder else "")
        stop = f"stop it (kill {pid} on {host}: it checkpoints and exits)"
    else:  # locked a moment ago, not yet written
        who, stop = "a process that has not written its pid yet", "stop it"
    return (f"trainer.run_dir {run_dir} is in use by a live run ({who}): wait for it to finish, {stop} and run "
            "the same command again to resume, or choose another trainer.run_dir")


def claim_run_dir(run_dir: str | os.PathLike, check: Callable[[], None] = lambda: None) -> RunDirLock:
    """Create ``run_dir`` if needed, lock it, then run ``check()`` (the start-up checks); returns
    the held lock. On any failure nothing is left: the lock is released, and the directories
    this call created are removed (with the lock file, while still locked, so that a run
    starting at the same moment never holds a lock on a file that is gone).

    An unwritable place is a :class:`UserError` naming the directory; a live holder is
    :class:`RunDirBusy`."""
    path = Path(os.path.expanduser(str(run_dir))).resolve()
    created = []
    p = path
    while not p.exists() and p != p.parent:
        created.append(p)
        p = p.parent
    if not p.is_dir():  # the path, or the nearest part of it that exists, is a file
        what = "is a file" if p == path else f"is inside {p}, which is a file, not a directory"
        raise UserError(f"trainer.run_dir {path} {what}: choose a directory (or a path that does not exist yet) "
                        "for trainer.run_dir")
    lock = None
    try:
        try:
            for d in reversed(created):
                d.mkdir()
            lock = RunDirLock.acquire(path)
        except OSError as e:
            raise UserError(f"trainer.run_dir {path}: cannot create {e.filename or path} ({e.strerror}): choose a "
                            "writable trainer.run_dir") from None
        check()
        return lock
    except BaseException:
        if created:
            try:
                (path / LOCK_NAME).unlink(missing_ok=True)
            except OSError:  # never created (the path could not be made): nothing to remove
                pass
            for d in created:  # deepest first; a directory someone else filled meanwhile stays
                try:
                    d.rmdir()
                except OSError:
                    break
        if lock is not None:
            lock.release()
        raise
