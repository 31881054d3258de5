"""docker/: the Dockerfile is linted and pinned; install.sh's logic runs here in check/dry-run modes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent
FORBIDDEN = re.compile(r"(^|[\s\"'=])(apex|transformer[-_]engine[\w\[\],-]*)(\s|==|>=|$|\[)", re.I)


def _exe(name):
    exe = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert exe, f"{name} missing: install the [test] extra"
    return exe


def _install(*args, script=DOCKER / "install.sh"):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60, env=env)


def _instructions():
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_hadolint_clean():
    r = subprocess.run([_exe("hadolint"), str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shellcheck_install_script():
    r = subprocess.run([_exe("shellcheck"), str(DOCKER / "install.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_base_image_is_pinned_ngc_pytorch_py3():
    froms = [ln for ln in _instructions() if ln.upper().startswith("FROM ")]
    assert len(froms) == 1
    image = froms[0].split()[1]
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", image)
    assert m, f"base image {image} must be an NGC PyTorch tag YY.MM-py3"
    assert (int(m.group(1)), int(m.group(2))) >= (25, 1)  # Ubuntu 24.04 / Python 3.12 images


def test_dockerfile_never_pip_installs_apex_or_te_and_runs_install_script():
    ins = _instructions()
    runs = [ln for ln in ins if ln.upper().startswith("RUN ")]
    for ln in runs:
        assert not FORBIDDEN.search(ln), ln
    assert runs == ["RUN bash docker/install.sh /opt/megatron_m2po"]
    copy_idx = next(i for i, ln in enumerate(ins) if ln.startswith("COPY docker/install.sh"))
    run_idx = ins.index(runs[0])
    pkg_idx = next(i for i, ln in enumerate(ins) if ln.startswith("COPY megatron_m2po"))
    assert copy_idx < run_idx and pkg_idx < run_idx
    env = " ".join(ln for ln in ins if ln.startswith("ENV "))
    assert "SGLANG_PYTHON=/opt/sglang/bin/python" in env
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env  # trainer-only: scripts/train.sh sets it


def test_install_check_passes_and_catches_bad_lines(tmp_path):
    r = _install("--check")
    assert r.returncode == 0, r.stderr
    assert "7 requirement lines ok" in r.stdout
    src = (DOCKER / "install.sh").read_text()
    cases = {
        '"apex==0.1"': "comes with the NGC base image",
        '"transformer-engine[pytorch]==2.9.0"': "comes with the NGC base image",
        '"torch==2.8.0"': "comes with the NGC base image",
        '"einops>=0.8"': "pin an exact version",
        '"megatron-core==0.15.0"': "constraints-cpu.txt pins megatron-core==0.16.1",
    }
    for line, msg in cases.items():
        bad = src.replace('  "mbridge==0.15.1"\n', f'  "mbridge==0.15.1"\n  {line}\n', 1)
        if "megatron-core" in line:
            bad = src.replace('"megatron-core==0.16.1"', line, 1)
        script = tmp_path / "docker" / "install.sh"
        script.parent.mkdir(exist_ok=True)
        script.write_text(bad)
        shutil.copy(REPO / "constraints-cpu.txt", tmp_path / "constraints-cpu.txt")
        r = _install("--check", script=script)
        assert r.returncode == 1, (line, r.stdout)
        assert msg in r.stderr, (line, r.stderr)


def test_install_dry_run_plan():
    r = _install("--dry-run", "/opt/megatron_m2po")
    assert r.returncode == 0, r.stderr
    cmds = [ln[2:] for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    assert cmds, r.stdout
    for c in cmds:
        assert not FORBIDDEN.search(c), c
        assert "[gpu]" not in c  # the gpu extra would pip-install transformer-engine
    trainer = [c for c in cmds if c.startswith(f"{sys.executable} -m pip install")]
    # trainer installs run under the image's PIP_CONSTRAINT (never cleared), so NGC's torch stays
    assert all("PIP_CONSTRAINT" not in c for c in trainer)
    assert any("megatron-core==0.16.1" in c and "nvidia-modelopt[torch]==0.47.0" in c for c in trainer)
    assert trainer[-1].endswith("install --no-cache-dir /opt/megatron_m2po")
    sgl = [c for c in cmds if "sglang==" in c]
    assert sgl == ["env PIP_CONSTRAINT= /opt/sglang/bin/python -m pip install --no-cache-dir sglang==0.5.23"]
    assert not any("sglang==" in c for c in trainer)


def test_print_requirements_split():
    r = _install("--print-requirements")
    rows = [ln.split(" ", 1) for ln in r.stdout.splitlines()]
    envs = {}
    for env, req in rows:
        envs.setdefault(env, []).append(req.split("==")[0].split("[")[0])
    assert envs["train"] == ["megatron-core", "mbridge", "math-verify", "ray", "sglang-router", "nvidia-modelopt"]
    assert envs["sglang"] == ["sglang"]


def test_dockerignore_keeps_venv_out_of_context():
    lines = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in lines and ".git" in lines
