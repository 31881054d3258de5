"""docker/: the Dockerfile is linted and pinned; install.sh's logic runs here in check/dry-run modes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent
FORBIDDEN = re.compile(r"(^|[\s\"'=])(apex|transformer[-_]engine[\w\[\],-]*)(\s|==|>=|$|\[)", re.I)


def _exe(name):
    exe = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert exe, f"{name} missing: install the [test] extra"
    return exe


def _install(*args, script=DOCKER / "install.sh", env=None):
    """Run install.sh with this python; the caller's PIP_CONSTRAINT only when ``env`` sets one."""
    full = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    full["PYTHON"] = sys.executable
    full.update(env or {})
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=120, env=full)


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
    assert runs == ["RUN bash docker/install.sh /opt/megatron_m2po", "RUN bash docker/install.sh --check-nccl"]
    # one NCCL: the image names the library scripts/train.sh preloads for the trainer, never LD_PRELOAD
    # itself (every process of the image would load the engines' 252 MB NCCL)
    preload = next(i for i, ln in enumerate(ins) if ln.startswith("ENV M2PO_NCCL_PRELOAD=/opt/m2po-nccl/libnccl.so.2"))
    assert ins.index(runs[0]) < preload < ins.index(runs[1])
    assert not any("LD_PRELOAD" in ln for ln in ins if ln.startswith("ENV "))
    copy_idx = next(i for i, ln in enumerate(ins) if ln.startswith("COPY docker/install.sh"))
    run_idx = ins.index(runs[0])
    pkg_idx = next(i for i, ln in enumerate(ins) if ln.startswith("COPY megatron_m2po"))
    assert copy_idx < run_idx and pkg_idx < run_idx
    env = " ".join(ln for ln in ins if ln.startswith("ENV "))
    assert "SGLANG_PYTHON=/opt/sglang/bin/python" in env
    # the non-editable install has no scripts/ beside it: the rehearsal finds them by this variable,
    # in the directory the scripts are copied to
    scripts_dir = re.search(r"M2PO_SCRIPTS_DIR=(\S+)", env).group(1)
    copy = ins.index("COPY scripts ./scripts")
    workdir = [ln.split()[1] for ln in ins[:copy] if ln.startswith("WORKDIR ")][-1]
    assert scripts_dir == f"{workdir}/scripts"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env  # trainer-only: scripts/train.sh sets it


def _constraints_cpu() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints-cpu.txt").read_text().splitlines():
        name, _, ver = line.split("#")[0].strip().partition("==")
        if ver:
            pins[name.lower().replace("_", "-")] = ver
    return pins


def test_install_check_passes_and_catches_bad_lines(tmp_path):
    r = _install("--check")
    assert r.returncode == 0, r.stderr
    assert "7 requirement lines ok" in r.stdout
    src = (DOCKER / "install.sh").read_text()
    cases = {
        '"apex"': "comes with the NGC base image",
        '"transformer-engine[pytorch]"': "comes with the NGC base image",
        '"torch"': "comes with the NGC base image",
        '"einops>=0.8"': "TRAIN_REQS names packages only; the version comes from constraints-cpu.txt",
        '"flask"': "constraints-cpu.txt has no exact pin for flask",
    }
    shutil.copy(REPO / "constraints-cpu.txt", tmp_path / "constraints-cpu.txt")
    script = tmp_path / "docker" / "install.sh"
    script.parent.mkdir()
    for line, msg in cases.items():
        script.write_text(src.replace('  "mbridge"\n', f'  "mbridge"\n  {line}\n', 1))
        r = _install("--check", script=script)
        assert r.returncode == 1, (line, r.stdout)
        assert msg in r.stderr, (line, r.stderr)
    script.write_text(src.replace('SGLANG_REQS=("sglang==0.5.23")', 'SGLANG_REQS=("sglang>=0.5")', 1))
    r = _install("--check", script=script)
    assert r.returncode == 1 and "sglang>=0.5: pin an exact version (==)" in r.stderr, r.stderr


def test_trainer_versions_are_the_ones_ci_tests(tmp_path):
    """constraints-cpu.txt is the one list of pins: the trainer requirements take their versions
    from it, and every trainer install runs with it as constraints (transformers included), less
    what the base image owns; a pin of the image's own PIP_CONSTRAINT wins, with a warning."""
    pins = _constraints_cpu()
    r = _install("--print-requirements")
    assert r.returncode == 0, r.stderr
    train = [ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("train ")]
    for req in train:
        name, ver = req.split("==")
        assert pins[name.split("[")[0]] == ver, req
    r = _install("--print-constraints")
    assert r.returncode == 0, r.stderr
    derived = dict(ln.split("==") for ln in r.stdout.splitlines() if not ln.startswith("#"))
    derived = {k.lower().replace("_", "-"): v for k, v in derived.items()}
    assert derived["transformers"] == pins["transformers"]
    assert derived["tokenizers"] == pins["tokenizers"] and derived["megatron-core"] == pins["megatron-core"]
    assert "torch" not in derived  # the NGC torch stays
    assert derived == {k: v for k, v in pins.items() if k not in ("torch", "triton")}
    image = tmp_path / "constraint.txt"  # NGC images set PIP_CONSTRAINT=/etc/pip/constraint.txt
    image.write_text(f"transformers==4.57.1\nnumpy=={pins['numpy']}\n")
    r = _install("--print-constraints", env={"PIP_CONSTRAINT": f"{image} /nonexistent.txt"})
    assert r.returncode == 0, r.stderr
    assert "transformers" not in r.stdout and "numpy" not in r.stdout
    assert f"transformers=={pins['transformers']} (the image pins 4.57.1)" in r.stderr
    assert "numpy" not in r.stderr  # same version: nothing to say


def test_install_dry_run_plan():
    r = _install("--dry-run", "/opt/megatron_m2po")
    assert r.returncode == 0, r.stderr
    cmds = [ln[2:] for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    assert cmds, r.stdout
    for c in cmds:
        assert not FORBIDDEN.search(c), c
        assert "[gpu]" not in c  # the gpu extra would pip-install transformer-engine
    trainer = [c for c in cmds if c.startswith(f"{sys.executable} -m pip install")]
    # trainer installs run under the image's PIP_CONSTRAINT (never cleared), so NGC's torch stays,
    # and under constraints-cpu.txt's versions
    assert all("PIP_CONSTRAINT" not in c for c in trainer)
    assert all(" -c /" in c and c.split(" -c ")[1].split()[0].endswith("m2po-train-constraints.txt") for c in trainer)
    assert any("megatron-core==0.16.1" in c and "nvidia-modelopt[torch]==0.47.0" in c for c in trainer)
    assert trainer[-1].endswith(" /opt/megatron_m2po")
    # the engine venv needs no ensurepip (python3-venv): stdlib venv without pip, then the image's pip
    assert f"{sys.executable} -m venv --without-pip /opt/sglang" in cmds
    assert f"env PIP_CONSTRAINT= {sys.executable} -m pip --python /opt/sglang/bin/python install --no-cache-dir " \
        "--upgrade pip" in cmds
    assert not any(re.search(r"-m venv (?!--without-pip)", c) for c in cmds)
    sgl = [c for c in cmds if "sglang==" in c]
    assert sgl == ["env PIP_CONSTRAINT= /opt/sglang/bin/python -m pip install --no-cache-dir sglang==0.5.23"]
    # the engine venv gets the handshake plugin, and the engines' NCCL is linked for the preload
    sgl_at = cmds.index(sgl[0])
    assert cmds[sgl_at + 1].startswith("env PIP_CONSTRAINT= /opt/sglang/bin/python -m pip install --no-cache-dir ")
    assert cmds[sgl_at + 1].endswith("/m2po-sglang-plugin")
    assert cmds[-1].startswith("ln -sf ") and cmds[-1].endswith(" /opt/m2po-nccl/libnccl.so.2")
    assert not any("sglang==" in c for c in trainer)


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_base_image_needs_te_but_not_apex(tmp_path):
    """apex is optional (the project does not need it): a base image with torch and TE but no apex
    passes the build's base check with a note; one without TE is refused, naming it."""
    base = tmp_path / "base"
    (base / "transformer_engine").mkdir(parents=True)
    (base / "transformer_engine" / "__init__.py").write_text("")
    dist = base / "transformer_engine-2.9.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.9.0\n")
    block_apex = tmp_path / "sitecustomize.py"  # the CPU venv has no apex either; make sure of it
    block_apex.write_text("import sys; sys.modules['apex'] = None\n")
    env = {"PYTHONPATH": f"{base}{os.pathsep}{tmp_path}"}
    r = _install("--check-base", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NVIDIA apex is not importable" in r.stdout and "does not need it" in r.stdout
    assert "base image ok: torch, transformer-engine 2.9.0" in r.stdout
    src = (DOCKER / "install.sh").read_text()
    assert "apex" not in re.findall(r"-c 'import ([^;']+)", src)[0]  # the final import check
    shutil.rmtree(base / "transformer_engine")
    r = _install("--check-base", env=env)
    assert r.returncode == 1 and "the base image lacks transformer_engine" in r.stderr, r.stdout + r.stderr
    dist.rename(base / "x")
    (base / "transformer_engine").mkdir()
    (base / "transformer_engine" / "__init__.py").write_text("")
    dist = base / "transformer_engine-2.12.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.12.0\n")
    r = _install("--check-base", env=env)
    assert r.returncode == 1 and "transformer-engine 2.12.0 is outside megatron-core 0.16.1's tested range" in r.stderr


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_engine_venv_is_made_without_ensurepip(tmp_path):
    """`install.sh --venv DIR` makes the engine venv as the image build does: stdlib venv
    --without-pip (Debian/Ubuntu pythons lack ensurepip without python3-venv), then this python's
    pip installs pip into it (offline here, from the wheel this python bundles)."""
    import ensurepip

    bundled = Path(ensurepip.__file__).parent / "_bundled"
    if not list(bundled.glob("pip-*.whl")):
        pytest.skip(f"no bundled pip wheel in {bundled} to install offline")
    venv = tmp_path / "engines"
    r = _install("--venv", str(venv), env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(bundled),
                                           "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    cmds = [ln[2:] for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    assert cmds[0] == f"{sys.executable} -m venv --without-pip {venv}"
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert pip.returncode == 0 and str(venv) in pip.stdout, pip.stdout + pip.stderr
    r = _install("--venv")
    assert r.returncode == 2 and "--venv needs a directory" in r.stderr


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


def _readme_rows() -> dict[str, list[str]]:
    text = (DOCKER / "README.md").read_text()
    table = text[text.index("| recipe | layout |"):]
    rows = {}
    for ln in table.splitlines()[2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_readme_layouts_are_the_recipes():
    """docker/README.md's 32B layout and its table say what the recipes and `m2po plan` say: the
    layout from each recipe's parallel section at its run script's NNODES x GPUS_PER_NODE, the
    memory from the planner."""
    import yaml

    rows = _readme_rows()
    assert set(rows) == {"qwen2.5-32b", "qwen2.5-32b-32k", "qwen3-32b", "qwen2.5-math-7b", "qwen3-8b"}, rows
    for recipe, cells in rows.items():
        par = yaml.safe_load((REPO / "examples" / f"{recipe}.yaml").read_text())["parallel"]
        run = (REPO / "scripts" / f"run_{recipe.replace('-', '_')}.sh").read_text()
        nodes, gpus = map(int, re.search(r"NNODES=\$\{NNODES:-(\d+)\} GPUS_PER_NODE=\$\{GPUS_PER_NODE:-(\d+)\}",
                                         run).groups())
        tp, pp, cp = par.get("tensor_parallel", 1), par.get("pipeline_parallel", 1), par.get("context_parallel", 1)
        recompute = par.get("recompute", "none")
        layout = (f"{nodes}x{gpus}, TP{tp} PP{pp}{f' CP{cp}' if cp > 1 else ''} DP{nodes * gpus // (tp * pp * cp)}"
                  f"{', SP' if par.get('sequence_parallel') else ''}, "
                  f"{'no recompute' if recompute == 'none' else recompute + ' recompute'}")
        assert cells[0] == layout, (recipe, cells[0], layout)
        r = subprocess.run([_exe("m2po"), "plan", "--json", "--nnodes", str(nodes), "--gpus-per-node", str(gpus),
                            str(REPO / "examples" / f"{recipe}.yaml")], capture_output=True, text=True, timeout=120)
        plan = json.loads(r.stdout)
        worst = max(plan["stages"], key=lambda s: s["total"])
        last = plan["stages"][-1]
        g = 2 ** 30
        want = [f"{worst[k] / g:.1f}" for k in ("weights", "gradients", "optimizer", "activations")]
        want += [f"{last['logits_fused'] / g:.1f} / {last['logits_naive'] / g:.1f}", f"{plan['worst_total_gib']:.1f} GiB"]
        assert cells[1:] == want, (recipe, cells[1:], want)
    text = (DOCKER / "README.md").read_text()
    multi = text[text.index("## Multi-node (32B)"):text.index("1. On each rollout node")]
    assert rows["qwen2.5-32b"][0].split(", ", 1)[1].replace("TP", "TP=").replace(" PP", " x PP=").replace(
        " CP", " x CP=").replace(" DP", " x DP=").split(",")[0] in multi, multi
    assert "sequence parallel, no recompute" in multi and "TP=8" not in multi and "full recompute" not in multi


def _fake_nccl(tmp_path, name: str, version: str) -> Path:
    """A python whose torch reports NCCL ``version`` (a sitecustomize on this CPU torch, which has none)."""
    d = tmp_path / name
    d.mkdir()
    (d / "sitecustomize.py").write_text(f"import torch.cuda.nccl as n\nn.version = lambda: {version!r}\n")
    exe = d / "python"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={d} exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return exe


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_check_nccl_stops_the_build_on_two_builds(tmp_path):
    """--check-nccl asks both Pythons' torch.cuda.nccl.version(): equal passes; different stops the
    build (exit 1) naming both versions and the preload that fixes it."""
    engines = tmp_path / "venv"
    (engines / "bin").mkdir(parents=True)
    trainer = _fake_nccl(tmp_path, "trainer", (2, 28, 9))
    (engines / "bin" / "python").symlink_to(_fake_nccl(tmp_path, "engine", (2, 30, 7)))
    r = _install("--check-nccl", env={"PYTHON": str(trainer), "SGLANG_VENV": str(engines)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NCCL mismatch" in r.stderr and "NCCL 2.28.9" in r.stderr and "NCCL 2.30.7" in r.stderr, r.stderr
    assert "LD_PRELOAD=/opt/m2po-nccl/libnccl.so.2" in r.stderr
    (engines / "bin" / "python").unlink()
    (engines / "bin" / "python").symlink_to(_fake_nccl(tmp_path, "engine2", (2, 28, 9)))
    r = _install("--check-nccl", env={"PYTHON": str(trainer), "SGLANG_VENV": str(engines)})
    assert r.returncode == 0 and "one NCCL for trainer and engines: 2.28.9" in r.stdout, r.stdout + r.stderr


def test_the_build_stops_when_the_image_nccl_is_newer_than_the_engines(tmp_path):
    """Only the newer NCCL may be preloaded into the other torch: the engines' (what the trainer
    preloads) must be at least the image's own, else the build stops naming both and what to pin."""
    engines = tmp_path / "venv"
    (engines / "bin").mkdir(parents=True)
    (engines / "bin" / "python").symlink_to(_fake_nccl(tmp_path, "engine", (2, 27, 3)))
    trainer = _fake_nccl(tmp_path, "trainer", (2, 28, 9))
    r = _install("--compare-nccl", env={"PYTHON": str(trainer), "SGLANG_VENV": str(engines)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "image's NCCL 2.28.9" in r.stderr and "engines' NCCL 2.27.3" in r.stderr and "NGC tag" in r.stderr
    (engines / "bin" / "python").unlink()
    (engines / "bin" / "python").symlink_to(_fake_nccl(tmp_path, "engine2", (2, 30, 7)))
    r = _install("--compare-nccl", env={"PYTHON": str(trainer), "SGLANG_VENV": str(engines)})
    assert r.returncode == 0 and "engines' NCCL 2.30.7 serves the trainer" in r.stdout, r.stdout + r.stderr


def test_sglang_plugin_project_installs_the_entry_point_sglang_loads(tmp_path):
    """The plugin project install.sh puts into the engine venv registers ``register`` under the
    entry-point group SGLang 0.5.23 loads general plugins from (``srt/plugins/__init__.py``
    GENERAL_PLUGINS_GROUP, read from the wheel), and the installed module is the repo's plugin."""
    from sglang_source import wheel

    with wheel() as z:  # skips without the wheel scripts/setup.sh downloads (fails under CI)
        src = z.read("sglang/srt/plugins/__init__.py").decode()
    group = re.search(r'^GENERAL_PLUGINS_GROUP = "([^"]+)"', src, re.M).group(1)
    proj = tmp_path / "proj"
    r = _install("--plugin-project", str(proj))
    assert r.returncode == 0, r.stderr
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(proj)], capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    probe = subprocess.run([sys.executable, "-c", (
        "import sys; from importlib.metadata import entry_points; "
        f"eps = [e for e in entry_points(group={group!r}) if e.name == 'm2po_nccl_handshake']; "
        "fn = eps[0].load(); import m2po_sglang_plugin as m; print(fn is m.register, m.__file__)")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(target)})
    assert probe.returncode == 0 and probe.stdout.startswith("True "), probe.stdout + probe.stderr
    assert (target / "m2po_sglang_plugin.py").read_text() == (REPO / "megatron_m2po/rollout/sglang_plugin.py").read_text()
