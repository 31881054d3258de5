"""Run-time mistakes end in one line (docs/design.md §5): ``m2po`` prints what is wrong and what to
do on stderr, exits 2, shows no traceback, and leaves no run directory behind.

Each case runs the real command (``python -m megatron_m2po.cli``, through tests/launcher.py) on the
tiny CPU example with one mistake; the checks of ``trainer/preflight.py`` answer before Megatron-Core is imported, so a
case costs about the config's validation (~2-3 s). A rank-0 mistake under several ranks reaches every rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

import launcher
from megatron_m2po.standins.dist_testing import run_distributed
from megatron_m2po.utils.net import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"


def m2po(*args: str, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in drop and k != "M2PO_DEBUG"}
    full.update(OMP_NUM_THREADS="1", **(env or {}))
    return launcher.run_captured(args, env=full, timeout=120)


def one_line(p: subprocess.CompletedProcess, *parts: str) -> str:
    """The single stderr line of a refused command, holding every one of ``parts``."""
    out = p.stdout + p.stderr
    assert p.returncode == 2, f"exit code {p.returncode}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{p.stderr[-4000:]}"
    for part in parts:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"
    return lines[0]


def train(run: Path, *overrides: str, **kw) -> subprocess.CompletedProcess:
    return m2po("train", str(EXAMPLE), f"trainer.run_dir={run}", *overrides, **kw)


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_missing_data_file(tmp_path):
    run, data = tmp_path / "run", tmp_path / "train.jsonl"
    one_line(train(run, f"data.train={data}"), f"m2po train: data.train={str(data)!r} does not exist",
             "DeepScaleR schema")
    assert not run.exists()


def test_unreadable_data_file_is_named_with_its_reason(tmp_path):
    run = tmp_path / "run"
    (tmp_path / "train.jsonl").mkdir()  # readable by nobody as a file, root included
    one_line(train(run, f"data.train={tmp_path / 'train.jsonl'}"), "data.train=", "is not a file")
    assert not run.exists()


def test_unwritable_run_dir():
    # Nobody may create a directory at the top of sysfs (EPERM as root, EACCES otherwise).
    run = Path("/sys") / f"m2po-test-{uuid.uuid4().hex[:8]}" / "run"
    one_line(train(run), f"trainer.run_dir {run}: cannot create {run.parent}", "choose a writable trainer.run_dir")


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_external_source_without_the_ingestion_token(tmp_path):
    run = tmp_path / "run"
    p = train(run, "rollout.source=external", "trainer.mode=async", "store.serve_port=0", drop=("M2PO_STORE_TOKEN",))
    one_line(p, "rollout.source=external needs the ingestion token", "$M2PO_STORE_TOKEN", "Authorization: Bearer")
    assert not run.exists()


@pytest.mark.parametrize("where", ["ingestion", "router"])
@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_port_in_use(tmp_path, where):
    run = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        if where == "ingestion":
            p = train(run, "rollout.source=external", "trainer.mode=async", f"store.serve_port={port}",
                      env={"M2PO_STORE_TOKEN": "t"})
            one_line(p, f"store.serve_port={port}", f"127.0.0.1:{port} (Address already in use)")
        else:  # the router takes rollout.base_port - 1
            p = train(run, f"rollout.base_port={port + 1}")
            one_line(p, f"rollout.base_port={port + 1}: the router's port 127.0.0.1:{port}", "Address already in use")
    assert not run.exists()


@pytest.mark.parametrize("what", ["engine", "router"])
def test_unreachable_external_engine_or_router(tmp_path, what):
    run, url = tmp_path / "run", f"http://127.0.0.1:{free_port()}"  # nothing listens there
    if what == "engine":
        p = train(run, "rollout.launcher=external", f"rollout.external_addrs=[{url}]")
        one_line(p, f"rollout.external_addrs: nothing answers at {url} (Connection refused)")
    else:
        p = train(run, "rollout.launcher=external", f"rollout.router_addr={url}")
        one_line(p, f"rollout.router_addr={url}: nothing answers there (Connection refused)")
    assert not run.exists()


def test_base_model_path_that_does_not_exist(tmp_path):
    run = tmp_path / "run"
    one_line(train(run, f"model.hf_path={tmp_path / 'no_model'}"), "no_model' does not exist", "model.hf_path")
    assert not run.exists()


def test_eval_of_an_engine_that_is_not_there_and_the_debug_switches(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    args = ("eval", str(EXAMPLE), f"trainer.run_dir={tmp_path / 'run'}", "--engine-url", url)
    one_line(m2po(*args), f"m2po eval: --engine-url {url}: nothing answers there (Connection refused)")
    # --debug (anywhere on the line) or M2PO_DEBUG=1: the traceback instead of the one line.
    for p in (m2po("--debug", *args), m2po(*args, "--debug"), m2po(*args, env={"M2PO_DEBUG": "1"})):
        assert p.returncode != 0 and "Traceback" in p.stderr and "UserError: --engine-url" in p.stderr, p.stderr


def _bad_rows_rank(rank: int, world_size: int, run_dir: str, data: str) -> str:
    from megatron_m2po.config import load_config
    from megatron_m2po.trainer.loop import Trainer
    from megatron_m2po.utils.errors import UserError

    cfg = load_config(str(EXAMPLE), [f"trainer.run_dir={run_dir}", f"data.train={data}", "rollout.num_engines=1",
                                     "logging.progress=false"])
    try:
        Trainer(cfg).run()
    except UserError as e:
        return str(e)
    return "no error"


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_a_rank0_mistake_reaches_every_rank(tmp_path):
    """A data file with a bad row fails rank 0's start-up checks; rank 1, waiting for rank 0, gets
    rank 0's message at once instead of waiting for rank 0's next result (under torchrun, on
    another node, until killed); no run directory is left behind."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1"}\n')
    out = run_distributed(_bad_rows_rank, world_size=2, args=(str(tmp_path / "run"), str(data)), timeout_s=240)
    assert "row 0 (line 1) lacks field(s) ['answer']" in out[0], out
    assert out[1] == f"rank 0: {out[0]}", out
    assert not (tmp_path / "run").exists()


def test_a_bad_row_is_found_before_the_run_dir_is_created(tmp_path):
    """A parsable data file with one bad row (row 2: no answer) is refused in one line naming the row
    and the field, before the run directory or its lock exist."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2"}\n')
    run = tmp_path / "run"
    one_line(train(run, f"data.train={data}"), "row 1 (line 3) lacks field(s) ['answer']", "DeepScaleR schema")
    assert not run.exists()


def test_run_dir_inside_a_regular_file_is_refused_in_one_line(tmp_path):
    """A run_dir whose parent is a file (and a run_dir that is a file) is refused before anything is
    created; the clean-up of the refusal used to crash (NotADirectoryError unlinking <file>/run/.lock)."""
    f = tmp_path / "notes.txt"
    f.write_text("x")
    one_line(train(f / "run"), f"trainer.run_dir {f / 'run'} is inside {f}, which is a file", "choose a directory")
    one_line(train(f), f"trainer.run_dir {f} is a file", "choose a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and f.read_text() == "x"


class _NotSGLang:
    """A web server at the engine's address that is not a ready SGLang engine: ``health`` and
    ``model_info`` are what it answers to ``GET /health`` and ``GET /model_info``."""

    def __init__(self, health: tuple[int, str], model_info: tuple[int, str]):
        import http.server
        import threading

        answers = {"/health": health, "/model_info": model_info}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = answers.get(self.path, (404, "<html>Not Found</html>"))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if body.startswith("{") else "text/html")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.parametrize("health,model_info,said", [
    ((404, "<html>Not Found</html>"), (404, ""), "answers GET /health with 404 text/html '<html>Not Found</html>', "
                                                 "where an SGLang engine answers 200"),
    ((503, ""), (200, '{"model_path": "m"}'), "answers GET /health with 503: an SGLang engine that is still loading"),
    ((200, "ok"), (200, '{"status": "ok"}'), "answers GET /model_info with 200 application/json '{\"status\": "
                                             "\"ok\"}', where an SGLang engine answers a JSON object with model_path"),
], ids=["wrong-server", "loading", "no-model-info"])
def test_external_engine_that_is_not_a_ready_sglang_engine(tmp_path, health, model_info, said):
    """Something answers at the address, but not a ready SGLang engine: the start-up check says what
    it answered and what SGLang answers (a wrong port reads differently from an engine still
    loading), exit 2 in one line, before the run directory exists (the fleet's own validation used
    to find it after the run dir, store and lock were created)."""
    fake = _NotSGLang(health, model_info)
    run = tmp_path / "run"
    try:
        p = train(run, "rollout.launcher=external", f"rollout.external_addrs=[{fake.url}]", "trainer.num_steps=1",
                  "logging.progress=false")
    finally:
        fake.server.shutdown()
    one_line(p, f"m2po train: rollout.external_addrs: {fake.url} {said}")
    assert not run.exists()
