"""One launcher for every ``m2po`` command a test runs as a process (``m2po train`` above all).

A plain ``python -m megatron_m2po.cli train ...`` pays ~3-5 s of CPU importing torch, Megatron-Core
and transformers before it does anything, and the suite starts dozens of them. Here a server
process imports those once (:data:`PRELOAD`); each command is a ``fork()`` of it that runs
``megatron_m2po.cli`` exactly as ``python -m`` does (``runpy.run_module(..., run_name="__main__")``)
with the test's argv, environment, working directory and log file, in a new session (so
``os.killpg(run.pid, SIGKILL)`` reaches the whole tree, as for ``start_new_session=True``), and
exits the way an interpreter does (non-daemon threads joined, ``atexit`` handlers, streams flushed).
The server holds no thread, no multiprocessing state and has run no torch op when it forks, so a
command starts as a fresh process would (``tests/test_launcher.py`` holds a forked run's metrics
to a plain subprocess's and its SIGKILL to the whole tree).

Variables that a library reads while it is imported (the OpenMP / BLAS thread counts, ``LD_PRELOAD``,
``PYTHONPATH``, ...) cannot change after the fork: a command whose environment differs from the
server's in one of them (:data:`IMPORT_TIME_VARS`) runs as a plain subprocess instead, as does every
command when ``M2PO_TEST_LAUNCHER=subprocess``.

    run = start(["train", EXAMPLE, "trainer.run_dir=..."], log=tmp_path / "train.log")
    rc = run.wait(timeout=300)          # or run.poll(); os.killpg(run.pid, signal.SIGKILL)
    rc, text = run_cli(["train", ...], log=tmp_path / "train.log", timeout=300)

One server per test process (per xdist worker), started on first use and stopped at exit.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
MODULE = "megatron_m2po.cli"
# What a trainer imports before its first step (kept to modules that start no thread at import).
PRELOAD = ["torch", "torch.distributed", "numpy", "transformers", "safetensors.torch", "megatron.core",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
           "mbridge", "aiohttp", "yaml", "megatron_m2po.cli", "megatron_m2po.trainer.cli",
           "megatron_m2po.trainer.loop", "megatron_m2po.actor.actor", "megatron_m2po.standins.tiny_base",
           "megatron_m2po.rollout_service.service"]
# Read by a library while it is imported (or by the dynamic loader): a fork cannot change them.
IMPORT_TIME_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
                    "OPENBLAS_L2_SIZE", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED",
                    "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "MALLOC_ARENA_MAX", "KMP_AFFINITY",
                    "GOMP_CPU_AFFINITY", "TORCH_CPP_LOG_LEVEL", "M2PO_TEST_LAUNCHER")
_HEADER = struct.Struct("!I")


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket):
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    data = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if data is None else pickle.loads(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# ---------------------------------------------------------------------------------------------
# The server (``python tests/launcher.py --serve SOCKET``)
# ---------------------------------------------------------------------------------------------

def _exit_status(status: int) -> int:
    """A wait status as ``subprocess.Popen.returncode`` gives it (-N for signal N)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, inherited: list, fds: tuple[int, ...]) -> None:
    """In the forked process: become ``python -m megatron_m2po.cli <argv>`` and never return."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for obj in inherited:
            obj.close()
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND  # created (or emptied) by the client already
        log = os.open(request["log"], flags, 0o644)
        err = os.open(request["err"], flags, 0o644) if request.get("err") else log
        os.dup2(log, 1)
        os.dup2(err, 2)
        os.close(log)
        if err != log:
            os.close(err)
        os.close(null)
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))

        def stream(fd: int) -> io.TextIOWrapper:
            raw = io.FileIO(fd, "w", closefd=False)
            return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8",
                                    errors="backslashreplace", write_through=unbuffered)

        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = stream(1)
        sys.stderr = sys.__stderr__ = stream(2)
        os.chdir(request["cwd"])
        # sys.path as `python -m` builds it: the working directory, $PYTHONPATH, then the installation's.
        ours = {"", str(Path(__file__).parent), *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
        theirs = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *theirs] + [p for p in sys.path if p not in ours]
        os.environ.clear()
        os.environ.update(request["env"])
        import numpy as np
        import torch
        np.random.seed()  # fresh entropy, as a new process draws (Python's random reseeds itself at fork)
        torch.manual_seed(_TORCH_DEFAULT_SEED)  # a fresh process's generator state
        import runpy
        sys.modules.pop(MODULE, None)  # run fresh as __main__, as `python -m` does (runpy warns otherwise)
        sys.argv = [MODULE, *request["argv"]]
        try:
            runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter would print and exit 1 for
            sys.excepthook(*sys.exc_info())
            code = 1
        # The interpreter's shutdown: non-daemon threads, then atexit handlers, then the streams.
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        try:
            import traceback
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


# c10's default_rng_seed_val: what torch's CPU generator starts from in a new process.
_TORCH_DEFAULT_SEED = 67280421310721


def _serve(path: str) -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")  # EOF: the test process is gone
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    running = True
    while running:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                request = _recv(conn)
                if request is None:
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, [sel, listener, conn, *children.values()], (wake_r, wake_w))
                children[pid] = conn
                _send(conn, pid)
            elif key.data == "child":
                os.read(wake_r, 4096)
            elif key.data == "parent":
                if not sys.stdin.buffer.read1(1):
                    running = False
        while children:  # reap whatever exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, _exit_status(status))
                except OSError:
                    pass
                conn.close()
    for pid in children:  # the test process is gone: nothing it started may outlive it
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------

class Run:
    """A command started through the server: ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``,
    ``returncode``, ``send_signal`` and ``kill`` (the command is the leader of its own session)."""

    def __init__(self, conn: socket.socket, pid: int, argv: list[str], log: Path):
        self._conn, self.pid, self.args, self.log = conn, pid, argv, log
        self.returncode: int | None = None

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                status = _recv(self._conn)
            except (socket.timeout, BlockingIOError):
                return None
            self.returncode = status if status is not None else -signal.SIGKILL  # the server itself died
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._collect(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_tree(self) -> None:
        """SIGKILL the command's whole session (what a test does in its ``finally``)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


class _PlainRun(Run):
    """The same handle over a plain ``subprocess.Popen`` (the fallback)."""

    def __init__(self, proc: subprocess.Popen, argv: list[str], log: Path):
        self._proc, self.pid, self.args, self.log = proc, proc.pid, argv, log
        self.returncode = None

    def _collect(self, timeout: float | None) -> int | None:
        try:
            self.returncode = self._proc.wait(timeout=timeout) if timeout != 0.0 else self._proc.poll()
        except subprocess.TimeoutExpired:
            return None
        return self.returncode


class _Server:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="m2po-launcher-")
        self.path = os.path.join(self.dir, "sock")
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "PYTHONUNBUFFERED": "1"}
        self.errors = os.path.join(self.dir, "server.log")  # the preloaded libraries' import warnings
        with open(self.errors, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, "--serve", self.path], cwd=ROOT, env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            tail = Path(self.errors).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the test launcher did not start (exit {self.proc.poll()}): {line!r}\n{tail}")
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # EOF: the server kills what is left and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    def forkable(self, env: Mapping[str, str]) -> bool:
        return all(env.get(v) == self.env.get(v) for v in IMPORT_TIME_VARS)


_server: _Server | None = None
_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        return _server


def base_env(**extra: str) -> dict[str, str]:
    """The environment every command gets: the test's, one OpenMP thread, unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def start(argv: Sequence[str], *, log: Path | str, env: Mapping[str, str] | None = None,
          cwd: Path | str = ROOT, append: bool = True, plain: bool = False, err: Path | str | None = None) -> Run:
    """Start ``m2po <argv>`` (output appended to ``log``; stderr to ``err`` when given) in a new
    session; returns its handle. ``plain``: as ``python -m megatron_m2po.cli`` in a plain
    subprocess, not forked."""
    argv = [str(a) for a in argv]
    env = dict(base_env() if env is None else env)
    log = Path(log)
    for path in (log, err):  # exists when this returns, as with a Popen given an open file
        if path is not None:
            open(path, "ab" if append else "wb").close()
    if not plain and os.environ.get("M2PO_TEST_LAUNCHER") != "subprocess":
        server = _get_server()
        if server.forkable(env):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(server.path)
            _send(conn, {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log), "append": append,
                         "err": str(err) if err else None})
            pid = _recv(conn)
            if pid is None:
                raise RuntimeError("the test launcher closed the connection before starting the command")
            return Run(conn, pid, argv, log)
    out = open(log, "ab")
    errs = open(err, "ab") if err else None
    try:
        proc = subprocess.Popen([sys.executable, "-m", MODULE, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=errs or subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()
        if errs:
            errs.close()
    return _PlainRun(proc, argv, log)


def run_cli(argv: Sequence[str], *, log: Path | str, env: Mapping[str, str] | None = None,
            cwd: Path | str = ROOT, timeout: float = 300, plain: bool = False) -> tuple[int, str]:
    """Run ``m2po <argv>`` to its end (its whole tree SIGKILLed past ``timeout``); returns
    ``(exit code, what this run wrote to the log)``."""
    log = Path(log)
    offset = log.stat().st_size if log.is_file() else 0
    run = start(argv, log=log, env=env, cwd=cwd, plain=plain)
    try:
        rc = run.wait(timeout=timeout)
    finally:
        if run.poll() is None:
            run.kill_tree()
    return rc, log.read_bytes()[offset:].decode(errors="replace")


def run_captured(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | str = ROOT,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, megatron_m2po.cli, *argv], capture_output=True, text=True)``
    through the launcher: stdout and stderr apart."""
    with tempfile.TemporaryDirectory(prefix="m2po-run-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        run = start(argv, log=out, err=err, env=env, cwd=cwd, append=False)
        try:
            rc = run.wait(timeout=timeout)
        finally:
            if run.poll() is None:
                run.kill_tree()
        return subprocess.CompletedProcess([MODULE, *argv], rc, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"


def train(run_dir: Path, *overrides: str, config: Path | str = EXAMPLE, env: Mapping[str, str] | None = None,
          log: Path | None = None, timeout: float = 500, wait: bool = True, plain: bool = False) -> Run | str:
    """``m2po train CONFIG trainer.run_dir=RUN_DIR <overrides>``, output appended to ``log``
    (``RUN_DIR.log`` beside it by default). ``wait``: to its end, failing the test with the log's
    tail unless it exits 0, and returning what this run wrote to the log; else the running handle."""
    log = Path(log) if log is not None else run_dir.parent / f"{run_dir.name}.log"
    argv = ["train", str(config), f"trainer.run_dir={run_dir}", *overrides]
    if not wait:
        return start(argv, log=log, env=env, plain=plain)
    rc, text = run_cli(argv, log=log, env=env, timeout=timeout, plain=plain)
    if rc != 0:
        raise AssertionError(f"m2po train exited with {rc}:\n{text[-4000:]}")
    return text


class SharedRuns:
    """Tiny runs shared by the tests that assert on them, each run once per test process, keyed by
    its config, overrides and extra environment (the ``shared_runs`` fixture of tests/conftest.py).
    A test that shares a run must only read it (or run the same command again on it, which leaves a
    finished run as it was); tests sharing one run belong to one ``xdist_group``."""

    def __init__(self, root: Path):
        self.root = root
        self._runs: dict[tuple, Path | AssertionError] = {}

    def get(self, *overrides: str, config: Path | str = EXAMPLE, env: Mapping[str, str] | None = None,
            timeout: float = 500) -> Path:
        key = (str(config), overrides, tuple(sorted((env or {}).items())))
        if key not in self._runs:
            run = self.root / f"run{len(self._runs)}"
            try:
                train(run, *overrides, config=config, env=None if env is None else base_env(**env), timeout=timeout)
                self._runs[key] = run
            except AssertionError as e:  # every test sharing the run fails with its log
                self._runs[key] = e
        got = self._runs[key]
        if isinstance(got, AssertionError):
            raise got
        return got


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(sys.argv[2])
